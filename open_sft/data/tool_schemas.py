"""A tool schema as rows, --tools files and templates carry it: an OpenAI tool object `{"type": "function",
"function": {"name", "description", "parameters"}}`, or that function object bare (LLaMA-Factory's sharegpt tools,
OpenAI's legacy `functions`; formats.row_tools wraps it). A tool call has the same two forms (`{"id", "type":
"function", "function": {"name", "arguments"}}`, or `{"name", "arguments"}`)."""

from __future__ import annotations

from typing import Any


def function_of(entry: Any) -> Any:
    """The function object of a tool schema or a tool call: its `function` where that is an object, else the entry
    itself (a bare one, or not an object: the caller's to refuse)."""
    return entry["function"] if isinstance(entry, dict) and isinstance(entry.get("function"), dict) else entry
