"""A final answer whose trace the template leaves out of the think block it writes for it, where it writes the traces
of other turns in that block.

Kimi-K2-Thinking's template writes an assistant turn's `reasoning_content` only for the turns after the last
assistant message without tool calls (the calls of the agentic turn under way); every answer, the last message too, is
`<think></think>answer`. At inference the model writes, after the generation prompt, `<think>trace</think>answer` (the
template writes its call turns so): a thinking model trained on the template's rendering of the last message learns
to think nothing before every final answer. So where a turn's rendering as the last message holds the think block
empty and the row gives the turn a trace (`reasoning_content`, `thinking` or `reasoning`), the turn trains with the
trace written in that block as the template writes a trace where it does write one (`trace_block`: read off probe
conversations, an answer and a call turn, each with a trace): `<think>trace</think>answer<|im_end|>`. A template that
writes no trace anywhere (an instruct-only one) or no block (`chatml`) is left as it is (reasoning_not_rendered).
"""

from __future__ import annotations

import re
from typing import Callable, Optional

from open_sft.data.chat.elements import element
from open_sft.data.chat.probes import PROBE_TOOLS, PROBE_USER, probe_call
from open_sft.data.chat.reasoning import reasoning_of
from open_sft.data.formats import RowError, same_kind

_TRACE = "probe trace"
_TAG = re.compile(r"<[^<>\s]+>\s*$")  # a tag at the end of a text, then whitespace
_PROBES = (
    ([PROBE_USER, {"role": "assistant", "content": "Hello there", "reasoning_content": _TRACE, "thinking": _TRACE}],
     None),
    ([PROBE_USER, probe_call(reasoning_content=_TRACE, thinking=_TRACE)], PROBE_TOOLS))


def trace_block(draw: Callable) -> tuple[str, str]:
    """What the template writes before and after a trace where it writes one, in tags (Kimi-K2-Thinking's `<think>`,
    `</think>` in a call turn; Qwen3's `<think>\\n`, `\\n</think>`): ("", "") where no probe shows one."""
    for messages, tools in _PROBES:
        try:
            text = draw(messages, False, tools)
        except Exception:  # noqa: BLE001 (a template without that kind of turn tells nothing)
            continue
        at = text.find(_TRACE)
        before = _TAG.search(text[:at]) if at >= 0 else None
        after = re.match(r"\s*<[^<>\s]+>", text[at + len(_TRACE):]) if before else None
        if before and after:
            opening, closing = element(before.group().strip()), element(after.group().strip())
            if opening and closing and not opening[1] and closing == (opening[0], True):
                return before.group(), after.group()
    return "", ""


def filled_turn(message: dict, target: str, block: tuple[str, str]) -> Optional[str]:
    """`target` (what the template writes for the turn after its generation prompt) with the message's trace written
    in the empty think block it holds, as the template writes a trace (`block`); None where the template writes the
    trace, the message has none, or the turn holds no such empty block."""
    before, after = block
    trace = reasoning_of(message).strip()
    if not before or not trace or trace in target:
        return None
    empty = re.search(re.escape(before.strip()) + r"\s*" + re.escape(after.strip()), target)
    if empty is None:
        return None
    return target[: empty.start()] + before + trace + after + target[empty.end():]


def doubles_inline(draw: Callable, block: tuple[str, str]) -> bool:
    """Whether the template, which writes traces in `block`, writes its own block before an answer whose content holds
    its trace in that block (`<think>trace</think>answer`, as some datasets store it) and so the block twice
    (Kimi-K2-Thinking's `<think></think><think>trace</think>answer`); Qwen3's takes the trace out of the content."""
    before, after = block
    if not before:
        return False
    answer = {"role": "assistant", "content": before + _TRACE + after + "Hello there"}
    try:
        text = draw([PROBE_USER, answer], False, None)
    except Exception:  # noqa: BLE001 (a template that refuses the probe tells nothing)
        return False
    return text.count(before.strip()) > 1


def inline_moved(messages: list, block: tuple[str, str]) -> list:
    """The messages with a trace written at the start of an assistant content in the template's block (`block`) given
    as the turn's `reasoning_content` instead, for a template that would write the block twice (doubles_inline): the
    turn then holds one block, its trace written once, as the model writes it. A message whose reasoning field holds
    another trace is the row's error."""
    opening, closing = block[0].strip(), block[1].strip()
    out = []
    for i, message in enumerate(messages, start=1):
        content = message.get("content")
        if message["role"] != "assistant" or not isinstance(content, str) or not content.lstrip().startswith(
                opening) or closing not in content:
            out.append(message)
            continue
        start, end = content.find(opening) + len(opening), content.find(closing)
        trace, field = content[start:end].strip(), reasoning_of(message).strip()
        if field and field != trace:
            raise RowError(f"message {i} (assistant) holds a trace in its content ({opening}…{closing}) and another "
                           "in its reasoning field; the template would write both: give the turn's trace once",
                           "two_traces")
        out.append({**message, "content": content[end + len(closing):].lstrip(),
                    **({} if field else {"reasoning_content": trace})})
    return same_kind(messages, out)
