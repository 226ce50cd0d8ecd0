"""Rendered conversations → tokens and exact assistant-only labels, each row's labels checked.

render.py finds the [start, end) character spans that carry a loss; here the rendered texts are
tokenized once (an example with cuts, a turn after a prompt that opens a think block: in pieces, cuts.py)
and a token is trained when its characters overlap a trained span (`label_tokens`, the definition).
Then the trained tokens are checked against the spans by decoding them run by run.

A batch is encoded in one call of the Rust tokenizer. The trained tokens of a span are found by
asking the encoding which tokens hold the span's first and last characters (`_span_tokens`): a few
calls per row instead of turning every token's offsets into Python objects, which costs as much as
a third of the encoding. Rows where that shortcut cannot answer take the definition.
"""

from __future__ import annotations

import unicodedata

from dataclasses import dataclass
from itertools import chain
from typing import Any, Optional

import numpy as np
from transformers import PreTrainedTokenizerBase

from open_sft.data.byte_level import byte_table, label_byte_level
from open_sft.data.chat.examples import trained_spans  # noqa: F401 (the data step's API)
from open_sft.data.chat.render import render, special_markers  # noqa: F401 (the data step's API)
from open_sft.data.cuts import Cuts, cutting, in_pieces, joined
from open_sft.data.token_rows import IGNORE_INDEX, Example, TokenRows, row_bounds, run_bounds

Spans = list[tuple[int, int]]
_LOOK_AHEAD = 16  # characters searched past a boundary no token holds (whitespace that trimmed offsets skip)


def label_tokens(input_ids: list[int], offsets: list[tuple[int, int]], spans: Spans) -> list[int]:
    """Copy each token id whose characters overlap a trained span; IGNORE_INDEX elsewhere."""
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


def _first_token(encoding: Any, position: int, stop: int) -> Optional[int]:
    """The first token holding a character of [position, stop), looked for from `position` on; -1 when
    no character there is held by a token; None when the look-ahead ran out first."""
    for char in range(position, min(stop, position + _LOOK_AHEAD)):
        token = encoding.char_to_token(char)
        if token is not None:
            return token
    return -1 if stop <= position + _LOOK_AHEAD else None


def _trains(encoding: Any, token: int, start: int, end: int) -> bool:
    """`label_tokens`' rule for one token and span."""
    token_start, token_end = encoding.token_to_chars(token)
    return token_end > start and token_start < end


def _span_tokens(encoding: Any, text_length: int, token_count: int, spans: Spans) -> Optional[list[tuple[int, int]]]:
    """[first, stop) token range of each span: what `label_tokens` trains, for an encoding whose token
    offsets only move forward (as every tokenizer's do), read off the tokens that hold the span's
    boundary characters. The tokens just outside that range are asked too: trimmed offsets (GPT-NeoX,
    OLMo) give whitespace tokens an empty range that holds no character. None when it cannot tell
    (empty or unordered spans, characters no token holds): the caller then applies the definition."""
    ranges, previous_end = [], 0
    for start, end in spans:
        if not previous_end <= start < end <= text_length:
            return None
        previous_end = end
        first = _first_token(encoding, start, end)
        if first is None or first < 0:  # out of look-ahead, or no token holds any of the span's characters
            return None
        stop = token_count
        if end < text_length:
            after = _first_token(encoding, end, text_length)
            if after is None:
                return None
            if after >= 0:  # the token that holds `end` is trained too when it began inside the span
                stop = after + 1 if encoding.token_to_chars(after)[0] < end else after
        while first > 0 and _trains(encoding, first - 1, start, end):
            first -= 1
        while stop > first and not _trains(encoding, stop - 1, start, end):
            stop -= 1
        while stop < token_count and _trains(encoding, stop, start, end):
            stop += 1
        if stop > first:
            ranges.append((first, stop))
    return ranges


