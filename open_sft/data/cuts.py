"""Examples tokenized in pieces: the text before a cut and the text after it encoded apart, their tokens joined.

A turn trained after a generation prompt that opens a think block (chat/opened_trace.py: DeepSeek-R1 distills'
`<｜Assistant｜><think>\\n`, QwQ's) is what the model writes after that prompt, and at inference the prompt is
tokenized alone: its tokens end where the prompt does, and the model's own begin there. Encoded as one text, a
byte-level BPE may merge across that boundary (the prompt's `\\n` and an empty block's first `\\n` become one `\\n\\n`
token, which no inference ever feeds or asks for). So such an example carries cuts (character offsets: where those
turns start, chat/examples.py's RowRender.cuts) and is labelled as its pieces (each piece's spans the part of the
example's spans inside it), the pieces' rows then joined into the example's row; its label check is the pieces'.
Every other example is encoded whole, as before.

A tokenizer that does not spell a text's pieces, encoded apart, as it spells the text (a SentencePiece-style one that
prepends "▁" to each text it encodes: the piece after the cut would gain a space) keeps its examples whole.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from open_sft.data.per_tokenizer import PerTokenizer
from open_sft.data.token_rows import TokenRows

Spans = list[tuple[int, int]]
Cuts = Sequence[tuple[int, ...]]  # per example, the character offsets it is cut at (none: encoded whole)
_SPLITS = PerTokenizer()
_AS_IS = {"skip_special_tokens": False, "clean_up_tokenization_spaces": False}
_PROBE = ("Hi there, <think>\n", "\nHello,  world 42\n\n")  # a prompt's end, then what a model writes


def cutting(tokenizer: Any, cuts: Optional[Cuts]) -> bool:
    """Whether examples with these cuts are tokenized in pieces: some example has one, and the tokenizer encodes
    pieces as it encodes their text (module doc)."""
    return cuts is not None and any(cuts) and splits_as_written(tokenizer)


def splits_as_written(tokenizer: Any) -> bool:
    """Whether the tokenizer's decode of a probe's pieces encoded apart is its decode of the probe encoded whole
    (asked once per tokenizer, again if tokens are added)."""
    return _SPLITS.get(tokenizer, len(tokenizer), lambda: _splits_probe(tokenizer))


def _splits_probe(tokenizer: Any) -> bool:
    first, second, whole = tokenizer([*_PROBE, "".join(_PROBE)], add_special_tokens=False)["input_ids"]
    return tokenizer.decode(first + second, **_AS_IS) == tokenizer.decode(whole, **_AS_IS)


def in_pieces(texts_and_spans: list[tuple[str, Spans]], cuts: Cuts) -> tuple[list[tuple[str, Spans]], np.ndarray]:
    """Each example as its pieces, in order, each with the part of the example's spans inside it (offsets in the
    piece), and the index of each example's first piece."""
    pieces: list[tuple[str, Spans]] = []
    firsts = np.empty(len(texts_and_spans), dtype=np.int64)
    for k, ((text, spans), at) in enumerate(zip(texts_and_spans, cuts)):
        firsts[k] = len(pieces)
        edges = [0, *sorted({c for c in at if 0 < c < len(text)}), len(text)]
        for a, b in zip(edges, edges[1:]):
            pieces.append((text[a:b], [(max(s, a) - a, min(e, b) - a) for s, e in spans if s < b and e > a]))
    return pieces, firsts


def joined(rows: TokenRows, right: np.ndarray, firsts: np.ndarray) -> tuple[TokenRows, np.ndarray]:
    """The pieces' rows joined into their examples' rows (`firsts`: in_pieces'), and whether each example's labels
    are right (every piece's are)."""
    bounds = np.append(rows.bounds[firsts], rows.bounds[-1])
    return TokenRows(rows.ids, rows.labels, bounds), np.logical_and.reduceat(right, firsts)
