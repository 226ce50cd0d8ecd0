"""Labels and the label check for byte-level BPE tokenizers (GPT-2, GPT-NeoX/OLMo, Llama 3, Qwen), from
each token's bytes instead of the tokenizer's offsets and decoder.

Why by hand: the label check decodes every trained token, and the tokenizers library's decoder takes
~180 ns a token (a tenth of the encode); the labels need offsets only at a few span boundaries, asked
token by token from Python. Here the rows are encoded without offsets (`encode_batch_fast`) and, for a
tokenizer whose decoder is ByteLevel, each token id's bytes come from a table checked once against the
tokenizer's own decode of every id: a decode is then a slice of the row's own bytes. A row takes this path only if its tokens' bytes spell exactly its text's UTF-8
bytes (so the tokens hold consecutive byte ranges and a decode is a slice of the text: no normalizer
changed it, no prefix space, no stripping added token), and the tokens at the ends of its spans
must overlap the span with more than the spaces ByteLevel's offset trimming may cut from them: then the
tokenizer's offsets and the tokens' byte ranges train the same tokens (`tokenize.label_tokens`, the
definition; tested equal). Every other row is left to labels.py's offset path.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Any, Optional

import numpy as np

from open_sft.data.per_tokenizer import PerTokenizer
from open_sft.data.token_rows import IGNORE_INDEX, TokenRows, row_bounds, run_bounds

Spans = list[tuple[int, int]]
_TABLES = PerTokenizer()
_PROBE = "Hello, World!  Two  spaces,\n\ta tab, café and 😀 at 42 %"


@dataclass(frozen=True)
class ByteTable:
    """Token id → the bytes its decode stands for, and their number."""

    pieces: list[bytes]
    lengths: np.ndarray  # int64
    # Bytes of the characters ByteLevel's offset trimming may cut from the token's start and end ("Ġ",
    # or whitespace in an added token), at most: its offsets may be narrower than its bytes.
    lead: np.ndarray  # int64
    trail: np.ndarray  # int64


def _decoder_bytes(token: str, char_bytes: dict[str, int]) -> bytes:
    """The ByteLevel decoder's bytes for one token: its characters mapped back to bytes, or the token's
    own UTF-8 when some character is not one of the 256 byte characters (added tokens like "\n\n")."""
    try:
        return bytes(char_bytes[char] for char in token)
    except KeyError:
        return token.encode()


def _build_table(backend: Any) -> Optional[ByteTable]:
    from tokenizers.decoders import ByteLevel
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    if not isinstance(backend.decoder, ByteLevel):
        return None
    char_bytes = {char: byte for byte, char in bytes_to_unicode().items()}
    as_latin1 = str.maketrans({char: chr(byte) for char, byte in char_bytes.items()})
    size = backend.get_vocab_size(with_added_tokens=True)
    tokens = [""] * size
    for token, index in backend.get_vocab(with_added_tokens=True).items():
        if index >= size:
            return None
        tokens[index] = token
    # Quick for the usual token (all byte characters), then exact wherever the tokenizer's own decode
    # disagrees: the table is only used if it agrees with that decode for every id.
    pieces = [token.translate(as_latin1).encode("latin-1", "replace") for token in tokens]
    decoded = backend.decode_batch([[i] for i in range(size)], skip_special_tokens=False)
    for i in [i for i, (piece, text) in enumerate(zip(pieces, decoded)) if piece.decode("utf-8", "replace") != text]:
        pieces[i] = _decoder_bytes(tokens[i], char_bytes)
        if pieces[i].decode("utf-8", "replace") != decoded[i]:
            return None
    lengths = np.fromiter(map(len, pieces), dtype=np.int64, count=size)
    # The bytes of the characters trimming may cut: "Ġ" (a space) or whitespace (Python's isspace
    # includes Rust's is_whitespace, so never fewer than tokenizers trims).
    spaced = [token.replace("Ġ", " ") for token in tokens]
    lead = np.fromiter((len(token[: len(token) - len(token.lstrip())].encode()) for token in spaced),
                       dtype=np.int64, count=size)
    trail = np.fromiter((len(token[len(token.rstrip()):].encode()) for token in spaced), dtype=np.int64, count=size)
    table = ByteTable(pieces, lengths, lead, trail)
    # A tokenizer that changes every text (lowercases, adds a prefix space) would send every row through
    # both paths: such a tokenizer gets none.
    probe = backend.encode_batch_fast([_PROBE], add_special_tokens=False)[0].ids
    if not _spelled(table, [probe], [_PROBE.encode()])[0]:
        return None
    return table


def byte_table(tokenizer: Any) -> Optional[ByteTable]:
    """The checked byte table of a fast tokenizer with a ByteLevel decoder, else None. Made once per
    tokenizer (and again if tokens are added); call before forking workers so they share it."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if not getattr(tokenizer, "is_fast", False) or backend is None or tokenizer.clean_up_tokenization_spaces:
        return None
    return _TABLES.get(tokenizer, backend.get_vocab_size(with_added_tokens=True), lambda: _checked_table(backend))


def _checked_table(backend: Any) -> Optional[ByteTable]:
    try:
        return _build_table(backend)
    except Exception:  # an unexpected tokenizer layout: the offset path serves it
        return None


def _spelled(table: ByteTable, id_rows: list[list[int]], encoded: list[bytes]) -> np.ndarray:
    """Per row: do its tokens' bytes, end to end, equal its text's bytes? (A join of the token ids'
    bytes objects per row: 5× faster than gathering bytes with numpy.)"""
    piece = table.pieces.__getitem__
    return np.fromiter((b"".join(map(piece, ids)) == text for ids, text in zip(id_rows, encoded)), dtype=bool,
                       count=len(encoded))