def plain_backend(tokenizer: PreTrainedTokenizerBase) -> Any:
    """The Rust tokenizer when calling it is exactly what `tokenizer(texts, add_special_tokens=False)`
    does (a fast tokenizer without truncation or padding configured), else None."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if (getattr(tokenizer, "is_fast", False) and backend.truncation is None and backend.padding is None
            and backend.encode_special_tokens == bool(tokenizer.split_special_tokens)):
        return backend
    return None


def _encode(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[Any]:
    """The `tokenizers.Encoding` of each text, no special tokens added; from the Rust backend directly
    when possible: transformers' conversion of the result into dicts of lists takes as long as the
    encoding itself."""
    backend = plain_backend(tokenizer)
    if backend is not None:
        return backend.encode_batch(texts, add_special_tokens=False)
    return tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True).encodings


def _decode_runs(tokenizer: PreTrainedTokenizerBase, runs: list[list[int]]) -> list[str]:
    """`tokenizer.decode` of each run; in one Rust call when decode adds nothing to the backend's."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if getattr(tokenizer, "is_fast", False) and not tokenizer.clean_up_tokenization_spaces:
        return backend.decode_batch(runs, skip_special_tokens=False)
    return [tokenizer.decode(run) for run in runs]


@dataclass(frozen=True)
class Encoded:
    """A batch's tokens, the first half of `label_batch`: made apart from the labelling so that it can
    run on another thread while this one labels the batch before (the Rust tokenizer releases the GIL).
    Token ids only, for the byte-level path; the `tokenizers.Encoding`s (with offsets) for the other."""

    id_rows: Optional[list[list[int]]] = None
    encodings: Optional[list[Any]] = None


def encode_batch(tokenizer: PreTrainedTokenizerBase, texts: list[str], cuts: Optional[Cuts] = None) -> Encoded:
    """Encode the rendered texts as `label_batch` needs them (with the same `cuts`), no special tokens added."""
    if cutting(tokenizer, cuts):
        texts = [text for text, _ in in_pieces([(text, []) for text in texts], cuts)[0]]
    backend = plain_backend(tokenizer)
    if backend is not None and byte_table(tokenizer) is not None:
        encodings = backend.encode_batch_fast(texts, add_special_tokens=False)
        return Encoded(id_rows=[encoding.ids for encoding in encodings])
    return Encoded(encodings=_encode(tokenizer, texts))


@dataclass(frozen=True)
class LabelledBatch:
    """The tokenized rows of a batch and, per row, whether its labels passed the check."""

    rows: TokenRows
    right: np.ndarray


def label_batch(tokenizer: PreTrainedTokenizerBase, texts_and_spans: list[tuple[str, Spans]],
                check: bool = True, encoded: Optional[Encoded] = None, cuts: Optional[Cuts] = None) -> LabelledBatch:
    """Tokenize and label rendered conversations, and say for each whether its labels are right: the
    decoded runs of trained tokens equal the trained character spans, run for span (modulo the
    whitespace a boundary token may carry). A tokenizer that merges across a turn boundary fails it.
    With check=False every row counts as right (train_on all: nothing to check). `encoded`: the
    texts' `encode_batch`, when it was made beforehand. `cuts`: per text, where it is tokenized apart (cuts.py)."""
    if not texts_and_spans:
        return LabelledBatch(TokenRows.empty(), np.zeros(0, dtype=bool))
    if cutting(tokenizer, cuts):
        pieces, firsts = in_pieces(texts_and_spans, cuts)
        batch = label_batch(tokenizer, pieces, check, encoded)
        return LabelledBatch(*joined(batch.rows, batch.right, firsts))
    if encoded is None:
        encoded = encode_batch(tokenizer, [text for text, _ in texts_and_spans])
    if encoded.id_rows is None:
        return _label_by_offsets(tokenizer, texts_and_spans, check, encoded.encodings)
    fast = label_byte_level(byte_table(tokenizer), encoded.id_rows, texts_and_spans, check)
    if fast.taken.all():
        return LabelledBatch(fast.rows, fast.right)
    taken, left = np.flatnonzero(fast.taken), np.flatnonzero(~fast.taken)
    slow = _label_by_offsets(tokenizer, [texts_and_spans[i] for i in left.tolist()], check)
    position = np.empty(len(texts_and_spans), dtype=np.int64)
    position[taken], position[left] = np.arange(len(taken)), len(taken) + np.arange(len(left))
    return LabelledBatch(TokenRows.concat([fast.rows, slow.rows]).take(position),
                         np.concatenate([fast.right, slow.right])[position])


