"""Text helpers for reading what a chat template writes around a probe message (open_sft.export.reply's reasoning
layout, open_sft.export.tool_calls' call layout): the special tokens taken out, the text two renderings end with."""

from __future__ import annotations

import os


def strip_specials(text: str, tokenizer) -> str:
    """`text` without the tokenizer's special tokens (longest first: `<|im_end|>` before a token it holds)."""
    for token in sorted(tokenizer.all_special_tokens, key=len, reverse=True):
        text = text.replace(token, "")
    return text


def common_suffix(first: str, second: str) -> str:
    """The longest text both end with."""
    return os.path.commonprefix([first[::-1], second[::-1]])[::-1]
