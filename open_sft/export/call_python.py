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
import warnings
from dataclasses import replace
from typing import Any, Optional

from open_sft.export.call_objects import NOTATION_PROBE
from open_sft.export.call_pairs import PROBE_ARGUMENTS
from open_sft.export.call_probe import PROBE_NAME

_ESCAPED = "probe \\d 'quoted' \"both\""  # a backslash and both quotes: written raw, or escaped
ESCAPE_PROBE = {"probe_key_1": _ESCAPED}
_NOT_READ = (SyntaxError, ValueError, TypeError, RecursionError, MemoryError)  # what ast raises on what it cannot read


def probe_python(text: str, name_at: int) -> Optional[tuple[int, bool, int]]:
    """(where the probe call's Python expression starts in the rendered reply `text`, whether it is a list of calls,
    where it ends), the probe's name being at `name_at`; None where no Python call reading back as the probe's name
    and arguments is written there."""
    if not text.startswith("(", name_at + len(PROBE_NAME)):
        return None
    return _probe_call(text, name_at, PROBE_ARGUMENTS, raw=False)


def checked_python(tokenizer, form, parts: dict) -> Optional[dict]:
    """A python layout's parts with how the template writes a string (`raw_strings`: between its quotes as it is, a
    backslash or quote in it not escaped, as LFM2's does), read off its rendering of ESCAPE_PROBE's, and checked on
    its rendering of the probe of every JSON kind; None where either does not read back."""
    rendered = replace(form, arguments=ESCAPE_PROBE).reply(tokenizer)
    if _reads_back(rendered, ESCAPE_PROBE, raw=False):
        raw = False
    elif rendered is not None and any(quote + _ESCAPED + quote in rendered for quote in "'\""):
        raw = True
    else:
        return None
    if not _reads_back(replace(form, arguments=NOTATION_PROBE).reply(tokenizer), NOTATION_PROBE, raw):
        return None
    return {**parts, "raw_strings": raw}


def _reads_back(text: Optional[str], arguments: dict, raw: bool) -> bool:
    """Whether the template's rendering of the probe call holding `arguments` (`text`, None where it fails) reads back
    as exactly that call."""
    name_at = text.find(PROBE_NAME) if text is not None else -1
    return name_at >= 0 and _probe_call(text, name_at, arguments, raw) is not None


def _probe_call(text: str, name_at: int, arguments: dict, raw: bool) -> Optional[tuple[int, bool, int]]:
    """(where the Python expression holding the probe call named at `name_at` starts, whether it is a list of calls,
    where it ends), None where its first call does not read back as the probe's name with `arguments`."""
    start, listed = _expression_start(text, name_at)
    read = read_python(text[start:], listed, raw)
    if read is None or read[0][0] != {"name": PROBE_NAME, "arguments": arguments}:
        return None
    return start, listed, start + read[1]


def _expression_start(text: str, name_at: int) -> tuple[int, bool]:
    """(where the Python expression holding the call named at `name_at` starts, whether it is a list of calls)."""
    before = text[:name_at].rstrip()
    listed = before.endswith("[")
    return (len(before) - 1 if listed else name_at), listed


def read_python(segment: str, listed: bool, raw: bool = False) -> Optional[tuple[list[dict], int]]:
    """(the calls, each {name, arguments}, of the Python expression `segment` starts with: a list of calls where
    `listed`, else one call; where it ends), None where it holds none that reads (cut off, not Python, module doc;
    where the template writes strings `raw`, a string it cannot have written so)."""
    lead = len(segment) - len(segment.lstrip())
    if not segment.startswith("[" if listed else "", lead):
        return None
    close = "]" if listed else ")"
    at = segment.find(close, lead)
    while at >= 0:  # the expression ends at the first closing bracket that completes it
        try:
            with warnings.catch_warnings():  # a model's `'\\d'`: Python warns of the escape it does not know
                warnings.simplefilter("ignore", (SyntaxWarning, DeprecationWarning))
                tree = ast.parse(segment[lead:at + 1], mode="eval")
        except _NOT_READ:
            at = segment.find(close, at + 1)
            continue
        source = segment[lead:at + 1]
        calls = [_call(node, source, raw) for node in (tree.body.elts if listed and isinstance(tree.body, ast.List) else
                                         [tree.body] if not listed else [])]
        return (calls, at + 1) if calls and all(call is not None for call in calls) else None
    return None


def _call(node: ast.AST, source: str, raw: bool) -> Optional[dict]:
    """{name, arguments} of a call node with keyword arguments of JSON kinds only, each string as a template writing
    strings `raw` writes one if so (_raw_written); None for anything else."""
    if not isinstance(node, ast.Call) or node.args:
        return None
    name, keys = _dotted(node.func), [keyword.arg for keyword in node.keywords]
    if name is None or None in keys or len(set(keys)) < len(keys):
        return None  # `**kwargs`, or a keyword given twice
    try:
        arguments = {keyword.arg: ast.literal_eval(keyword.value) for keyword in node.keywords}
    except _NOT_READ:
        return None
    if raw and not all(_raw_written(keyword.value, source) for keyword in node.keywords):
        return None
    return {"name": name, "arguments": arguments} if _json_kind(arguments) else None


def _raw_written(node: ast.AST, source: str) -> bool:
    """Whether every string in the value `node` of `source` is written as a template writing strings raw writes it:
    its text between one quote each side, no backslash (Python reads `'\\bfoo'` as a backspace and `foo`, where the
    template wrote a backslash and `bfoo`), no prefix, no triple quote, no second string joined to it."""
    for item in ast.walk(node):
        if isinstance(item, ast.Constant) and isinstance(item.value, str):
            written = ast.get_source_segment(source, item) or ""
            if "\\" in written or written[1:-1] != item.value or written[:1] != written[-1:]:
                return False
    return True


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
