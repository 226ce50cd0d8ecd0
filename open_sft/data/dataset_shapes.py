"""Popular datasets' own row shapes, read as the messages rows they mean: --dataset_format auto knows each by its
columns (`shape_of`), and `messages_row` gives the row's conversation (and tools) as a `messages` row does.

- xlam: Salesforce/xlam-function-calling-60k (APIGen): `query`, `answers` (the calls, a JSON string of
  [{name, arguments}]) and `tools` (a JSON string of bare schemas whose `parameters` are JSON Schema's
  `properties`): the user's query, then an assistant turn of those calls, the tools handed to the template (their
  parameters as the object schema `{"type": "object", "properties": …}`, Python's type names as JSON Schema's:
  python_types.py).
- nemotron: nvidia/Llama-Nemotron-Post-Training-Dataset: `input` (the conversation so far, role/content
  messages), `output` (the reply, its trace inline as `<think>…</think>`) and `system_prompt` ("detailed
  thinking on"/"off", the switch the model was trained with), the conversation's system turn.
- openmath: nvidia/OpenMathReasoning: `problem` and `generated_solution` (trace inline).
- s1k: simplescaling/s1K: `question`, `thinking_trajectories` (a list of traces) and `attempt` (the answer):
  the traces, joined by a newline, are the answer's `reasoning_content`; s1K-1.1's `deepseek_thinking_trajectory`
  and `deepseek_attempt` (what s1.1 trained on) likewise.
- openthoughts: OpenThoughts-114k's `metadata` config: `problem`, `deepseek_reasoning` (the trace, the answer's
  `reasoning_content`) and `deepseek_solution` (its default config is sharegpt rows, their traces in the text
  between Sky-T1's `<|begin_of_thought|>` tags, as the dataset's system prompt asks for them).
- problem_solution: `problem` and `solution` (NuminaMath-1.5, MATH): the user's problem, the answer;
  question_answer: `question` and `answer` (GSM8K) likewise. Their other columns may only be metadata
  (`METADATA_COLUMNS`: an id, the source, level, subject, a final answer, ...): any other (a RAG `context`, a
  multiple choice's `choices`) may be what the answer depends on, and the row, read as these two, would drop it
  (`unread_columns`; detection refuses such a source).
- glaive: glaiveai/glaive-function-calling-v2: `system` ("SYSTEM: …" then the tool schemas, JSON objects one after
  another) and `chat`, one string of "USER: ", "ASSISTANT: " and "FUNCTION RESPONSE: " turns three newlines apart,
  each answer closed by a literal `<|endoftext|>` and a call written `<functioncall> {"name": …, "arguments": '…'}`
  (its arguments a JSON object in single quotes): the system text, the schemas as the row's tools, the turns as
  user, assistant (the call a tool call, the `<|endoftext|>` dropped: the template writes its own end of turn)
  and tool messages.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Optional

from open_sft.data.python_types import json_schema_types
from open_sft.data.row_error import RowError

# the key of a converted row (messages_row) saying its tool schemas' Python type names were mapped (xLAM's)
TYPES_MAPPED = "tool_types_mapped"


def decoded_list(value: Any) -> Any:
    """A column that holds a list, decoded where the dataset stores it as a JSON string (Toucan-1.5M's `messages`,
    xLAM's `answers`: a parquet column of type string); anything else as it is (the caller's to refuse)."""
    if not isinstance(value, str) or not value.lstrip().startswith("["):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def json_error(value: Any) -> str:
    """Why a column that looks like a JSON list (a string opening with "[") is not one, with the position
    (" (not JSON: Expecting ',' delimiter: line 1 column 9 (char 8))"), for the refusal of what decoded_list left as
    it was; "" for anything else."""
    if not isinstance(value, str) or not value.lstrip().startswith("["):
        return ""
    try:
        json.loads(value)
    except ValueError as exc:
        return f" (not JSON: {exc})"
    return ""


def _text(row: dict[str, Any], column: str, shape: str) -> str:
    value = row.get(column)
    if not isinstance(value, str):
        raise RowError(f"{shape} row needs a string {column!r}, got {type(value).__name__}", "missing_field")
    return value


def _xlam(row: dict[str, Any]) -> dict[str, Any]:
    calls = decoded_list(row.get("answers"))
    if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
        raise RowError("xLAM row's 'answers' must be a list of {name, arguments} calls, or that list as a JSON "
                       f"string{json_error(row.get('answers'))}", "bad_tool_calls")
    if not calls:
        raise RowError("xLAM row's 'answers' is empty: the row has no call to train (an irrelevance row needs "
                       "the reply the model should give instead; convert it to a messages row)", "empty_assistant")
    tool_calls = [{"type": "function", "function": {"name": c["name"], "arguments": c.get("arguments", {})}}
                  for c in calls]
    tools, mapped = _xlam_schemas(row.get("tools"))
    return {"tools": tools, TYPES_MAPPED: mapped, "messages": [
        {"role": "user", "content": _text(row, "query", "xLAM")},
        {"role": "assistant", "content": "", "tool_calls": tool_calls}]}


def _xlam_schemas(tools: Any) -> tuple[Any, bool]:
    """xLAM's tool schemas, each `parameters` (JSON Schema's `properties`, as xLAM writes them: {name: {type,
    description, default}}) within the object schema templates read (gpt-oss's writes a tool's arguments from its
    `properties` and, without them, none), their Python type names as JSON Schema's (python_types.py), and whether
    any was mapped; anything else as it is (formats.row_tools checks it)."""
    tools = decoded_list(tools)
    if not isinstance(tools, list):
        return tools, False
    schemas, mapped = [], False
    for tool in tools:
        if isinstance(tool, dict) and isinstance(tool.get("parameters"), dict) and \
                tool["parameters"].get("type") != "object":
            properties, required, changed = json_schema_types(tool["parameters"])
            tool = {**tool, "parameters": {"type": "object", "properties": properties,
                                           **({"required": required} if changed and required else {})}}
            mapped |= changed
        schemas.append(tool)
    return schemas, mapped


def _nemotron(row: dict[str, Any]) -> dict[str, Any]:
    turns = decoded_list(row.get("input"))
    if not isinstance(turns, list) or not turns:
        raise RowError(f"Nemotron row's 'input' is a {type(turns).__name__}; this shape needs the conversation "
                       "so far as a non-empty list of role/content messages (or that list as a JSON string); convert "
                       "the row to messages (a plain prompt: one user turn; one written in a chat template's "
                       f"text: the turns it writes){json_error(turns)}", "missing_messages")
    messages = [*turns, {"role": "assistant", "content": _text(row, "output", "Nemotron")}]
    system = row.get("system_prompt")
    opens = isinstance(turns[0], dict) and turns[0].get("role") in ("system", "developer")
    if isinstance(system, str) and system.strip() and not opens:
        messages.insert(0, {"role": "system", "content": system})
    return {"tools": row.get("tools"), "messages": messages}


def _openmath(row: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": _text(row, "problem", "OpenMathReasoning")},
                         {"role": "assistant", "content": _text(row, "generated_solution", "OpenMathReasoning")}]}


def _openthoughts(row: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": _text(row, "problem", "OpenThoughts")},
                         {"role": "assistant", "content": _text(row, "deepseek_solution", "OpenThoughts"),
                          "reasoning_content": _text(row, "deepseek_reasoning", "OpenThoughts")}]}


def _problem_solution(row: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": _text(row, "problem", "problem/solution")},
                         {"role": "assistant", "content": _text(row, "solution", "problem/solution")}]}


def _question_answer(row: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": _text(row, "question", "question/answer")},
                         {"role": "assistant", "content": _text(row, "answer", "question/answer")}]}


def _s1k(row: dict[str, Any]) -> dict[str, Any]:
    columns = next(columns for columns in SHAPES["s1k"][0] if columns <= row.keys())  # as shape_of matched them
    trace, answer = ("thinking_trajectories", "attempt") if "attempt" in columns else (
        "deepseek_thinking_trajectory", "deepseek_attempt")
    traces = row.get(trace)
    traces = [traces] if isinstance(traces, str) else traces
    if not isinstance(traces, list) or not all(isinstance(t, str) for t in traces):
        raise RowError(f"s1K row's {trace!r} must be a list of strings (the traces)", "bad_content_type")
    return {"messages": [{"role": "user", "content": _text(row, "question", "s1K")},
                         {"role": "assistant", "content": _text(row, answer, "s1K"),
                          "reasoning_content": "\n".join(traces)}]}


GLAIVE_TURN = re.compile(r"(?:^|\n\n\n)(USER|ASSISTANT|FUNCTION RESPONSE): ")
GLAIVE_ROLES = {"USER": "user", "ASSISTANT": "assistant", "FUNCTION RESPONSE": "tool"}
GLAIVE_CALL = re.compile(r'\{"name":\s*"([^"]+)",\s*"arguments":\s*\'(.*)\'\s*\}', re.DOTALL)


def _glaive(row: dict[str, Any]) -> dict[str, Any]:
    system, tools = _glaive_system(_text(row, "system", "glaive"))
    parts = GLAIVE_TURN.split(_text(row, "chat", "glaive"))
    if parts[0].strip() or len(parts) < 3:
        raise RowError("glaive row's 'chat' must be turns opened by 'USER: ', 'ASSISTANT: ' or 'FUNCTION RESPONSE: ', "
                       "three newlines apart", "missing_messages")
    messages = [{"role": "system", "content": system}] if system else []
    for speaker, text in zip(parts[1::2], parts[2::2]):
        text = text.strip().removesuffix("<|endoftext|>").rstrip()
        messages.append(_glaive_answer(text) if speaker == "ASSISTANT" else
                        {"role": GLAIVE_ROLES[speaker], "content": text})
    if tools is None and any("tool_calls" in message for message in messages):
        raise RowError("glaive row calls a tool but its 'system' text holds no tool schemas (JSON objects one after "
                       "another after the prompt): its calls would train with no tools given", "bad_tools")
    return {"tools": tools, "messages": messages}


def _glaive_system(text: str) -> tuple[str, Optional[list]]:
    """The system prompt without its "SYSTEM: " and the tool schemas written after it (None where it has none, or
    where they are not JSON objects one after another: the text is then the prompt as written)."""
    text = text.removeprefix("SYSTEM:").strip()
    start = text.find("{")
    if start < 0:
        return text, None
    schemas, decoder, position = [], json.JSONDecoder(), start
    while position < len(text):
        try:
            schema, end = decoder.raw_decode(text, position)
        except ValueError:
            return text, None
        schemas.append(schema)
        position = end + len(text[end:]) - len(text[end:].lstrip())  # past the whitespace between schemas
    if not all(isinstance(schema, dict) for schema in schemas):
        return text, None
    return text[:start].strip(), schemas


def _glaive_answer(text: str) -> dict[str, Any]:
    """An assistant turn; its `<functioncall> {...}` (what follows the tag) the turn's tool call."""
    content, tag, call = text.partition("<functioncall>")
    if not tag:
        return {"role": "assistant", "content": text}
    call = call.strip()
    try:
        parsed = json.loads(call)
        name, arguments = parsed["name"], parsed.get("arguments", {})
    except (ValueError, TypeError, KeyError):
        match = GLAIVE_CALL.fullmatch(call)
        if not match:
            raise RowError(f"glaive row's call {call[:80]!r} is not {{\"name\": …, \"arguments\": '…'}}",
                           "bad_tool_calls") from None
        name, arguments = match.groups()
    return {"role": "assistant", "content": content.strip(),
            "tool_calls": [{"type": "function", "function": {"name": _glaive_name(name, call),
                                                             "arguments": _glaive_arguments(arguments, call)}}]}


