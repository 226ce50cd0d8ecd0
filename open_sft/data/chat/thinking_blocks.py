"""Reasoning under templates that read it from a content block only.

Mistral's reasoning templates (Magistral's, Ministral-3-Reasoning's) write a trace given as a content part,
`{"type": "thinking", "thinking": ...}` beside `{"type": "text", "text": ...}` (`[THINK]trace[/THINK]answer`), and
read no reasoning field: a row's `reasoning_content` (or `thinking`) was left out under the model's own template
(counted as reasoning the template does not write, with the advice to choose a template that writes it). Read off
the template by a probe, not from a list of models: where it writes a trace given as such a block and not as a
field, the renderer hands every assistant trace over as that block, before the content's text. Everything else sees
the row as it was (content a string, the trace a field), as for any template.
"""

from __future__ import annotations

from typing import Callable, Optional

from open_sft.data.formats import Messages, RowError, same_kind
from open_sft.data.reasoning_fields import reasoning_of

Renderer = Callable[[Messages, bool, Optional[list]], str]

_TRACE = "Adding the two numbers gives four."


def _probe(assistant: dict) -> list[dict]:
    return [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", **assistant}]


def reads_thinking_blocks(draw: Renderer) -> bool:
    """Whether the template writes a trace given as a content block, and not one given as a reasoning field (nor
    the block's repr or JSON, as a template writing `message.content` whatever it is does)."""
    try:
        as_field = draw(_probe({"content": "4", "reasoning_content": _TRACE, "thinking": _TRACE}), False, None)
        as_block = draw(_probe({"content": as_blocks(_TRACE, "4")}), False, None)
    except RowError:
        return False
    return _TRACE not in as_field and _TRACE in as_block and not any(key in as_block for key in ("'type'", '"type"'))


def as_blocks(trace: str, content: str) -> list[dict]:
    """A trace and an answer as the content parts Mistral's reasoning templates read."""
    return [{"type": "thinking", "thinking": trace}, {"type": "text", "text": content}]


def with_thinking_blocks(draw: Renderer) -> Renderer:
    """The renderer, every assistant message with a trace handed to the template with it as a thinking block."""
    def blocks(messages: Messages, add_generation_prompt: bool, tools: Optional[list]) -> str:
        traces = [reasoning_of(m) if m.get("role") == "assistant" and isinstance(m.get("content", ""), str) else ""
                  for m in messages]  # each message's trace read once (a render of every prefix comes here)
        if any(traces):
            messages = same_kind(messages, ({**m, "content": as_blocks(trace, m.get("content") or "")} if trace else m
                                            for m, trace in zip(messages, traces)))
        return draw(messages, add_generation_prompt, tools)
    return blocks
