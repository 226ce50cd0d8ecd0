"""Tool-call arguments in the form the chat template takes. A row's JSON-string arguments are handed over as the
object (formats._with_object_arguments: most templates write them with `tojson`); a template that writes them by
string concatenation (DeepSeek-R1's distills and V3's: '```json\\n' + arguments) fails on the object, and gets the
arguments as a string, as the row gave it (objects given as objects: their JSON). Decided once per template. And
tool results that carry the tags the template writes around them (`wrapped_twice`)."""

from __future__ import annotations

import json
import logging
import re

from open_sft.data.chat.probes import PROBE_ARGUMENTS, PROBE_TOOLS, PROBE_USER, probe_call
from open_sft.data.chat.render import TemplateState
from open_sft.data.formats import JsonArguments, Messages, RowError, same_kind
from open_sft.data.tool_schemas import function_of

logger = logging.getLogger(__name__)

_SAID: set[str] = set()  # the templates the log has named so (once each, not once per worker or source)


def takes_string_arguments(state: TemplateState) -> bool:
    """Whether the template renders a tool call whose arguments are a string and fails on the same as an object, or
    writes the object as Python's repr (`arguments|string`, Apriel-1.5's: `{'a': 17, 'b': 25}`, no JSON) and the
    string as given (asked once per template state; workers.label_rows asks before forking, so the workers inherit
    the answer)."""
    if state.string_arguments is None:
        arguments = PROBE_ARGUMENTS
        as_object, as_string = _written(state, arguments), _written(state, json.dumps(arguments))
        state.string_arguments = as_string is not None and json.dumps(arguments) in as_string and (
            as_object is None or str(arguments) in as_object)
        if state.string_arguments and state.source not in _SAID:
            _SAID.add(state.source)
            logger.info("the chat template writes tool-call arguments %s: they are handed to it as strings, as each "
                        "row gave them", "by string concatenation (it fails on an object)" if as_object is None else
                        "with |string (an object as Python's repr, not JSON)")
    return state.string_arguments


def _written(state: TemplateState, arguments) -> str | None:
    try:
        return state.draw([PROBE_USER, probe_call(arguments)], False, PROBE_TOOLS)
    except RowError:
        return None


def as_template_takes(state: TemplateState, messages: Messages) -> Messages:
    """The messages with their tool calls' arguments as the template takes them: unchanged, or as strings."""
    if not any(m.get("tool_calls") for m in messages) or not takes_string_arguments(state):
        return messages
    return same_kind(messages, ({**m, "tool_calls": [_with_string_arguments(c) for c in m["tool_calls"]]}
                                if m.get("tool_calls") else m for m in messages))


def _with_string_arguments(call):
    function = call.get("function") if isinstance(call, dict) else None
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if not isinstance(arguments, dict):
        return call
    text = arguments.text if isinstance(arguments, JsonArguments) else json.dumps(arguments, ensure_ascii=False)
    return {**call, "function": {**function, "arguments": text}}


_OPENING = re.compile(r"<([A-Za-z_][\w-]*)>")


def wrapped_twice(messages: Messages, texts: list[str]) -> bool:
    """Whether a tool result that carries its own tags (Hermes-style rows: `<tool_response>\n{...}\n</tool_response>`)
    is written inside the same tags again by the template (Qwen3's and GLM's wrap every tool message): a context
    the model never sees at inference."""
    for message in messages:
        content = message.get("content")
        if message["role"] != "tool" or not isinstance(content, str):
            continue
        content = content.strip()
        tag = _OPENING.match(content)
        if tag and content.endswith(f"</{tag.group(1)}>") and any(
                text[:at].rstrip().endswith(tag.group()) for text in texts if (at := text.find(content)) >= 0):
            return True
    return False


def string_arguments(messages: Messages) -> bool:
    """Whether a tool call's arguments are still a string: the conversion (formats._with_object_arguments) made
    every JSON object string an object, so what is left is not JSON (a Python dict's repr, cut-off JSON) and the
    model learns to call tools with it."""
    return any(isinstance(call, dict) and isinstance(call.get("function"), dict)
               and isinstance(call["function"].get("arguments"), str)
               for message in messages for call in message.get("tool_calls") or ())


def tools_written(tools: list, text: str) -> bool:
    """Whether the rendering holds the row's tool schemas (each tool's name, as every tool-writing template
    writes it): a template without tools (chatml, tulu) trains the row with no schemas in its context."""
    names = [function_of(tool).get("name") for tool in tools]
    return all(name in text for name in names if isinstance(name, str) and name)
