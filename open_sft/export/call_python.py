"""Tool calls written as Python calls (the `python` layout of open_sft.export.tool_calls: LFM2's
`<|tool_call_start|>[get_weather(city='Bern', days=3)]<|tool_call_end|>`), read with Python's own parser (ast).

A call is a name (dotted names too) with keyword arguments only, each a literal (ast.literal_eval) of a JSON kind: a
string, a number, True/False/None, a list, a dict with string keys. Anything else (a positional argument, a name or
an expression as a value, a tuple, a set, bytes, `**kwargs`, a keyword given twice, JSON's `true` inside a dict) does
not read, and the reply is an unreadable call, never a call made up from it. The layout is read off the template's
rendering of the probe call (its name followed by `(`, alone or inside the `[...]` list LFM2 writes) and checked on
its rendering of a probe call holding a value of each JSON kind (call_objects.NOTATION_PROBE), which must read back
exactly: a template that writes them otherwise has no such layout, and its replies stay text.
"""

from __future__ import annotations

import ast
import math
from typing import Any, Optional

from open_sft.export.call_objects import NOTATION_PROBE
from open_sft.export.call_pairs import PROBE_ARGUMENTS
from open_sft.export.call_probe import PROBE_NAME

_NOT_READ = (SyntaxError, ValueError, TypeError, RecursionError, MemoryError)  # what ast raises on what it cannot read


def probe_python(text: str, name_at: int) -> Optional[tuple[int, bool, int]]:
    """(where the probe call's Python expression starts in the rendered reply `text`, whether it is a list of calls,
    where it ends), the probe's name being at `name_at`; None where no Python call reading back as the probe's name
    and arguments is written there."""
    if not text.startswith("(", name_at + len(PROBE_NAME)):
        return None
    before = text[:name_at].rstrip()
    listed = before.endswith("[")
    start = len(before) - 1 if listed else name_at
    read = read_python(text[start:], listed)
    if read is None or read[0][0] != {"name": PROBE_NAME, "arguments": PROBE_ARGUMENTS}:
        return None
    return start, listed, start + read[1]


def reads_every_kind(text: Optional[str]) -> bool:
    """Whether the template's rendering of the probe call holding a value of each JSON kind (`text`, None where it
    fails) reads back as exactly that call."""
    name_at = text.find(PROBE_NAME) if text is not None else -1
    before = text[:max(name_at, 0)].rstrip()
    listed = before.endswith("[")
    read = read_python(text[len(before) - 1 if listed else name_at:], listed) if name_at >= 0 else None
    return read is not None and read[0][0] == {"name": PROBE_NAME, "arguments": NOTATION_PROBE}


def read_python(segment: str, listed: bool) -> Optional[tuple[list[dict], int]]:
    """(the calls, each {name, arguments}, of the Python expression `segment` starts with: a list of calls where
    `listed`, else one call; where it ends), None where it holds none that reads (cut off, not Python, module doc)."""
    lead = len(segment) - len(segment.lstrip())
    if not segment.startswith("[" if listed else "", lead):
        return None
    close = "]" if listed else ")"
    at = segment.find(close, lead)
    while at >= 0:  # the expression ends at the first closing bracket that completes it
        try:
            tree = ast.parse(segment[lead:at + 1], mode="eval")
        except _NOT_READ:
            at = segment.find(close, at + 1)
            continue
        calls = [_call(node) for node in (tree.body.elts if listed and isinstance(tree.body, ast.List) else
                                         [tree.body] if not listed else [])]
        return (calls, at + 1) if calls and all(call is not None for call in calls) else None
    return None


def _call(node: ast.AST) -> Optional[dict]:
    """{name, arguments} of a call node with keyword arguments of JSON kinds only; None for anything else."""
    if not isinstance(node, ast.Call) or node.args:
        return None
    name, keys = _dotted(node.func), [keyword.arg for keyword in node.keywords]
    if name is None or None in keys or len(set(keys)) < len(keys):
        return None  # `**kwargs`, or a keyword given twice
    try:
        arguments = {keyword.arg: ast.literal_eval(keyword.value) for keyword in node.keywords}
    except _NOT_READ:
        return None
    return {"name": name, "arguments": arguments} if _json_kind(arguments) else None


def _dotted(node: ast.AST) -> Optional[str]:
    """`get_weather`, `functions.get_weather`: the name a call node calls; None where it calls no name."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and (owner := _dotted(node.value)) is not None:
        return f"{owner}.{node.attr}"
    return None


def _json_kind(value: Any) -> bool:
    """Whether `value` is a JSON value as Python holds it (no tuple, set, bytes, complex, NaN or infinity)."""
    if value is None or isinstance(value, (str, bool, int)):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_json_kind(item) for item in value)
    return isinstance(value, dict) and all(isinstance(key, str) and _json_kind(item) for key, item in value.items())
