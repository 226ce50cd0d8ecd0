"""Reasoning traces in assistant messages: the names a template reads them by, whether it wrote them, masking.

Datasets and templates name the trace differently: `reasoning_content` (Qwen3, GLM, DeepSeek, most reasoning
datasets), `thinking` (gpt-oss's harmony template), `reasoning` (vLLM's and OpenRouter's newer name). As
transformers' apply_chat_template does (5.x), a trace is handed to the template as `thinking` and as
`reasoning_content` too (`with_reasoning_aliases`), so a dataset of one convention trains under a template of
another instead of losing its reasoning without a word, and the text is exactly apply_chat_template's. A
template that reads none of them (an instruct-only one) leaves the trace out, as DeepSeek-R1 distills' own does with
a trace written in the content (`<think>trace</think>answer`, kept only after `</think>`): such rows are counted per
source (`reasoning_not_rendered`) and warned about.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from open_sft.data.formats import Messages, same_kind
from open_sft.data.reasoning_fields import REASONING_KEYS, reasoning_of

if TYPE_CHECKING:
    from open_sft.data.chat.render import TemplateState


def inline_reasoning(message: dict) -> str:
    """A trace written in the content itself, as DeepSeek-R1 distills' and many reasoning datasets' rows carry it:
    `<think>trace</think>answer` (or `trace</think>answer`, the open tag in R1's generation prompt); "" if none."""
    content = message.get("content")
    if not isinstance(content, str):
        return ""
    end = content.find("</think>")
    if end < 0:
        return ""
    start = content.find("<think>", 0, end)
    return content[start + len("<think>") if start >= 0 else 0:end]


def after_trace(content: str) -> str:
    """What follows a trace written in the content (inline_reasoning), the answer templates keep alone in history;
    the whole content where it holds none."""
    return content[content.rfind("</think>") + len("</think>"):] if "</think>" in content else content


def answer_of(message: dict) -> str:
    """What an assistant message says beside its trace: its content after any trace written in it (after_trace),
    stripped; "" where its content is not a string (a turn of calls alone)."""
    content = message.get("content")
    return after_trace(content).strip() if isinstance(content, str) else ""


def inline_unwritten(messages: Messages, indices: list[int], texts: list[str]) -> bool:
    """Whether a trained turn's trace written in its content (inline_reasoning) is in none of `texts`, the
    conversation's examples: DeepSeek-R1 distills' own template keeps only what follows `</think>` in every turn,
    the last one too, so such a row trains no reasoning."""
    traces = (inline_reasoning(messages[i]).strip() for i in indices)
    return any(trace and not any(trace in text for text in texts) for trace in traces)


_PROBE = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there",
                                                "reasoning_content": "probe trace", "thinking": "probe trace"}]


def tags_as_text(state: TemplateState, messages: Messages, indices: list[int], texts: list[str]) -> bool:
    """Whether a trained turn's trace written in its content (inline_reasoning, the turn with no reasoning field) is
    written as text, tags and all, by a template that writes reasoning its own way, without <think> tags (gpt-oss's
    analysis channel): the model learns to write literal think tags in its answer. Found once per template by
    rendering a turn with a reasoning field."""
    traces = [inline_reasoning(messages[i]).strip() for i in indices if not reasoning_of(messages[i])]
    if not any(traces):
        return False
    if state.tagless_reasoning is None:
        try:
            probe = state.draw(_PROBE, False, None)
        except Exception:  # noqa: BLE001 (a template that refuses the probe tells nothing)
            probe = ""
        state.tagless_reasoning = "probe trace" in probe and "<think>" not in probe
    return state.tagless_reasoning and any(trace and trace in text for trace in traces for text in texts)


def without_reasoning(message: dict) -> dict:
    """The message as it would be without its trace: no reasoning field, and a content with a trace written in it
    (inline_reasoning) only what follows its `</think>`."""
    content = message.get("content")
    if inline_reasoning(message):
        content = content[content.find("</think>") + len("</think>"):].lstrip()
    return {**{key: value for key, value in message.items() if key not in REASONING_KEYS}, "content": content}


def trace_of(message: dict) -> str:
    """The trace --reasoning_loss mask leaves untrained: the message's reasoning field, else the one inline."""
    return reasoning_of(message) or inline_reasoning(message)


def with_reasoning_aliases(messages: Messages) -> Messages:
    """The messages with each trace also as `thinking` (unless the message has its own) and as
    `reasoning_content`, as apply_chat_template hands them to the template; the same list when no message has a
    trace (most rows)."""
    def aliased(message: dict) -> dict:
        reasoning = next((message[key] for key in REASONING_KEYS if message.get(key) is not None), None)
        return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}

    if not any(key in m for m in messages for key in REASONING_KEYS):
        return messages
    return same_kind(messages, (aliased(m) for m in messages))  # a Conversation keeps its attributes


def masked(span: tuple[int, int], text: str, reasoning: str) -> list[tuple[int, int]]:
    """`span` of `text` less the trace written in it (--reasoning_loss mask: the think block's text stays in
    the context, the tags around it and the answer train)."""
    trace = reasoning.strip()
    start, end = span
    at = text.find(trace, start, end) if trace else -1
    if at < 0:
        return [span]
    return [piece for piece in ((start, at), (at + len(trace), end)) if piece[1] > piece[0]]
