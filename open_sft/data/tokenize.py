"""Rendered conversations → tokens and exact assistant-only labels, each row's labels checked.

render.py finds the [start, end) character spans that carry a loss; here the rendered texts are
tokenized once with offsets and a token is trained when its characters overlap a trained span.
Then the trained tokens are checked against the spans by decoding them run by run.

A batch is encoded in one call of the Rust tokenizer (its threads do the work) and labelled with
array operations over all rows at once: a Python loop over tokens costs more than the encoding.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Optional

import numpy as np
from transformers import PreTrainedTokenizerBase

from open_sft.data.render import render, special_markers, trained_spans  # noqa: F401 (the data step's API)

IGNORE_INDEX = -100

Spans = list[tuple[int, int]]


@dataclass(frozen=True)
class Example:
    """One tokenized training example; labels are IGNORE_INDEX where no loss is taken."""

    input_ids: list[int]
    labels: list[int]


def label_tokens(input_ids: list[int], offsets: list[tuple[int, int]], spans: Spans) -> list[int]:
    """Copy each token id whose characters overlap a trained span; IGNORE_INDEX elsewhere. One row at a
    time: the definition that `_batch_labels` computes for a whole batch with arrays."""
    labels = [IGNORE_INDEX] * len(input_ids)
    span_index = 0
    for t, (start, end) in enumerate(offsets):
        while span_index < len(spans) and spans[span_index][1] <= start:
            span_index += 1
        if span_index == len(spans):
            break
        span_start, span_end = spans[span_index]
        if end > span_start and start < span_end:
            labels[t] = input_ids[t]
    return labels


def _encode(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> tuple[list[list[int]], list[list[tuple[int, int]]]]:
    """Token ids and character offsets of each text, no special tokens added.

    Calls the Rust backend directly when that is exactly what `tokenizer(texts, ...)` would do (a fast
    tokenizer without truncation or padding configured): transformers' conversion of the result into
    dicts of lists takes as long as the encoding itself."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if (getattr(tokenizer, "is_fast", False) and backend.truncation is None and backend.padding is None
            and backend.encode_special_tokens == bool(tokenizer.split_special_tokens)):
        encodings = backend.encode_batch(texts, add_special_tokens=False)
        return [e.ids for e in encodings], [e.offsets for e in encodings]
    encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    return encoded["input_ids"], encoded["offset_mapping"]


def _ints(rows: list[list[int]], count: int) -> np.ndarray:
    """Concatenate per-row lists of ints into one array."""
    return np.fromiter(chain.from_iterable(rows), dtype=np.int64, count=count)


def _pairs(rows: list[list[tuple[int, int]]], count: int) -> np.ndarray:
    """Concatenate per-row lists of (start, end) pairs into one array of shape (count, 2)."""
    return np.fromiter(chain.from_iterable(chain.from_iterable(rows)), dtype=np.int64, count=2 * count).reshape(-1, 2)


def _batch_labels(ids: np.ndarray, offsets: np.ndarray, token_row_base: np.ndarray, spans: np.ndarray) -> np.ndarray:
    """`label_tokens` for every row of a batch at once.

    Rows are laid end to end in one character axis (row r starts at its base, one past the end of
    row r-1), so each row's spans and tokens keep their order and no token of one row can overlap a
    span of another. `label_tokens` walks the spans with an index that only moves forward; here that
    index is the running maximum of "spans that end at or before the token's start"."""
    labels = np.full(len(ids), IGNORE_INDEX, dtype=np.int64)
    if len(spans) == 0 or len(ids) == 0:
        return labels
    starts, ends = offsets[:, 0] + token_row_base, offsets[:, 1] + token_row_base
    index = np.maximum.accumulate(np.searchsorted(spans[:, 1], starts, side="right"))
    inside = index < len(spans)
    span = spans[np.minimum(index, len(spans) - 1)]
    trained = inside & (ends > span[:, 0]) & (starts < span[:, 1])
    labels[trained] = ids[trained]
    return labels


