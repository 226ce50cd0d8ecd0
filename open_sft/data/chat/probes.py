"""The probe conversation pieces rendered through a chat template to read how it writes turns: where they end
(turn_enders.py), how it takes a call's arguments (tool_arguments.py), whether it writes call ids (call_ids.py) and
how it writes a trace (emptied_trace.py). One user message, one tool that adds two numbers, a call of it, its result."""

from __future__ import annotations

from typing import Any

PROBE_USER = {"role": "user", "content": "Hi"}
PROBE_ARGUMENTS = {"a": 17, "b": 25}
PROBE_TOOLS = [{"type": "function", "function": {
    "name": "probe_add", "description": "Add two numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                   "required": ["a", "b"]}}}]


def probe_call(arguments: Any = None, call_id: str = "call_0", **fields: Any) -> dict:
    """An assistant message calling the probe tool (`arguments` as given: an object or a JSON string), with `fields`
    (a trace: reasoning_content)."""
    function = {"name": "probe_add", "arguments": PROBE_ARGUMENTS if arguments is None else arguments}
    return {"role": "assistant", "content": "", **fields,
            "tool_calls": [{"id": call_id, "type": "function", "function": function}]}


def probe_result(call_id: str = "call_0") -> dict:
    """The probe call's result."""
    return {"role": "tool", "content": "42", "tool_call_id": call_id, "name": "probe_add"}
