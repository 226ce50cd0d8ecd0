"""Tokenized rows as flat arrays: row r is positions [bounds[r], bounds[r+1]) of `ids` and `labels`.

A build holds millions of tokens. As Python lists every token is an object to allocate, to pickle
back from a worker process and to convert again for Arrow; as arrays the rows move between
processes in a few buffers, are selected, cut to --max_seq_length and counted with array
operations, and become Arrow list columns without a per-token step.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

IGNORE_INDEX = -100
_MAX_LIST_VALUES = 1 << 30  # values per Arrow list chunk: its offsets are int32


@dataclass(frozen=True)
class Example:
    """One tokenized training example; labels are IGNORE_INDEX where no loss is taken."""

    input_ids: list[int]
    labels: list[int]


def row_bounds(lengths: np.ndarray) -> np.ndarray:
    """Where each row of these lengths starts when laid end to end, and where the last one ends."""
    bounds = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=bounds[1:])
    return bounds


def run_bounds(rows: "TokenRows") -> tuple[np.ndarray, np.ndarray]:
    """[start, end) positions of the maximal runs of trained tokens; no run crosses a row."""
    trained = rows.labels != IGNORE_INDEX
    row_starts = rows.bounds[:-1][rows.bounds[:-1] < rows.bounds[-1]]
    before = np.zeros_like(trained)
    before[1:] = trained[:-1]
    before[row_starts] = False
    after = np.zeros_like(trained)
    after[:-1] = trained[1:]
    after[row_starts[row_starts > 0] - 1] = False
    return np.flatnonzero(trained & ~before), np.flatnonzero(trained & ~after) + 1


@dataclass(frozen=True)
class TokenRows:
    ids: np.ndarray  # int32 (half the memory of int64: fresh pages are a real cost at millions of tokens)
    labels: np.ndarray  # int32, IGNORE_INDEX where no loss is taken
    bounds: np.ndarray  # int64, one more than there are rows

    @staticmethod
    def empty() -> "TokenRows":
        nothing = np.zeros(0, dtype=np.int32)
        return TokenRows(nothing, nothing, np.zeros(1, dtype=np.int64))

    @staticmethod
    def from_lengths(ids: np.ndarray, labels: np.ndarray, lengths: np.ndarray) -> "TokenRows":
        return TokenRows(ids, labels, row_bounds(lengths))

    @staticmethod
    def concat(parts: list["TokenRows"]) -> "TokenRows":
        if len(parts) < 2:
            return parts[0] if parts else TokenRows.empty()
        return TokenRows.from_lengths(np.concatenate([p.ids for p in parts]),
                                      np.concatenate([p.labels for p in parts]),
                                      np.concatenate([p.lengths() for p in parts]))

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def lengths(self) -> np.ndarray:
        return np.diff(self.bounds)

    def take(self, rows: np.ndarray, max_length: int | None = None) -> "TokenRows":
        """These rows, in this order (repeats allowed), each cut to its first `max_length` tokens."""
        rows = np.asarray(rows, dtype=np.int64)
        lengths = self.lengths()[rows]
        if max_length is not None:
            lengths = np.minimum(lengths, max_length)
        if len(rows) == len(self) and np.array_equal(rows, np.arange(len(self))) and lengths.sum() == len(self.ids):
            return self  # all rows, in order, uncut: nothing to copy
        bounds = row_bounds(lengths)
        # Position k of the output comes from position k + (start of its row here - start of its row there).
        source = np.repeat(self.bounds[rows] - bounds[:-1], lengths) + np.arange(bounds[-1])
        return TokenRows(self.ids[source], self.labels[source], bounds)

    def opened(self, rows: np.ndarray, token: int, trained: bool) -> "TokenRows":
        """These rows with `token` put before each of `rows` (its label the token where `trained`, else
        IGNORE_INDEX): the bos a raw prompt + completion opens with as the tokenizer's encoding adds it."""
        rows = np.asarray(rows, dtype=np.int64)
        if not len(rows):
            return self
        added = np.zeros(len(self), dtype=np.int64)
        added[rows] = 1
        lengths = self.lengths()
        bounds = row_bounds(lengths + added)
        kept = np.arange(len(self.ids)) + np.repeat(np.cumsum(added), lengths)
        ids, labels = (np.empty(bounds[-1], dtype=np.int32) for _ in range(2))
        ids[kept], labels[kept] = self.ids, self.labels
        ids[bounds[rows]], labels[bounds[rows]] = token, token if trained else IGNORE_INDEX
        return TokenRows(ids, labels, bounds)

    def trained_counts(self, max_length: int | None = None) -> np.ndarray:
        """Per row, the tokens that get a loss among its first `max_length`. Labels are shifted by one
        inside the model, so a row's first position never does (labels.count_trained, per row)."""
        starts, ends = self.bounds[:-1] + 1, self.bounds[1:]
        if max_length is not None:
            ends = np.minimum(ends, self.bounds[:-1] + max_length)
        counts = np.zeros(len(self), dtype=np.int64)
        some = starts < ends
        if some.any():  # sums over [start, end) of each row: reduceat over the (start, end) pairs, every other sum
            trained = np.append(self.labels != IGNORE_INDEX, False)  # `end` may be one past the last token
            pairs = np.stack([starts[some], ends[some]], axis=1).ravel()
            counts[some] = np.add.reduceat(trained, pairs, dtype=np.int64)[::2]
        return counts

    def row(self, r: int) -> tuple[list[int], list[int]]:
        a, b = int(self.bounds[r]), int(self.bounds[r + 1])
        return self.ids[a:b].tolist(), self.labels[a:b].tolist()

    def examples(self) -> list[Example]:
        return [Example(*self.row(r)) for r in range(len(self))]

    def to_dataset(self, fingerprint: str) -> Any:
        """A `datasets.Dataset` with columns input_ids and labels (lists of int32) and length (int64).
        The fingerprint is given (the cache key): `datasets` would otherwise hash the whole table."""
        import datasets

        return datasets.Dataset(datasets.table.InMemoryTable(self.to_table()), fingerprint=fingerprint)

    def to_table(self) -> Any:
        """The rows as an Arrow table: input_ids and labels (lists of int32), length (int64)."""
        import pyarrow as pa

        return pa.table({"input_ids": self._list_column(self.ids, pa.int32()),
                         "labels": self._list_column(self.labels, pa.int32()),
                         "length": pa.array(self.lengths(), pa.int64())})

    def _list_column(self, values: np.ndarray, value_type: Any) -> Any:
        """Rows as an Arrow list column, in chunks of at most 2^30 values (list offsets are int32)."""
        import pyarrow as pa

        cuts = [0]
        while cuts[-1] < len(self):  # each chunk: as many rows as fit, at least one
            limit = self.bounds[cuts[-1]] + _MAX_LIST_VALUES
            cuts.append(max(cuts[-1] + 1, int(np.searchsorted(self.bounds, limit, side="right")) - 1))
        chunks = [pa.ListArray.from_arrays(pa.array((self.bounds[a : b + 1] - self.bounds[a]).astype(np.int32)),
                                           pa.array(values[self.bounds[a] : self.bounds[b]], value_type))
                  for a, b in zip(cuts, cuts[1:])]
        return pa.chunked_array(chunks, pa.list_(value_type))


