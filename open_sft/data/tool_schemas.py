"""A tool schema as rows, --tools files and templates carry it: an OpenAI tool object `{"type": "function",
"function": {"name", "description", "parameters"}}`, or that function object bare (LLaMA-Factory's sharegpt tools,
OpenAI's legacy `functions`; row_tools, below, wraps it). A tool call has the same two forms (`{"id", "type":
"function", "function": {"name", "arguments"}}`, or `{"name", "arguments"}`)."""

from __future__ import annotations

import json
from typing import Any, Optional

from open_sft.data.row_error import RowError


def function_of(entry: Any) -> Any:
    """The function object of a tool schema or a tool call: its `function` where that is an object, else the entry
    itself (a bare one, or not an object: the caller's to refuse)."""
    return entry["function"] if isinstance(entry, dict) and isinstance(entry.get("function"), dict) else entry


def row_tools(row: dict[str, Any]) -> Optional[list]:
    """The `tools` column (and OpenAI's legacy `functions`, bare schemas): a list of tool schemas (objects), or
    that list as a JSON string (as sharegpt files and parquet columns often carry it); absent, null or empty
    means no tools."""
    tools = _schemas(row, "tools") + _legacy_functions(row)
    if not tools:
        return None
    # a bare schema {name, description, parameters} (LLaMA-Factory's sharegpt tools, OpenAI's older `functions`)
    # in the {type: function, function: ...} form templates read (gpt-oss's refuses a bare one), as LLaMA-Factory
    # wraps it
    return [tool if "function" in tool or "name" not in tool else {"type": "function", "function": tool}
            for tool in tools]


def _schemas(row: dict[str, Any], column: str) -> list:
    schemas = row.get(column)
    if isinstance(schemas, str):
        try:
            schemas = json.loads(schemas) if schemas.strip() else None
        except ValueError as exc:
            raise RowError(f"{column!r} is a string but not JSON ({exc}); give a list of tool schemas", "bad_tools")
    if schemas is None:
        return []
    if isinstance(schemas, list):  # each schema a JSON string of its own (When2Call's tools, a list<string> column)
        schemas = [_json_object(schema) if isinstance(schema, str) else schema for schema in schemas]
    if not isinstance(schemas, list) or not all(isinstance(schema, dict) for schema in schemas):
        raise RowError(f"{column!r} must be a list of tool schemas (JSON objects, or each such object as a JSON "
                       "string)", "bad_tools")
    return schemas


def _json_object(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _legacy_functions(row: dict[str, Any]) -> list:
    """OpenAI's legacy `functions` column, where it is that (a list of schema objects, or that list as JSON): a column
    of that name in another shape is some other dataset's, not read (as before open_sft read this one)."""
    try:
        return _schemas(row, "functions")
    except RowError:
        return []


def listed_in_system(tools: list, messages: list) -> bool:
    """Whether a system (or developer) message already lists every one of the row's tool schemas, its name and its
    description as JSON strings, quoted, as a JSON list of them writes them (Hermes-style rows: `<tools>[…]</tools>`
    in the system prompt, the same schemas in a `tools` column): a template that writes the tools column too shows
    the model every tool twice, as it never sees them at inference. A prompt that only names a tool ("Always search
    first") lists nothing."""
    def listed(tool: Any, text: str) -> bool:
        function = function_of(tool)
        name, description = (function.get("name"), function.get("description")) if isinstance(function, dict) \
            else (None, None)
        return isinstance(name, str) and _in_json(name, text) and (
            not isinstance(description, str) or _in_json(description, text))

    return any(message.get("role") in ("system", "developer") and isinstance(message.get("content"), str)
               and all(listed(tool, message["content"]) for tool in tools) for message in messages)


def _in_json(value: str, text: str) -> bool:
    """Whether `text` holds `value` as a JSON string, quoted (its non-ASCII characters escaped or not)."""
    return json.dumps(value) in text or json.dumps(value, ensure_ascii=False) in text
