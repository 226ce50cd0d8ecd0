"""Token rows on disk while a build streams: a source's tokenized rows, and the training examples written.

A streaming build (open_sft.data.stream) never holds a corpus's tokens in memory. Each chunk's rows are
appended to a Spill (flat files of the tokens and of a few numbers per row: its source row index, length and
trained count), committed chunk by chunk so that a killed build resumes; the selection, truncation and block
cutting then read the tokens back a piece at a time (mapped for that piece only), and an ExampleWriter writes
the training examples straight into the cache entry's Arrow shards. The corpus's tokens are never in memory
together; what grows with it, once labelling is done, is a few numbers per row.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np

from open_sft.data.token_rows import TokenRows, row_bounds
from open_sft.durable import write_json

PIECE_TOKENS = 1 << 18  # tokens gathered from a spill (and written) at a time, in whole rows


def pieces(lengths: np.ndarray, tokens: int = PIECE_TOKENS) -> Iterator[tuple[int, int]]:
    """[start, stop) of consecutive runs of rows of about `tokens` tokens (at least one row each)."""
    ends = np.cumsum(lengths, dtype=np.int64)
    start = 0
    while start < len(lengths):
        before = int(ends[start - 1]) if start else 0
        stop = max(start + 1, int(np.searchsorted(ends, before + tokens, side="right")))
        yield start, stop
        start = stop


class Spill:
    """Token rows appended in ascending source-row order, a chunk at a time; `close()` reads them back.

    Everything lives in files of `directory`: the tokens (ids, labels) and a few numbers per row (its source row
    index, length and trained count), so nothing grows in memory while a corpus is labelled. After each chunk
    `commit` flushes the files and records their sizes (and the chunk's notes) in `<name>.state.json`, written
    atomically: a build that is killed resumes after its last committed chunk (`chunks`, `notes`), the files cut
    back to the recorded sizes. A state written for another `tag` (another chunking) is not resumed from.
    """

    def __init__(self, directory: Path, name: str, keep_labels: bool = True, tag: Any = None):
        directory.mkdir(parents=True, exist_ok=True)
        kinds = ["ids", "index", "lengths"] + (["labels", "trained"] if keep_labels else [])
        self.paths = {kind: directory / f"{name}.{kind}" for kind in kinds}
        self.notes_path, self.state_path = directory / f"{name}.notes", directory / f"{name}.state.json"
        self.keep_labels, self.tag = keep_labels, tag
        state = self._state()
        self.chunks, self.rows = (state["chunks"], state["rows"]) if state else (0, 0)
        sizes = state["sizes"] if state else {}
        self.files = {}
        for kind, path in [*self.paths.items(), ("notes", self.notes_path)]:
            handle = open(path, "r+b" if state else "w+b")
            handle.truncate(sizes.get(kind, 0))  # a killed build's bytes after its last commit
            handle.seek(0, 2)
            self.files[kind] = handle

    def _state(self) -> Optional[dict]:
        """The committed state to resume from, or None (none, another chunking, files missing or short)."""
        try:
            state = json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            return None
        paths = {**self.paths, "notes": self.notes_path}
        if state.get("tag") != self.tag or set(state.get("sizes", {})) != set(paths):
            return None
        if any(not paths[k].is_file() or paths[k].stat().st_size < size for k, size in state["sizes"].items()):
            return None
        return state

    def notes(self) -> list[Any]:
        """The notes committed with each chunk so far (those of a build resumed from)."""
        self.files["notes"].seek(0)
        notes = [json.loads(line) for line in self.files["notes"].read().splitlines()]
        self.files["notes"].seek(0, 2)
        return notes

    def append(self, index: np.ndarray, rows: TokenRows, max_length: Optional[int] = None) -> None:
        """Rows of these source-row indices (ascending, after every index appended before); their trained
        counts within `max_length` are kept (what truncation needs, without reading the labels again)."""
        self._write("ids", rows.ids, np.int32)
        self._write("index", index, np.int64)
        self._write("lengths", rows.lengths(), np.int32)
        if self.keep_labels:
            self._write("labels", rows.labels, np.int32)
            self._write("trained", rows.trained_counts(max_length), np.int32)

    def _write(self, kind: str, values: Any, dtype: Any) -> None:
        self.files[kind].write(np.ascontiguousarray(values, dtype=dtype).tobytes())

    def commit(self, rows: int, note: Any = None) -> None:
        """The chunk appended since the last commit is durable: `rows` is how many source rows have now been
        read, `note` (JSON) is kept for `notes()`."""
        self.files["notes"].write((json.dumps(note) + "\n").encode())
        for handle in self.files.values():
            handle.flush()
            os.fsync(handle.fileno())
        self.chunks, self.rows = self.chunks + 1, rows
        state = {"tag": self.tag, "chunks": self.chunks, "rows": rows,
                 "sizes": {kind: handle.tell() for kind, handle in self.files.items()}}
        write_json(self.state_path, state, indent=None)

    def close(self) -> "SpilledRows":
        for handle in self.files.values():
            handle.close()
        numbers = {kind: np.fromfile(self.paths[kind], dtype=np.int64 if kind == "index" else np.int32)
                   for kind in ("index", "lengths", "trained") if kind in self.paths}
        return SpilledRows(self.paths["ids"], self.paths.get("labels"), row_bounds(numbers["lengths"]),
                           numbers["index"], numbers.get("trained"))


class SpilledRows:
    """A spill read back: row r (source row `index[r]`, ascending) is positions [bounds[r], bounds[r+1]) of the
    files. The files are mapped for each `take` and unmapped after it, so the pages read do not stay in this
    process's resident memory (a long-lived map of a corpus's tokens would count them all)."""

    def __init__(self, ids: Path, labels: Optional[Path], bounds: np.ndarray, index: np.ndarray,
                 trained: Optional[np.ndarray]):
        self.files, self.bounds, self.index, self.trained = (ids, labels), bounds, index, trained
        self.distinct = bool(np.all(np.diff(index) > 0))  # one spilled row per source row

    def lengths(self) -> np.ndarray:
        return np.diff(self.bounds)

    def take(self, positions: np.ndarray, max_length: Optional[int] = None) -> TokenRows:
        """TokenRows.take of these spilled rows, read into memory."""
        count = int(self.bounds[-1])
        ids = _mapped(self.files[0], count)
        labels = _mapped(self.files[1], count) if self.files[1] is not None else ids
        taken = TokenRows(ids, labels, self.bounds).take(positions, max_length)
        return TokenRows(np.array(taken.ids), np.array(taken.labels), taken.bounds)  # copies: the maps go

    def group_sizes(self) -> Optional[np.ndarray]:
        """Where a source row made several examples (spilled one after another under its index): at each row's
        first spilled row, how many; 0 at the others. None when every row made one."""
        if self.distinct:
            return None
        firsts = np.flatnonzero(np.diff(self.index, prepend=-1) != 0)
        sizes = np.zeros(len(self.index), dtype=np.int64)
        sizes[firsts] = np.diff(np.append(firsts, len(self.index)))
        return sizes

    def positions(self, source_rows: np.ndarray) -> np.ndarray:
        """The (first) spilled row of each source row, -1 where it was not spilled (dropped, failed)."""
        source_rows = np.asarray(source_rows, dtype=np.int64)
        if len(self.index) and self.distinct and self.index[-1] == len(self.index) - 1 \
                and source_rows.max(initial=-1) < len(self.index):
            return source_rows  # rows 0..k all spilled (ascending, distinct): each row is its own position
        at = np.searchsorted(self.index, source_rows)
        found = at < len(self.index)
        found[found] = self.index[at[found]] == source_rows[found]
        return np.where(found, at, -1)


def _mapped(path: Path, count: int) -> np.ndarray:
    if count == 0:
        return np.zeros(0, dtype=np.int32)
    return np.memmap(path, dtype=np.int32, mode="r", shape=(count,))


SHARD_BYTES = 500 << 20  # as datasets' save_to_disk shards (config.MAX_SHARD_SIZE)
# Tokens per Arrow record batch. Loading an entry reads every batch's header from its memory map (a page and the
# kernel's read-around each, scattered over the files): datasets' default of 1,000 rows a batch made 10,000
# batches of a 15 GB entry and a 10.7 s cold load. Batches of 4 M tokens (32 MB) make ~500.
BATCH_TOKENS = 1 << 22


class ExampleWriter:
    """Training examples appended, a piece at a time, to `directory` in the layout `datasets`' save_to_disk
    writes (Arrow shards of up to SHARD_BYTES, state.json, dataset_info.json) with the columns and features
    TokenRows.to_dataset has (input_ids, labels: list<int32>; length: int64), so `datasets.load_from_disk` loads
    it memory-mapped. Written in place: saving a memory-mapped Dataset would read every example back through a
    map of the whole file (its pages resident in the builder's memory)."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.features = TokenRows.empty().to_dataset(fingerprint="").features
        self.shards: list[Path] = []
        self.writer: Any = None
        self.shard_bytes = 0
        self.lengths: list[np.ndarray] = []
        self.pending: list[TokenRows] = []  # rows not yet written: less than BATCH_TOKENS tokens
        self.pending_tokens = 0

    def write(self, rows: TokenRows) -> tuple[int, int, int]:
        """Appends the rows (written a record batch of BATCH_TOKENS at a time); returns their (tokens, trained
        tokens, examples) for the report."""
        self.pending.append(rows.take(np.arange(len(rows))))  # its own tokens only (a copy only where it has more)
        self.pending_tokens += int(rows.bounds[-1] - rows.bounds[0])
        if self.pending_tokens >= BATCH_TOKENS:
            self._flush()
        self.lengths.append(rows.lengths().astype(np.int32))  # the report's percentiles: 4 bytes an example
        return int(rows.bounds[-1] - rows.bounds[0]), int(rows.trained_counts().sum()), len(rows)

    def _flush(self, last: bool = False) -> None:
        """Writes the pending rows in record batches of up to BATCH_TOKENS tokens; a short remainder stays
        pending until more rows come (unless this is the `last` flush)."""
        rows = TokenRows.concat(self.pending)
        self.pending, self.pending_tokens = [], 0
        runs = list(pieces(rows.lengths(), BATCH_TOKENS))
        if not last and len(runs) > 1:
            start, stop = runs.pop()
            self.pending = [rows.take(np.arange(start, stop))]
            self.pending_tokens = int(rows.bounds[stop] - rows.bounds[start])
        for start, stop in runs:
            piece = rows if stop - start == len(rows) else rows.take(np.arange(start, stop))
            if self.writer is None or self.shard_bytes >= SHARD_BYTES:
                self._open_shard()
            table = piece.to_table()
            self.writer.write_table(table, writer_batch_size=len(piece))  # one record batch
            self.shard_bytes += table.nbytes

    def _open_shard(self) -> None:
        from datasets.arrow_writer import ArrowWriter

        self._close_shard()
        self.shards.append(self.directory / f"shard{len(self.shards)}.arrow")
        self.writer = ArrowWriter(features=self.features, path=str(self.shards[-1]))

    def _close_shard(self) -> None:
        if self.writer is not None:
            self.writer.finalize()
            self.writer.close()
        self.writer, self.shard_bytes = None, 0

    def all_lengths(self) -> np.ndarray:
        return np.concatenate(self.lengths) if self.lengths else np.zeros(0, dtype=np.int32)

    def finish(self, fingerprint: str) -> None:
        """Names the shards as save_to_disk does and writes its state.json and dataset_info.json."""
        import dataclasses
        import json

        import datasets

        if self.pending:
            self._flush(last=True)
        if not self.shards:  # no example: one empty shard, as save_to_disk writes
            self._open_shard()
            self.writer.write_table(TokenRows.empty().to_table())
        self._close_shard()
        names = [f"data-{i:05d}-of-{len(self.shards):05d}.arrow" for i in range(len(self.shards))]
        for shard, name in zip(self.shards, names):
            shard.rename(self.directory / name)
        state = {"_data_files": [{"filename": name} for name in names], "_fingerprint": fingerprint,
                 "_format_columns": None, "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False,
                 "_split": None}
        (self.directory / datasets.config.DATASET_STATE_JSON_FILENAME).write_text(
            json.dumps(state, indent=2, sort_keys=True))
        info = dataclasses.asdict(datasets.DatasetInfo(features=self.features))
        (self.directory / datasets.config.DATASET_INFO_FILENAME).write_text(
            json.dumps({key: info[key] for key in sorted(info)}, indent=2))
