"""The special tokens a template writes around a trace, and a row's text without them where it writes them so.

Magistral's and Ministral-3-Reasoning's templates write a trace `[THINK]trace[/THINK]answer`, special tokens both;
datasets store such turns with the trace in the content in that form. The tokenizer encodes that text as the two
control tokens, as the template writes them, so the turn trains as the model generates it: it is not the literal
text of a special token in the data (special_tokens_in_text, a fake end of turn), and is not counted as such. The
same tokens elsewhere in a message (a second block, one in a user turn) still are. Only a template that renders a
content in that inline form exactly as it renders the trace given apart is taken to write it so: gpt-oss's writes
a trace between `<|message|>` and `<|end|>` too, but a content `<|message|>x<|end|>y` is a fake end of its turn.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from open_sft.data.chat.probes import PROBE_USER
from open_sft.data.formats import Messages
from open_sft.data.reasoning_fields import reasoning_of

if TYPE_CHECKING:
    from open_sft.data.chat.render import TemplateState

_TRACE, _ANSWER = "probe trace", "Hello there"
_PROBE = [PROBE_USER, {"role": "assistant", "content": _ANSWER, "reasoning_content": _TRACE, "thinking": _TRACE}]


def trace_markers(state: TemplateState, markers: tuple[str, ...]) -> tuple[str, str]:
    """The special tokens (of `markers`, longest first) the template writes right before and right after a turn's
    trace (`[THINK]`, `[/THINK]`), read off a probe answer once per template state; ("", "") where it writes no
    trace, none such around it (Qwen3's `<think>` is no special token), or renders the content
    `{opening}trace{closing}answer` otherwise than the trace given apart (gpt-oss's `<|message|>`, `<|end|>`: such
    a content would be its final channel's text, a fake end of turn in it)."""
    if state.trace_markers is None:
        state.trace_markers = ("", "")
        try:
            text = state.draw(_PROBE, False, None)
        except Exception:  # noqa: BLE001 (a template that refuses the probe tells nothing)
            return state.trace_markers
        at = text.find(_TRACE)
        before, after = text[:at].rstrip(), text[at + len(_TRACE):].lstrip()
        opening = next((m for m in markers if before.endswith(m)), "") if at >= 0 else ""
        closing = next((m for m in markers if after.startswith(m)), "") if opening else ""
        if closing and _writes_inline(state, opening + _TRACE + closing + _ANSWER, text):
            state.trace_markers = (opening, closing)
    return state.trace_markers


def _writes_inline(state: TemplateState, content: str, apart: str) -> bool:
    """Whether the template renders the probe answer with `content` (its trace inline) as `apart`, its text with
    the trace given as reasoning_content."""
    try:
        return state.draw([PROBE_USER, {"role": "assistant", "content": content}], False, None) == apart
    except Exception:  # noqa: BLE001 (a template that refuses it does not write it so)
        return False


def own_texts(messages: Messages, block: tuple[str, str]) -> Iterator[str]:
    """The messages' texts (contents, reasoning fields) to search for special tokens' text: an assistant content
    that opens with the template's trace block (`block`, trace_markers) without those two tokens, where the template
    writes them and the message gives no trace apart (the template would write that one's block, and the content's
    would be a second)."""
    opening, closing = block
    for message in messages:
        content = message.get("content")
        if opening and message["role"] == "assistant" and isinstance(content, str) and not reasoning_of(message) \
                and content.lstrip().startswith(opening) and closing in content:
            inner = content.lstrip()[len(opening):]
            content = inner.replace(closing, "", 1)
        yield content
        yield message.get("reasoning_content")
