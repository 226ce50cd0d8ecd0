"""The trained span of an assistant turn that carries more than a content.

An assistant message with tool calls (OpenAI's `tool_calls`, often with an empty content) or a
reasoning trace (`reasoning_content`) is written by the chat template from those fields: the tool-call
JSON or the think block is text the model must learn to write, and it is not in the content, so the
content cannot locate the turn (render.py's way). Such a turn trains everything the template writes
for it after its header: from the end of the generation prompt of the messages before it through its
end of turn.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from open_sft.data.formats import Messages, RowError

_PROBE = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}]


def last_marker_end(text: str, markers: tuple[str, ...]) -> int:
    """Where the last special-token marker in `text` ends (0: none)."""
    return max((text.rfind(marker) + len(marker) for marker in markers if marker in text), default=0)


def middle_closing(state: Any, markers: tuple[str, ...]) -> str:
    """What the template writes right after an assistant content that is not the last message, through
    its first special token ("<|im_end|>" for OLMo's template, which closes only the last turn with eos;
    "" for one that writes no special token between turns, such as simple_chat). Rendering the
    conversation through that turn shows only how the last turn is closed."""
    if markers not in state.middle_closings:
        closing = ""
        try:
            text = state.draw(_PROBE + [{"role": "user", "content": "Bye now"}], False, None)
            after = text.index("Hello there") + len("Hello there")
            between = text[after: text.index("Bye now", after)]
            firsts = [(between.find(marker), -len(marker)) for marker in markers if marker in between]
            if firsts:
                at, minus_length = min(firsts)
                closing = between[: at - minus_length]
        except (RowError, ValueError):
            pass
        state.middle_closings[markers] = closing
    return state.middle_closings[markers]


def _closers(state: Any, markers: tuple[str, ...]) -> tuple[str, ...]:
    """The special tokens the template ends an assistant turn with (<|im_end|>, <|eot_id|>, Phi-3's
    <|end|> and eos): those it writes after an assistant content, as the last message or before another.
    All markers when the probe fails."""
    if markers not in state.closers:
        try:
            text = state.draw(_PROBE, False, None)
            suffix = text[text.index("Hello there") + len("Hello there"):]
            found = [marker for marker in markers if marker in suffix[: last_marker_end(suffix, markers)]]
        except (RowError, ValueError):
            found = []
        found += [marker for marker in markers if middle_closing(state, markers).endswith(marker) and marker not in found]
        state.closers[markers] = tuple(found) or markers
    return state.closers[markers]


def prefix_renders(draw: Any, messages: Messages, tools: Optional[list], text: str, i: int
                   ) -> tuple[Optional[str], str]:
    """The renderings of the messages before message i, with the generation prompt (None for the first
    message: apply_chat_template refuses an empty conversation), and of the messages through it (the
    row's `text` itself when it is the last)."""
    prompt = draw(messages[:i], True, tools) if i else None
    return prompt, text if i == len(messages) - 1 else draw(messages[: i + 1], False, tools)


def _call_names(message: dict) -> list[str]:
    names = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", call)
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            names.append(function["name"])
    return names


def whole_turn_span(state: Any, messages: Messages, tools: Optional[list], text: str, i: int,
                    markers: tuple[str, ...]) -> tuple[int, int]:
    """[start, end) in `text` of what assistant message i's turn writes after its header, through its
    last special token. The turn ends where rendering the messages through it ends, when that is a
    prefix of the text; else (templates that write the final turn differently: Qwen3's think block,
    Phi-3's eos) at the first end-of-turn token after its start. Every tool call's name must be in the
    span: a template that does not write tool calls would otherwise train none of them."""
    where = f"message {i + 1} (assistant, with {'tool calls' if messages[i].get('tool_calls') else 'more than a content'})"
    prompt, through = prefix_renders(state.draw, messages, tools, text, i)
    if prompt is not None and not text.startswith(prompt) and text.startswith(state.draw(messages[:i], False, tools)):
        # a generation prompt that opens more than the turn writes (the thinkers' "<think>"): the turn
        # starts where the two part
        prompt = os.path.commonprefix([prompt, text])
    if prompt is None or not text.startswith(prompt):
        raise RowError(f"{where}: rendering the messages before it with the generation prompt is not a prefix of "
                       "the conversation, so the turn cannot be located; choose another template")
    begin = len(prompt)
    if text.startswith(through):
        finish = len(through)
    else:
        ends = [at + len(closer) for closer in _closers(state, markers) for at in [text.find(closer, begin)] if at >= 0]
        if not ends:
            raise RowError(f"{where}: no end-of-turn token follows it; choose another template")
        finish = min(ends)
    body = text[begin:finish]
    start = begin + len(body) - len(body.lstrip())
    end = begin + (last_marker_end(body, markers) or len(body.rstrip()))
    missing = [name for name in _call_names(messages[i]) if name not in text[start:end]]
    if missing:
        raise RowError(f"{where}: the chat template does not write its tool calls ({', '.join(missing)}); use a "
                       "template that renders tool_calls (the model's own, or --chat_template_path FILE)",
                       "tool_calls_not_rendered")
    if end <= start:
        raise RowError(f"{where}: the chat template writes nothing for this turn; choose another template")
    return start, end
