"""Text helpers for reading what a chat template writes around a probe message (open_sft.export.reply's reasoning
layout, open_sft.export.tool_calls' call layout): the special tokens taken out, the text two renderings end with."""

from __future__ import annotations

import os
import re

from open_sft.data.chat.render import special_markers


def strip_specials(text: str, tokenizer) -> str:
    """`text` without the tokenizer's special tokens, added tokens flagged special included (Phi-4-mini's
    `<|/tool_call|>`, `<|end|>`, which a tokenizer need not list among its additional special tokens), longest
    first (`<|im_end|>` before a token it holds)."""
    for token in special_markers(tokenizer):
        text = text.replace(token, "")
    return text


def without_shared_ending(text: str, other: str, tokenizer) -> str:
    """`text` less the ending it shares with `other`, special tokens taken whole (`<|call|>` and `<|return|>` share
    none) and text between them too (`\n</tool_call><|im_end|>` less `ANSWER<|im_end|>`'s: `\n</tool_call>`)."""
    specials = "|".join(re.escape(token) for token in sorted(special_markers(tokenizer), key=len, reverse=True))
    pieces = [[piece for piece in (re.split(f"({specials})", each) if specials else [each]) if piece]
              for each in (text, other)]
    shared = 0
    while shared < min(map(len, pieces)) and pieces[0][-1 - shared] == pieces[1][-1 - shared]:
        shared += 1
    return "".join(pieces[0][:len(pieces[0]) - shared])


def common_suffix(first: str, second: str) -> str:
    """The longest text both end with."""
    return os.path.commonprefix([first[::-1], second[::-1]])[::-1]