def _label_by_offsets(tokenizer: PreTrainedTokenizerBase, texts_and_spans: list[tuple[str, Spans]],
                      check: bool, encodings: Optional[list[Any]] = None) -> LabelledBatch:
    """label_batch for any tokenizer: labels from the encodings' offsets, checked by decoding."""
    if not texts_and_spans:
        return LabelledBatch(TokenRows.empty(), np.zeros(0, dtype=bool))
    if encodings is None:
        encodings = _encode(tokenizer, [text for text, _ in texts_and_spans])
    id_rows = [encoding.ids for encoding in encodings]
    lengths = np.fromiter(map(len, id_rows), dtype=np.int64, count=len(id_rows))
    ids = np.fromiter(chain.from_iterable(id_rows), dtype=np.int32, count=int(lengths.sum()))
    bounds = row_bounds(lengths)
    trained, by_definition = np.zeros(len(ids), dtype=bool), []
    for row, (base, encoding, (text, spans)) in enumerate(zip(bounds.tolist(), encodings, texts_and_spans)):
        ranges = _span_tokens(encoding, len(text), len(id_rows[row]), spans)
        if ranges is None:
            by_definition.append(row)
            continue
        for first, stop in ranges:
            trained[base + first : base + stop] = True
    labels = np.where(trained, ids, np.int32(IGNORE_INDEX))
    for row in by_definition:
        labels[bounds[row] : bounds[row + 1]] = label_tokens(id_rows[row], encodings[row].offsets,
                                                             texts_and_spans[row][1])
    rows = TokenRows(ids, labels, bounds)
    right = _check_runs(tokenizer, id_rows, rows, texts_and_spans) if check else [True] * len(id_rows)
    return LabelledBatch(rows, np.asarray(right, dtype=bool))


def label_and_check(
    tokenizer: PreTrainedTokenizerBase, texts_and_spans: list[tuple[str, Spans]], check: bool = True
) -> tuple[list[Example], list[bool]]:
    """`label_batch` as one Example per row, and whether each row's labels are right."""
    batch = label_batch(tokenizer, texts_and_spans, check)
    return batch.rows.examples(), batch.right.tolist()


def _check_runs(tokenizer: PreTrainedTokenizerBase, id_rows: list[list[int]], rows: TokenRows,
                texts_and_spans: list[tuple[str, Spans]]) -> list[bool]:
    run_starts, run_ends = run_bounds(rows)
    run_rows = (np.searchsorted(rows.bounds, run_starts, side="right") - 1).tolist()
    bases = rows.bounds[:-1].tolist()
    decoded = _decode_runs(tokenizer, [id_rows[r][a - bases[r] : b - bases[r]]
                                       for r, a, b in zip(run_rows, run_starts.tolist(), run_ends.tolist())])
    by_row: list[list[str]] = [[] for _ in texts_and_spans]
    for row, text in zip(run_rows, decoded):
        by_row[row].append(text.strip())
    expected = ([text[a:b].strip() for a, b in spans if text[a:b].strip()] for text, spans in texts_and_spans)
    return [runs == wanted or _normalized(runs) == _normalized(wanted) for runs, wanted in zip(by_row, expected)]


def _normalized(texts: list[str]) -> list[str]:
    """Texts in Unicode's compatibility composition (NFKC): a tokenizer whose normalizer composes (GPT-NeoX's and
    OLMo's NFC, NFKC ones) decodes decomposed text ("e" + U+0301, Hangul jamo) as its composed form, the same
    text to a reader, not a turn boundary the tokens cross."""
    return [unicodedata.normalize("NFKC", text) for text in texts]


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


def count_trained(labels: list[int]) -> int:
    """Tokens that get a loss: labels are shifted by one inside the model, so position 0 never does."""
    return len(labels) - 1 - labels[1:].count(IGNORE_INDEX) if labels else 0


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
