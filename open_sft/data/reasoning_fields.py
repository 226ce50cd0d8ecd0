"""The fields an assistant message's reasoning trace is given in, and the trace they hold: a leaf module, so that
the row formats (open_sft.data.formats) read them as the chat rendering (open_sft.data.chat.reasoning) does."""

from __future__ import annotations

REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")  # transformers' order


def reasoning_of(message: dict) -> str:
    """The message's reasoning trace ("" if none)."""
    for key in REASONING_KEYS:
        value = message.get(key)
        if isinstance(value, str) and value.strip():
            return value
    return ""
