"""Token rows on disk while a build streams: a source's tokenized rows, and the training examples written.

A streaming build (open_sft.data.stream) never holds a corpus's tokens in memory. Each chunk's rows are
appended to a Spill (two flat int32 files and, in memory, a few numbers per row: its source row index,
length and trained count); the selection, truncation and block cutting then read them back a piece at a time
(mapped for that piece only), and an ExampleWriter writes the training examples straight into the cache
entry's Arrow shards. The corpus's tokens are never in memory together; what grows with it is a few numbers
per row.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np

from open_sft.data.token_rows import TokenRows, row_bounds

PIECE_TOKENS = 1 << 18  # tokens gathered from a spill (and written) at a time, in whole rows


def pieces(lengths: np.ndarray) -> Iterator[tuple[int, int]]:
    """[start, stop) of consecutive runs of rows of about PIECE_TOKENS tokens (at least one row each)."""
    ends = np.cumsum(lengths, dtype=np.int64)
    start = 0
    while start < len(lengths):
        before = int(ends[start - 1]) if start else 0
        stop = max(start + 1, int(np.searchsorted(ends, before + PIECE_TOKENS, side="right")))
        yield start, stop
        start = stop


class Spill:
    """Token rows appended in ascending source-row order; `close()` reads them back."""

    def __init__(self, directory: Path, name: str, keep_labels: bool = True):
        self.paths = (directory / f"{name}.ids", directory / f"{name}.labels")
        self.files = [open(self.paths[0], "wb"), open(self.paths[1], "wb") if keep_labels else None]
        self.index: list[np.ndarray] = []
        self.lengths: list[np.ndarray] = []
        self.trained: list[np.ndarray] = []

    def append(self, index: np.ndarray, rows: TokenRows, max_length: Optional[int] = None) -> None:
        """Rows of these source-row indices (ascending, after every index appended before); their trained
        counts within `max_length` are kept (what truncation needs, without reading the labels again)."""
        self.files[0].write(np.ascontiguousarray(rows.ids, dtype=np.int32).tobytes())
        if self.files[1] is not None:
            self.files[1].write(np.ascontiguousarray(rows.labels, dtype=np.int32).tobytes())
            self.trained.append(rows.trained_counts(max_length))
        self.index.append(np.asarray(index, dtype=np.int64))
        self.lengths.append(rows.lengths())

    def close(self) -> "SpilledRows":
        for handle in self.files:
            if handle is not None:
                handle.close()
        lengths = np.concatenate(self.lengths) if self.lengths else np.zeros(0, dtype=np.int64)
        index = np.concatenate(self.index) if self.index else np.zeros(0, dtype=np.int64)
        trained = np.concatenate(self.trained) if self.trained else None
        return SpilledRows(self.paths[0], self.paths[1] if self.files[1] is not None else None, row_bounds(lengths),
                           index, trained)


class SpilledRows:
    """A spill read back: row r (source row `index[r]`, ascending) is positions [bounds[r], bounds[r+1]) of the
    files. The files are mapped for each `take` and unmapped after it, so the pages read do not stay in this
    process's resident memory (a long-lived map of a corpus's tokens would count them all)."""

    def __init__(self, ids: Path, labels: Optional[Path], bounds: np.ndarray, index: np.ndarray,
                 trained: Optional[np.ndarray]):
        self.files, self.bounds, self.index, self.trained = (ids, labels), bounds, index, trained

    def lengths(self) -> np.ndarray:
        return np.diff(self.bounds)

    def take(self, positions: np.ndarray, max_length: Optional[int] = None) -> TokenRows:
        """TokenRows.take of these spilled rows, read into memory."""
        count = int(self.bounds[-1])
        ids = _mapped(self.files[0], count)
        labels = _mapped(self.files[1], count) if self.files[1] is not None else ids
        taken = TokenRows(ids, labels, self.bounds).take(positions, max_length)
        return TokenRows(np.array(taken.ids), np.array(taken.labels), taken.bounds)  # copies: the maps go

    def positions(self, source_rows: np.ndarray) -> np.ndarray:
        """The spilled row of each source row, -1 where it was not spilled (dropped, failed)."""
        source_rows = np.asarray(source_rows, dtype=np.int64)
        at = np.searchsorted(self.index, source_rows)
        found = at < len(self.index)
        found[found] = self.index[at[found]] == source_rows[found]
        return np.where(found, at, -1)


def _mapped(path: Path, count: int) -> np.ndarray:
    if count == 0:
        return np.zeros(0, dtype=np.int32)
    return np.memmap(path, dtype=np.int32, mode="r", shape=(count,))


SHARD_BYTES = 500 << 20  # as datasets' save_to_disk shards (config.MAX_SHARD_SIZE)


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

    def write(self, rows: TokenRows) -> tuple[int, int, int]:
        """Appends the rows; returns their (tokens, trained tokens, examples) for the report."""
        for start, stop in pieces(rows.lengths()):
            piece = rows if stop - start == len(rows) else rows.take(np.arange(start, stop))
            if self.writer is None or self.shard_bytes >= SHARD_BYTES:
                self._open_shard()
            table = piece.to_table()
            self.writer.write_table(table)
            self.shard_bytes += table.nbytes
        self.lengths.append(rows.lengths())
        return int(rows.bounds[-1] - rows.bounds[0]), int(rows.trained_counts().sum()), len(rows)

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
        return np.concatenate(self.lengths) if self.lengths else np.zeros(0, dtype=np.int64)

    def finish(self, fingerprint: str) -> None:
        """Names the shards as save_to_disk does and writes its state.json and dataset_info.json."""
        import dataclasses
        import json

        import datasets

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
