"""Reasoning traces in assistant messages: the field a template reads, whether it wrote them, masking them.

Datasets and templates name the trace differently: `reasoning_content` (Qwen3, GLM, DeepSeek, most
reasoning datasets), `reasoning` (vLLM's and OpenRouter's newer name), `thinking` (gpt-oss's harmony
template). A trace is handed to the template under the name it reads as well as its own, so a dataset of
one convention trains under a template of another instead of losing its reasoning without a word. A
template that reads none of them (an instruct-only one) leaves the trace out of the text: such rows are
counted per source (`reasoning_not_rendered`) and warned about once.
"""

from __future__ import annotations

import re
from typing import Optional

from open_sft.data.formats import Messages

REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")
# how a template reads a message field: message.key, message['key'], 'key' in message
_READS = {key: re.compile(rf"\.{key}(?!\w)|\[\s*['\"]{key}['\"]\s*\]|['\"]{key}['\"]\s+in\b") for key in REASONING_KEYS}


def template_reasoning_key(template: Optional[str]) -> Optional[str]:
    """The message field the template reads the trace from (the first of REASONING_KEYS it names), or None."""
    if not template:
        return None
    for key in REASONING_KEYS:
        if _READS[key].search(template):
            return key
    return None


def reasoning_of(message: dict) -> str:
    """The message's reasoning trace ("" if none)."""
    for key in REASONING_KEYS:
        value = message.get(key)
        if isinstance(value, str) and value.strip():
            return value
    return ""


def with_template_key(messages: Messages, key: Optional[str]) -> Messages:
    """The messages with each trace also under `key`, the field the template reads (the same list when no
    message needs it: most rows)."""
    if key is None or not any(m.get("role") == "assistant" and key not in m and reasoning_of(m) for m in messages):
        return messages
    out = [dict(m, **{key: reasoning_of(m)}) if m.get("role") == "assistant" and key not in m and reasoning_of(m)
           else m for m in messages]
    if hasattr(messages, "tools"):  # keep a Conversation's attributes
        copy = type(messages)(out)
        copy.__dict__.update(messages.__dict__)
        return copy
    return out


def masked(span: tuple[int, int], text: str, reasoning: str) -> list[tuple[int, int]]:
    """`span` of `text` less the trace written in it (--reasoning_loss mask: the think block's text stays in
    the context, the tags around it and the answer train)."""
    trace = reasoning.strip()
    start, end = span
    at = text.find(trace, start, end) if trace else -1
    if at < 0:
        return [span]
    return [piece for piece in ((start, at), (at + len(trace), end)) if piece[1] > piece[0]]
