"""A generated reply split as the chat template writes an assistant message: its reasoning apart from its answer.

Reasoning models write a trace before the answer, in the form their template gives it: Qwen3's and GLM-4.5's
`<think>TRACE</think>ANSWER` (Qwen3 writes `<think>\\n\\n</think>\\n\\n` before every answer, plain chat data
too), gpt-oss's analysis channel before its final one (`<|channel|>analysis<|message|>TRACE<|end|><|start|>
assistant<|channel|>final<|message|>ANSWER`). Scoring the whole reply marks a right answer wrong, and a chat
history that holds the reply as flat content renders a context the model never saw (gpt-oss's markers are
special tokens, so a decoded reply loses them: `analysisTRACEassistantfinalANSWER`).

The split is the template's own: a tokenizer with a `response_template` parses the reply with transformers'
parse_response; otherwise by the template's reasoning layout, read off its renderings of probe messages
(open_sft.export.trace_layout): the reasoning's opening and the marker the answer follows (`</think>`,
`<|channel|>final<|message|>`, Gemma 4's `<channel|>` after `<|channel>thought`, Apriel-1.6's `[BEGIN FINAL
RESPONSE]` after a trace its generation prompt opens with words, Mistral's `[/THINK]`). A template with no such
layout leaves the trace written in the content, DeepSeek-R1 distills' way
(`trace</think>answer`, the open tag in the generation prompt): the answer is what follows its last `</think>`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from typing import Optional

from open_sft.export.template_text import strip_specials
from open_sft.export.trace_layout import INLINE_CLOSE, INLINE_OPEN, reasoning_layout


@dataclass(frozen=True)
class ReplyParts:
    """A reply's `answer` (what is scored and kept as the message's content), its `reasoning` (None: the reply
    has no reasoning part; "" an empty one, such as Qwen3's empty think block) and whether the answer began
    (False: the reply stopped inside its reasoning, before any answer)."""

    answer: str
    reasoning: str | None = None
    answered: bool = True
    verbatim: str | None = None
    tool_calls: tuple[dict, ...] = ()  # each {name, arguments}: the calls the reply made (open_sft.export.tool_calls)
    unreadable_call: str | None = None  # the reply's call as written (from its marker on), where it does not read
    call_ids: tuple[str, ...] = ()  # the ids the reply wrote, where its template writes them as names (Kimi-K2's)
    text_arguments: bool = False  # the template takes arguments as JSON text (DeepSeek's concatenate them)
    thinking_chunk: bool = False  # the template takes the trace as a `thinking` chunk of the content (Mistral's)

    def message(self) -> dict:
        """The reply as the assistant message the template renders back: the trace as `reasoning_content`
        (transformers hands it to the template as `thinking` too), so the history renders as training did; an
        empty trace is left out (gpt-oss's template would write an empty analysis message for it). A template
        with no reasoning field (`verbatim`: the trace was written in the content) keeps the reply as written,
        trace and tags in the content, as its training rows held it (reasoning_content would be dropped); one
        that takes the trace as a `thinking` chunk (`thinking_chunk`, Mistral's) gets it so, before the answer.
        The calls are the message's `tool_calls`, as a training row holds them (ids `call00001`...: Mistral's
        templates take nine alphanumeric characters; the ids the reply wrote where its template writes them as
        names), their arguments as JSON text where the template takes text, so a tool result can follow and the
        history renders as the model wrote it."""
        if self.verbatim is not None and not self.tool_calls:
            return {"role": "assistant", "content": self.verbatim}
        message = {"role": "assistant", "content": self.answer}
        if self.reasoning and self.thinking_chunk:
            message["content"] = [{"type": "thinking", "thinking": self.reasoning}] + (
                [{"type": "text", "text": self.answer}] if self.answer else [])
        elif self.reasoning:
            message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": self.call_ids[n - 1] if self.call_ids else call_id(n), "type": "function", "function": {
                    **call, "arguments": json.dumps(call["arguments"], ensure_ascii=False) if self.text_arguments
                    else call["arguments"]}} for n, call in enumerate(self.tool_calls, 1)]
        return message


def call_id(n: int) -> str:
    """The id of a reply's n-th call (and of the tool message that answers it)."""
    return f"call{n:05d}"


def split_reply(tokenizer, text: str, plain: str, opened: bool = False) -> ReplyParts:
    """`text` (the reply decoded with its special tokens, less the token that ended it) split into reasoning and
    answer by the template's layout (module docstring); `plain` (decoded without them, as generated, whitespace
    included) when it has none. `opened`: the prompt ended in an open `<think>` (opens_reasoning), which the reply
    continues: a reply without `</think>` stopped inside its trace."""
    layout = reasoning_layout(tokenizer.chat_template, tokenizer) if isinstance(tokenizer.chat_template, str) \
        else None
    if layout is None:
        verbatim = (INLINE_OPEN if opened and not plain.lstrip().startswith(INLINE_OPEN) else "") + plain
        if INLINE_CLOSE not in text:
            if opened:
                return ReplyParts("", strip_specials(text, tokenizer).strip(), answered=False, verbatim=verbatim)
            return ReplyParts(plain)
        head, _, answer = text.rpartition(INLINE_CLOSE)
        return ReplyParts(strip_specials(answer, tokenizer).strip(),
                          strip_specials(head.replace(INLINE_OPEN, "", 1), tokenizer).strip(), verbatim=verbatim)
    head, found, answer = text.rpartition(layout.answer_marker)
    if not found:
        start = text.lstrip()
        if layout.opened:  # the prompt opened the trace (Apriel-1.6's words): stopped inside it
            return ReplyParts("", strip_specials(start, tokenizer).strip(), answered=False)
        if layout.opening and start.startswith(layout.opening):  # stopped inside the trace
            return ReplyParts("", strip_specials(start[len(layout.opening):], tokenizer).strip(), answered=False,
                              thinking_chunk=layout.chunks)
        if start and (layout.opening.startswith(start) or layout.answer_marker.startswith(start)):
            return ReplyParts("", "", answered=False)  # stopped inside the markup before the trace or the answer
        return ReplyParts(plain)
    head = head.strip()
    if layout.opening and head.startswith(layout.opening):
        head = head[len(layout.opening):]
    rest = layout.between[:len(layout.between) - len(layout.answer_marker)].strip()  # gpt-oss: <|end|><|start|>...
    if rest and head.rstrip().endswith(rest):
        head = head.rstrip()[:-len(rest)]
    return ReplyParts(strip_specials(answer, tokenizer).strip(), strip_specials(head, tokenizer).strip(),
                      thinking_chunk=layout.chunks)


def _answer_start(tokenizer, text: str, opened: bool) -> int | None:
    """Where the part of `text` a call may be written in starts: past the reply's trace (Qwen3's `</think>`,
    gpt-oss's `<|end|><|start|>assistant` after its analysis), 0 for a reply without one, None where the reply
    stopped inside its trace. A call written inside the reasoning is part of the reasoning."""
    from open_sft.export.tool_calls import call_layout

    template = tokenizer.chat_template
    layout = reasoning_layout(template, tokenizer) if isinstance(template, str) else None
    if layout is None:
        if not (opened or text.lstrip().startswith(INLINE_OPEN)):
            return 0
        return None if (at := text.find(INLINE_CLOSE)) < 0 else at + len(INLINE_CLOSE)
    start = text.lstrip()
    if layout.opened:
        return None if (at := text.find(layout.answer_marker)) < 0 else at
    if not (layout.opening and start.startswith(layout.opening)):
        return 0
    calls = call_layout(tokenizer)
    shared = os.path.commonprefix([layout.between, calls.before_call]).strip() if calls else ""
    at = text.find(shared or layout.answer_marker, len(text) - len(start) + len(layout.opening))
    return None if at < 0 else at


def parse_reply(tokenizer, new_ids: list[int], prompt_ids: list[int], tools: Optional[list] = None,
                ended_by: str = "") -> ReplyParts:
    """The reply's parts: by the tokenizer's own `response_template` (transformers' parse_response) where it has
    one, else by split_reply on the reply decoded with its special tokens, its tool calls read by the template's
    layout of a call (open_sft.export.tool_calls) in what follows its reasoning: the text before the first call is
    the content and reasoning, text after the last call is kept after that content, and a call that does not read
    (cut off, not JSON, arguments not an object, its closing missing: `ended_by`, the token that ended the reply
    and not in `new_ids`, may be it) makes the reply an unreadable call (`unreadable_call`)."""
    from open_sft.export.tool_calls import expected_calls, read_calls

    if getattr(tokenizer, "response_template", None) is not None:
        try:
            parsed = tokenizer.parse_response(new_ids, prefix=prompt_ids, tools=tools)
        except Exception:  # noqa: BLE001  (a parser that fails on this reply: the template's layout splits it)
            parsed = None
        if isinstance(parsed, dict):
            reasoning = next((parsed[key] for key in ("reasoning_content", "thinking", "reasoning")
                              if isinstance(parsed.get(key), str)), None)
            answer = str(parsed.get("content") or "").strip()
            calls = tuple(expected_calls(parsed)) if isinstance(parsed.get("tool_calls"), list) else ()
            return ReplyParts(answer, reasoning, answered=bool(answer) or not reasoning or bool(calls),
                              tool_calls=calls)
    opened = tokenizer.decode(prompt_ids, skip_special_tokens=False).rstrip().endswith(INLINE_OPEN)
    text = tokenizer.decode(new_ids, skip_special_tokens=False)
    start = _answer_start(tokenizer, text, opened)
    read = read_calls(tokenizer, text[start:], tools, ended_by) if start is not None else None
    if read is not None and (read.calls or read.unreadable):  # a reply that calls a tool has answered
        head = text[:start] + read.head
        parts = split_reply(tokenizer, head, strip_specials(head, tokenizer), opened)
        answer = "\n\n".join(part for part in (parts.answer.strip(), read.after) if part)
        return replace(parts, answer=answer, answered=True, verbatim=None, tool_calls=read.calls,
                       unreadable_call=read.unreadable, call_ids=read.ids, text_arguments=read.text_arguments)
    return split_reply(tokenizer, text, tokenizer.decode(new_ids, skip_special_tokens=True), opened)
