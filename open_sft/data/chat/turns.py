"""Small helpers for locating assistant turns in a rendering: where the last special token ends, what a
template writes between an answer and the message after it, prefix renders, the names of a turn's tool calls."""

from __future__ import annotations

import json
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


def prefix_renders(draw: Any, messages: Messages, tools: Optional[list], text: str, i: int
                   ) -> tuple[Optional[str], str]:
    """The renderings of the messages before message i, with the generation prompt (None for the first
    message: apply_chat_template refuses an empty conversation), and of the messages through it (the
    row's `text` itself when it is the last)."""
    prompt = draw(messages[:i], True, tools) if i else None
    return prompt, text if i == len(messages) - 1 else draw(messages[: i + 1], False, tools)


def call_written(message: dict, text: str) -> list[str]:
    """The tool calls of `message` that `text` does not write: named by function, each with its arguments'
    top-level values (strings as they are or JSON-escaped, other values as JSON), so that of two parallel calls
    of one function, a template that writes only the first (gpt-oss's) is caught."""
    missing = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", call)
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            continue
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                arguments = {"": arguments}
        values = arguments.values() if isinstance(arguments, dict) else []
        forms = [(value, json.dumps(value, ensure_ascii=False)[1:-1]) if isinstance(value, str)
                 else (json.dumps(value, ensure_ascii=False),) for value in values]
        if function["name"] not in text or not all(any(form in text for form in pair) for pair in forms):
            missing.append(function["name"])
    return missing