def expand_groups(firsts: np.ndarray, sizes: Optional[np.ndarray]) -> np.ndarray:
    """Each position of `firsts` followed by the rest of its group: p, p + 1, ..., p + sizes[p] - 1, in order
    (a conversation that made several examples: data/chat/turn_render.py). `sizes` None: groups of one."""
    firsts = np.asarray(firsts, dtype=np.int64)
    if sizes is None:
        return firsts
    counts = sizes[firsts]
    return np.repeat(firsts - (np.cumsum(counts) - counts), counts) + np.arange(int(counts.sum()), dtype=np.int64)


def group_totals(values: np.ndarray, firsts: np.ndarray, sizes: Optional[np.ndarray]) -> np.ndarray:
    """Per position of `firsts`, the sum of `values` over its group (the value itself for groups of one)."""
    firsts = np.asarray(firsts, dtype=np.int64)
    if sizes is None or not len(firsts):
        return np.asarray(values)[firsts]
    expanded = expand_groups(firsts, sizes)
    counts = sizes[firsts]
    return np.add.reduceat(np.asarray(values, dtype=np.int64)[expanded], np.cumsum(counts) - counts)


def split_costs(lengths: np.ndarray, firsts: np.ndarray, sizes: Optional[np.ndarray]) -> tuple[int, int]:
    """Of the rows whose first examples are at `firsts`: how many made more than one example, and the tokens
    their earlier examples add to one rendering of the conversation (its last example holds it all: the
    examples before it repeat its context)."""
    firsts = np.asarray(firsts, dtype=np.int64)
    if sizes is None or not len(firsts):
        return 0, 0
    counts = sizes[firsts]
    split = firsts[counts > 1]
    if not len(split):
        return 0, 0
    totals = group_totals(lengths, split, sizes)
    return len(split), int((totals - np.asarray(lengths)[split + sizes[split] - 1]).sum())