def _run_bounds(trained: np.ndarray, row_starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[start, end) token positions of the maximal runs of trained tokens; no run crosses a row."""
    before = np.zeros_like(trained)
    before[1:] = trained[:-1]
    before[row_starts] = False
    after = np.zeros_like(trained)
    after[:-1] = trained[1:]
    after[row_starts[row_starts > 0] - 1] = False
    return np.flatnonzero(trained & ~before), np.flatnonzero(trained & ~after) + 1


def _decode_runs(tokenizer: PreTrainedTokenizerBase, runs: list[list[int]]) -> list[str]:
    """`tokenizer.decode` of each run; in one Rust call when decode adds nothing to the backend's."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if getattr(tokenizer, "is_fast", False) and not tokenizer.clean_up_tokenization_spaces:
        return backend.decode_batch(runs, skip_special_tokens=False)
    return [tokenizer.decode(run) for run in runs]


@dataclass(frozen=True)
class LabelledBatch:
    """Tokens and labels of a batch of rows laid end to end: row r is [bounds[r], bounds[r+1]). Arrays,
    so a worker process sends it back in a few buffers instead of millions of pickled ints."""

    ids: np.ndarray
    labels: np.ndarray
    bounds: np.ndarray
    right: np.ndarray  # per row: its labels passed the check

    def examples(self) -> list[Example]:
        ids, labels, bounds = self.ids.tolist(), self.labels.tolist(), self.bounds.tolist()
        return [Example(ids[a:b], labels[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def label_batch(tokenizer: PreTrainedTokenizerBase, texts_and_spans: list[tuple[str, Spans]],
                check: bool = True) -> LabelledBatch:
    """Tokenize and label rendered conversations, and say for each whether its labels are right: the
    decoded runs of trained tokens equal the trained character spans, run for span (modulo the
    whitespace a boundary token may carry). A tokenizer that merges across a turn boundary fails it.
    With check=False every row counts as right (train_on all: nothing to check)."""
    if not texts_and_spans:
        empty = np.zeros(0, dtype=np.int64)
        return LabelledBatch(empty, empty, np.zeros(1, dtype=np.int64), np.zeros(0, dtype=bool))
    texts = [text for text, _ in texts_and_spans]
    id_rows, offset_rows = _encode(tokenizer, texts)
    lengths = np.fromiter(map(len, id_rows), dtype=np.int64, count=len(id_rows))
    total = int(lengths.sum())
    row_bounds = np.zeros(len(id_rows) + 1, dtype=np.int64)
    np.cumsum(lengths, out=row_bounds[1:])
    text_base = np.zeros(len(texts), dtype=np.int64)
    np.cumsum([len(text) + 1 for text in texts[:-1]], out=text_base[1:])
    span_rows = [spans for _, spans in texts_and_spans]
    span_counts = [len(spans) for spans in span_rows]
    spans = _pairs(span_rows, sum(span_counts)) + np.repeat(text_base, span_counts)[:, None]
    ids = _ints(id_rows, total)
    if np.all(spans[1:, 1] >= spans[:-1, 1]):
        labels = _batch_labels(ids, _pairs(offset_rows, total), np.repeat(text_base, lengths), spans)
    else:  # spans out of order (no built-in template makes them): the row-by-row definition
        labels = np.fromiter(chain.from_iterable(map(label_tokens, id_rows, offset_rows, span_rows)),
                             dtype=np.int64, count=total)
    right = _check_runs(tokenizer, ids, labels, row_bounds, texts_and_spans) if check else [True] * len(texts)
    return LabelledBatch(ids, labels, row_bounds, np.asarray(right, dtype=bool))


def label_and_check(
    tokenizer: PreTrainedTokenizerBase, texts_and_spans: list[tuple[str, Spans]], check: bool = True
) -> tuple[list[Example], list[bool]]:
    """`label_batch` as one Example per row, and whether each row's labels are right."""
    batch = label_batch(tokenizer, texts_and_spans, check)
    return batch.examples(), batch.right.tolist()


def _check_runs(tokenizer: PreTrainedTokenizerBase, ids: np.ndarray, labels: np.ndarray, row_bounds: np.ndarray,
                texts_and_spans: list[tuple[str, Spans]]) -> list[bool]:
    run_starts, run_ends = _run_bounds(labels != IGNORE_INDEX, row_bounds[:-1][row_bounds[:-1] < row_bounds[-1]])
    id_list = ids.tolist()
    decoded = _decode_runs(tokenizer, [id_list[a:b] for a, b in zip(run_starts.tolist(), run_ends.tolist())])
    run_rows = (np.searchsorted(row_bounds, run_starts, side="right") - 1).tolist()
    by_row: list[list[str]] = [[] for _ in texts_and_spans]
    for row, text in zip(run_rows, decoded):
        by_row[row].append(text.strip())
    expected = ([text[a:b].strip() for a, b in spans if text[a:b].strip()] for text, spans in texts_and_spans)
    return [runs == wanted for runs, wanted in zip(by_row, expected)]


def tokenize_conversations(tokenizer: PreTrainedTokenizerBase, texts_and_spans: list[tuple[str, Spans]]) -> list[Example]:
    """Tokenize and label rendered conversations (without the label check)."""
    return label_and_check(tokenizer, texts_and_spans, check=False)[0]


def trained_token_runs(input_ids: list[int], labels: list[int]) -> list[list[int]]:
    """The maximal runs of consecutive trained tokens (label != IGNORE_INDEX), in order."""
    runs: list[list[int]] = []
    previous_trained = False
    for token, label in zip(input_ids, labels):
        trained = label != IGNORE_INDEX
        if trained:
            if not previous_trained:
                runs.append([])
            runs[-1].append(token)
        previous_trained = trained
    return runs


def truncate_example(example: Example, max_seq_length: int, truncation: str) -> tuple[Optional[Example], str]:
    """Apply --max_seq_length; returns (example or None, drop/keep reason)."""
    if len(example.input_ids) <= max_seq_length:
        return example, "kept"
    if truncation == "drop":
        return None, "too_long"
    cut = Example(example.input_ids[:max_seq_length], example.labels[:max_seq_length])
    if all(label == IGNORE_INDEX for label in cut.labels[1:]):
        return None, "no_trained_tokens_after_truncation"
    return cut, "truncated"
