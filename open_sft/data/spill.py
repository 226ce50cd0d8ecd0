"""Token rows on disk while a build streams: a source's tokenized rows, and the training examples written.

A streaming build (open_sft.data.stream) never holds a corpus's tokens in memory. Each chunk's rows are
appended to a Spill (two flat int32 files and, in memory, a few numbers per row: its source row index,
length and trained count); the selection, truncation and block cutting then read them back memory-mapped,
a piece at a time, and an ExampleWriter appends the training examples to one Arrow file, which becomes the
`datasets.Dataset` (memory-mapped) that the cache saves. Peak memory is a chunk's, whatever the corpus's size.
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
        bounds = row_bounds(lengths)
        ids = _mapped(self.paths[0], int(bounds[-1]))
        labels = _mapped(self.paths[1], int(bounds[-1])) if self.files[1] is not None else ids
        index = np.concatenate(self.index) if self.index else np.zeros(0, dtype=np.int64)
        trained = np.concatenate(self.trained) if self.trained else None
        return SpilledRows(TokenRows(ids, labels, bounds), index, trained)


def _mapped(path: Path, count: int) -> np.ndarray:
    if count == 0:
        return np.zeros(0, dtype=np.int32)
    return np.memmap(path, dtype=np.int32, mode="r", shape=(count,))


class SpilledRows:
    """A spill read back: `rows` memory-mapped, `index[r]` the source row of row r (ascending)."""

    def __init__(self, rows: TokenRows, index: np.ndarray, trained: Optional[np.ndarray]):
        self.rows, self.index, self.trained = rows, index, trained

    def positions(self, source_rows: np.ndarray) -> np.ndarray:
        """The spilled row of each source row, -1 where it was not spilled (dropped, failed)."""
        source_rows = np.asarray(source_rows, dtype=np.int64)
        at = np.searchsorted(self.index, source_rows)
        found = at < len(self.index)
        found[found] = self.index[at[found]] == source_rows[found]
        return np.where(found, at, -1)


class ExampleWriter:
    """Training examples appended to one Arrow file (columns input_ids, labels: list<int32>; length: int64),
    the layout TokenRows.to_dataset gives in memory."""

    def __init__(self, path: Path):
        import pyarrow as pa

        self.path = path
        self.schema = pa.schema([("input_ids", pa.list_(pa.int32())), ("labels", pa.list_(pa.int32())),
                                 ("length", pa.int64())])
        self.writer = pa.ipc.new_stream(str(path), self.schema)
        self.lengths: list[np.ndarray] = []

    def write(self, rows: TokenRows) -> tuple[int, int, int]:
        """Appends the rows; returns their (tokens, trained tokens, examples) for the report."""
        for start, stop in pieces(rows.lengths()):
            piece = rows if stop - start == len(rows) else rows.take(np.arange(start, stop))
            self.writer.write_table(piece.to_table())
        self.lengths.append(rows.lengths())
        return int(rows.bounds[-1] - rows.bounds[0]), int(rows.trained_counts().sum()), len(rows)

    def all_lengths(self) -> np.ndarray:
        return np.concatenate(self.lengths) if self.lengths else np.zeros(0, dtype=np.int64)

    def finish(self, fingerprint: str) -> Any:
        """The examples as a memory-mapped `datasets.Dataset`."""
        import datasets

        self.writer.close()
        return datasets.Dataset(datasets.table.MemoryMappedTable.from_file(str(self.path)), fingerprint=fingerprint)