def rows_keeping_an_example(lengths: np.ndarray, trained: np.ndarray, firsts: np.ndarray, sizes: np.ndarray,
                            max_length: int, truncation: str) -> int:
    """How many of the rows whose first examples are at `firsts` keep at least one example after the fit."""
    kept = fitted_lengths(lengths, trained, max_length, truncation) > 0
    return int((group_totals(kept.astype(np.int64), firsts, sizes) > 0).sum())


def fit_rows(rows: TokenRows, order: np.ndarray, max_length: int, truncation: str) -> tuple[TokenRows, Counter, int]:
    """The rows in `order` that fit --max_seq_length (cut to it with truncation=truncate), without those
    left with no trained token; why the others were dropped; how many kept rows were cut. Row for row:
    labels.truncate_example followed by the build's no-trained-tokens rule."""
    kept, dropped, truncated = fit_order(rows.lengths(), rows.trained_counts(max_length), order, max_length,
                                         truncation)
    return rows.take(kept, max_length), dropped, truncated


def fitted_lengths(lengths: np.ndarray, trained: np.ndarray, max_length: int, truncation: str) -> np.ndarray:
    """Each row's tokens as fit_order will keep it: cut to max_length, 0 where it is dropped (too long under
    truncation=drop, or no trained token within max_length). What --dataset_mixer_unit tokens counts: counted
    before the fit, a source of long rows delivered 21-57 % of the tokens asked for."""
    fitted = np.minimum(np.asarray(lengths, dtype=np.int64), max_length)
    fitted[np.asarray(trained) == 0] = 0
    if truncation == "drop":
        fitted[np.asarray(lengths) > max_length] = 0
    return fitted


def fit_order(lengths: np.ndarray, trained: np.ndarray, order: np.ndarray, max_length: int,
              truncation: str) -> tuple[np.ndarray, Counter, int]:
    """`fit_rows` on the rows' lengths and trained counts (within max_length) alone: the kept rows of `order`,
    to take from the rows (a build that streams them takes them a piece at a time)."""
    order = np.asarray(order, dtype=np.int64)
    too_long = lengths[order] > max_length
    dropped: Counter = Counter()
    if truncation == "drop":
        dropped["too_long"] = int(too_long.sum())
        order, too_long = order[~too_long], too_long[~too_long]
    untrained = trained[order] == 0
    dropped["no_trained_tokens_after_truncation"] = int((untrained & too_long).sum())
    dropped["no_trained_tokens"] = int((untrained & ~too_long).sum())
    return order[~untrained], +dropped, int((too_long & ~untrained).sum())