def _glaive_name(name: Any, call: str) -> str:
    if not isinstance(name, str) or not name:
        raise RowError(f"glaive row's call {call[:80]!r} has a name of type {type(name).__name__}; a call's name is "
                       "a non-empty string", "bad_tool_calls")
    return name


def _glaive_arguments(arguments: Any, call: str) -> dict:
    """A call's arguments: a JSON object, or one written as a string (glaive's single-quoted text)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError as exc:
            raise RowError(f"glaive row's call {call[:80]!r} has arguments that are not JSON ({exc})",
                           "bad_tool_calls") from None
    if not isinstance(arguments, dict):
        raise RowError(f"glaive row's call {call[:80]!r} has arguments of type {type(arguments).__name__}; a call's "
                       "arguments are a JSON object", "bad_tool_calls")
    return arguments


# format name: (the column sets, any of which names the shape; the converter to a messages row)
SHAPES: dict[str, tuple[tuple[frozenset, ...], Callable[[dict[str, Any]], dict[str, Any]]]] = {
    "xlam": ((frozenset({"query", "answers", "tools"}),), _xlam),
    "nemotron": ((frozenset({"input", "output", "system_prompt"}),), _nemotron),
    "openmath": ((frozenset({"problem", "generated_solution"}),), _openmath),
    "s1k": ((frozenset({"question", "thinking_trajectories", "attempt"}),
             frozenset({"question", "deepseek_thinking_trajectory", "deepseek_attempt"})), _s1k),
    "glaive": ((frozenset({"system", "chat"}),), _glaive),
    "openthoughts": ((frozenset({"problem", "deepseek_reasoning", "deepseek_solution"}),), _openthoughts),
    # after those with more columns
    "problem_solution": ((frozenset({"problem", "solution"}),), _problem_solution),
    "question_answer": ((frozenset({"question", "answer"}),), _question_answer),
}


# Columns that describe a problem_solution or question_answer row rather than say what its answer answers (an id,
# where it comes from, how hard, its topic, a final answer the solution also writes, a validity flag): NuminaMath-1.5's,
# MATH's, MATH-500's and GSM8K's. An allowlist, not a list of the columns an answer may depend on: a column that is
# not known cannot be known to be safe to drop (context, passage, choices, options, input, system, table, ...).
METADATA_COLUMNS = frozenset({
    "id", "uuid", "idx", "index", "unique_id", "source", "url", "license", "language", "split", "level", "difficulty",
    "type", "problem_type", "question_type", "subject", "topic", "category", "domain", "tags", "metadata",
    "synthetic", "problem_is_valid", "solution_is_valid", "answer", "final_answer", "expected_answer"})
GENERIC_SHAPES = ("problem_solution", "question_answer")


def unread_columns(row: dict[str, Any], shape: str) -> list[str]:
    """The columns of a generic shape's row (GENERIC_SHAPES) beyond its own two and METADATA_COLUMNS, which reading
    it would drop; [] for the other shapes (each is its dataset's columns, their metadata known)."""
    if shape not in GENERIC_SHAPES:
        return []
    own = SHAPES[shape][0][0]
    return sorted(column for column in row if column not in own and column not in METADATA_COLUMNS)


# a shape's columns whose value must be of a type for a row to be that shape: a glaive `chat` that is a list is some
# other dataset's conversation (read as messages with --sft_messages_key chat), not glaive's one string of turns
SHAPE_TYPES: dict[str, dict[str, type]] = {"glaive": {"system": str, "chat": str}}


def shape_of(row: dict[str, Any]) -> Optional[str]:
    """The name of the dataset shape whose columns the row has (of the types SHAPE_TYPES names), or None."""
    for name, (column_sets, _) in SHAPES.items():
        if any(columns <= row.keys() for columns in column_sets) and all(
                isinstance(row[column], kind) for column, kind in SHAPE_TYPES.get(name, {}).items()):
            return name
    return None


def messages_row(row: dict[str, Any], shape: str) -> dict[str, Any]:
    """The row as a messages row: its conversation under `messages`, its tools (where it has any) under `tools`."""
    return SHAPES[shape][1](row)