def _byte_spans(text: str, spans: Spans) -> Optional[list[tuple[int, int]]]:
    """The spans in UTF-8 byte positions, or None when the row must take the offset path (an empty or
    unordered span: the definition has its own answers there)."""
    previous_end = 0
    for start, end in spans:
        if not previous_end <= start < end <= len(text):
            return None
        previous_end = end
    if text.isascii():
        return spans
    return [(len(text[:start].encode()), len(text[:end].encode())) for start, end in spans]


def _surely_trained(table: ByteTable, token: np.ndarray, end: np.ndarray, firsts: np.ndarray,
                    stops: np.ndarray) -> np.ndarray:
    """Per span, for the token (ending at byte `end`) at one of its ends: does `label_tokens` surely
    train it, whatever its offsets lost to trimming? Yes when its bytes without the leading and
    trailing spaces trimming may cut are not empty and overlap the span; otherwise the offsets decide."""
    core_start = end - table.lengths[token] + table.lead[token]
    core_end = end - table.trail[token]
    return (core_end > core_start) & (core_end > firsts) & (core_start < stops)


@dataclass(frozen=True)
class ByteLabelled:
    rows: TokenRows  # the rows this path labelled, in order
    taken: np.ndarray  # bool per input row: labelled here (else left to the offset path)
    right: np.ndarray  # per labelled row: its trained runs decode to its spans


def label_byte_level(table: ByteTable, id_rows: list[list[int]], texts_and_spans: list[tuple[str, Spans]],
                     check: bool) -> ByteLabelled:
    """Label the rows this path can take (module docstring), from their token ids (encoded without
    offsets, no special tokens added)."""
    texts = [text for text, _ in texts_and_spans]
    lengths = np.fromiter(map(len, id_rows), dtype=np.int64, count=len(id_rows))
    ids = np.fromiter(chain.from_iterable(id_rows), dtype=np.int32, count=int(lengths.sum()))
    bounds = row_bounds(lengths)
    encoded = [text.encode() for text in texts]
    taken = _spelled(table, id_rows, encoded)
    token_ends = np.cumsum(table.lengths[ids])  # byte end of each token, rows end to end
    row_base = np.concatenate([[0], token_ends])[bounds[:-1]].tolist()
    firsts, stops, span_rows = [], [], []
    for row in np.flatnonzero(taken).tolist():
        text, spans = texts_and_spans[row]
        byte_spans = _byte_spans(text, spans)
        if byte_spans is None:
            taken[row] = False
            continue
        base = row_base[row]
        firsts += [base + start for start, _ in byte_spans]
        stops += [base + end for _, end in byte_spans]
        span_rows += [row] * len(byte_spans)
    # A span trains the tokens from the one holding its first byte to the one holding its last. Those
    # between lie inside the span with or without trimming; where trimming could decide about an end
    # (a whitespace token, a span that begins or ends on a space), the row is left to the offset path.
    firsts, stops = np.asarray(firsts, dtype=np.int64), np.asarray(stops, dtype=np.int64)
    first_tokens = np.searchsorted(token_ends, firsts, side="right")
    last_tokens = np.searchsorted(token_ends, stops - 1, side="right")
    agree = [_surely_trained(table, ids[tokens], token_ends[tokens], firsts, stops)
             for tokens in (first_tokens, last_tokens)]
    taken[np.asarray(span_rows, dtype=np.int64)[~(agree[0] & agree[1])]] = False
    change = np.zeros(len(ids) + 1, dtype=np.int64)
    np.add.at(change, first_tokens, 1)
    np.add.at(change, last_tokens + 1, -1)
    trained = np.cumsum(change[:-1]) > 0
    labels = np.where(trained, ids, np.int32(IGNORE_INDEX))
    chosen = np.flatnonzero(taken)
    rows = TokenRows(ids, labels, bounds).take(chosen)
    right = _check(rows, token_ends, bounds, chosen, encoded, texts_and_spans) if check else np.ones(len(chosen), bool)
    return ByteLabelled(rows, taken, right)


def _check(rows: TokenRows, token_ends: np.ndarray, bounds: np.ndarray, chosen: np.ndarray, encoded: list[bytes],
           texts_and_spans: list[tuple[str, Spans]]) -> np.ndarray:
    """Per labelled row: each maximal run of trained tokens decodes (its bytes: a slice of the text's,
    as the row is spelled by its tokens) to a trained span, run for span, modulo surrounding whitespace."""
    starts, ends = run_bounds(rows)
    run_rows = np.searchsorted(rows.bounds, starts, side="right") - 1
    token_starts = np.concatenate([[0], token_ends])
    shift = (bounds[chosen] - rows.bounds[:-1])[run_rows]  # a token's position among all encoded rows
    base = token_starts[bounds[chosen]][run_rows]  # where its row's bytes begin
    decoded: list[list[str]] = [[] for _ in chosen]
    for r, row, a, b in zip(run_rows.tolist(), chosen[run_rows].tolist(), (token_starts[starts + shift] - base).tolist(),
                            (token_starts[ends + shift] - base).tolist()):
        decoded[r].append(encoded[row][a:b].decode("utf-8", "replace").strip())
    wanted = ([text[a:b].strip() for a, b in spans if text[a:b].strip()]
              for text, spans in (texts_and_spans[row] for row in chosen.tolist()))
    return np.fromiter((runs == expected for runs, expected in zip(decoded, wanted)), dtype=bool, count=len(chosen))
