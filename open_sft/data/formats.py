"""Row formats → one canonical conversation (a list of {"role", "content"} messages), validated.

Each converter is a pure function of one row; `to_messages` adds where the row came from to
every error so the user can find and fix it.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Optional

from open_sft.data.dataset_shapes import SHAPES, TYPES_MAPPED, decoded_list, json_error, messages_row
from open_sft.data.reasoning_fields import reasoning_of
from open_sft.data.row_error import RowError
from open_sft.data.row_template_kwargs import COLUMN as TEMPLATE_KWARGS, row_template_kwargs
from open_sft.data.tool_schemas import row_tools


# environment: OLMo's tool results; developer: OpenAI's newer name of the system turn (gpt-oss's template has both)
ROLES = ("system", "developer", "user", "assistant", "tool", "environment")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "function_call": "assistant", "observation": "tool", "tool": "tool"}

Messages = list[dict[str, str]]


class Conversation(list):
    """A row's messages, plus its tool schemas (the optional `tools` column) for the chat template. A list,
    so it goes wherever messages go; slices are plain lists, so read `tools` before slicing."""

    tools: Optional[list] = None
    # messages before this index never train (a TRL prompt-completion row's prompt: few-shot assistant turns
    # there are context, as TRL trains the completion only)
    first_trained: int = 0
    # a TRL prompt-completion row of two strings: raw text, no chat template (its user turn is the prompt, its
    # assistant turn the completion; open_sft.data.chat.raw_rows.raw_completion)
    raw_text: bool = False
    # the row's own chat template variables (its chat_template_kwargs column: smoltalk2's), over the source's
    template_kwargs: Optional[dict] = None
    tool_types_mapped: bool = False  # its tool schemas' Python type names read as JSON Schema's (xLAM's)


def same_kind(messages: Messages, items: Any) -> Messages:
    """`items` (changed messages) as what `messages` was: a Conversation keeps its tools and marks, a list stays a
    list."""
    if not isinstance(messages, Conversation):
        return list(items)
    copy = Conversation(items)
    copy.__dict__.update(messages.__dict__)
    return copy


def _with_row_system(row: dict[str, Any], messages: Messages) -> Messages:
    """A row's own `system` column (sharegpt's, and beside `messages`) opens the conversation when it has no system
    (or developer) turn of its own."""
    system = row.get("system")
    if isinstance(system, str) and system.strip() and messages[0]["role"] not in ("system", "developer"):
        messages.insert(0, {"role": "system", "content": system})
    return messages


def _from_messages(row: dict[str, Any]) -> Messages:
    if "messages" not in row:
        raise RowError(f"row has no 'messages' (columns: {sorted(row)}); every row of this source needs a "
                       "'messages' list of {role, content}", "missing_messages")
    messages = decoded_list(row["messages"])  # a JSON string of the list too (Toucan-1.5M's parquet column)
    if not isinstance(messages, list) or not messages:
        raise RowError("'messages' must be a non-empty list of {role, content} objects (or that list as a JSON "
                       f"string){json_error(row['messages'])}", "missing_messages")
    out = []
    for i, message in enumerate(messages, start=1):
        if not isinstance(message, dict):
            raise RowError(f"message {i} is a {type(message).__name__}, expected an object with role and content", "bad_message")
        message = _from_legacy_functions(message, i)
        role, content = message.get("role"), message.get("content")
        role = "tool" if role == "ipython" else role  # Llama 3.x's name of a tool result (its template reads both)
        if role not in ROLES:
            raise RowError(f"message {i} has role {role!r}; expected one of {', '.join(ROLES)}", "unknown_role")
        calls = message.get("tool_calls")
        if calls not in (None, []) and (role != "assistant" or not isinstance(calls, list)
                                        or not all(isinstance(call, dict) for call in calls)):
            raise RowError(f"message {i} ({role}) has tool_calls of type {type(calls).__name__}; only assistant "
                           "messages have tool_calls, a list of {type, function: {name, arguments}} objects",
                           "bad_tool_calls")
        if content is None and (calls or message.get("function_calls")):  # a turn that only calls tools
            content = ""
        if isinstance(content, list):
            content, trace = _text_of_parts(content, f"message {i} ({role})", role == "assistant")
            if trace and not reasoning_of(message):  # a field's trace wins; an empty field is none
                message = {**message, "reasoning_content": trace}
        if not isinstance(content, str):
            beside = " (null only beside the turn's tool_calls, or OpenAI's legacy function_call)" \
                if content is None and role == "assistant" else ""
            raise RowError(f"message {i} ({role}) has content of type {type(content).__name__}; expected a string "
                           f"(or a list of text parts){beside}", "bad_content_type")
        # A message of exactly these two keys is used as it is (messages are never changed): a copy per
        # message costs a tenth of the conversion on short rows. Other keys (tool_calls, tool_call_id, name,
        # reasoning_content) go to the chat template as they are, but for empty ones (a column read with
        # Arrow gives every message every key, most of them null).
        if len(message) == 2 and content is message.get("content"):
            out.append(message)
        else:
            out.append({**{key: value for key, value in message.items() if value is not None and value != []},
                        "role": role, "content": content})
            if out[-1].get("tool_calls"):
                out[-1]["tool_calls"] = [_with_object_arguments(call) for call in out[-1]["tool_calls"]]
    return out


def _from_legacy_functions(message: dict, i: int) -> dict:
    """OpenAI's legacy function calling (its chat fine-tuning format before tools): an assistant message's
    `function_call` {name, arguments} is the turn's tool call and a `function` message the call's result (a tool
    message, its `name` kept), as `tool_calls` and `tool` messages reach the chat template; the row's `functions`
    are its tools (`row_tools`). Read, not dropped: the template would write neither, and the row would train the
    turn's content alone, without its call."""
    if message.get("role") == "function":
        return {**message, "role": "tool"}
    call = message.get("function_call")
    if call is None:
        return message
    if message.get("role") != "assistant" or message.get("tool_calls") or not (
            isinstance(call, dict) and isinstance(call.get("name"), str)):
        raise RowError(f"message {i} ({message.get('role')}) has a function_call that is not OpenAI's legacy form: "
                       "an object {name, arguments} on an assistant message without tool_calls (read as its tool "
                       "call); give the calls as tool_calls, a list of {type, function: {name, arguments}} objects",
                       "bad_tool_calls")
    function = {"name": call["name"], "arguments": call.get("arguments", {})}
    return {**{key: value for key, value in message.items() if key != "function_call"},
            "tool_calls": [{"type": "function", "function": function}]}


TEXT_PARTS = ("text", "input_text", "output_text")  # Chat Completions' part, the Responses API's two


def _text_of_parts(parts: list, where: str, assistant: bool = False) -> tuple[str, str]:
    """OpenAI's content parts ([{"type": "text", "text": ...}, ...]; the Responses API's input_text/output_text) as
    one string, the texts joined by a newline (as vLLM gives a text-only model such content), and an assistant's
    thinking parts (`{"type": "thinking", "thinking": ...}`, Mistral's and Anthropic's form of the trace) as its
    trace. Other parts (images, audio) are not text a causal LM trains on: the row's error."""
    texts, traces = [], []
    for k, part in enumerate(parts, start=1):
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type", "text") in TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif assistant and isinstance(part, dict) and part.get("type") == "thinking" and isinstance(
                part.get("thinking"), str):
            traces.append(part["thinking"])
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise RowError(f"{where} content part {k} is {kind!r}; only text parts ({{\"type\": \"text\", "
                           "\"text\": ...}) can be trained on (and an assistant's thinking parts)", "bad_content_type")
    return "\n".join(texts), "\n".join(traces)


class JsonArguments(dict):
    """Tool-call arguments the row gave as a JSON string of an object: the object, and the string as the row
    wrote it (`text`) for a template that writes arguments by string concatenation (DeepSeek-R1's and V3's:
    data/chat/tool_arguments.py)."""

    text: str = ""


def _with_object_arguments(call: Any) -> Any:
    """A tool call whose `function.arguments` is a JSON string of an object, with that object instead: most chat
    templates write the arguments with `tojson` (gpt-oss, Llama 3.1), which would train a JSON string of the
    JSON (`"{\\"city\\": ...}"`); the templates that take either (Qwen) write the object alike."""
    function = call.get("function") if isinstance(call, dict) else None
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if not isinstance(arguments, str):
        return call
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return call  # not JSON: left as written (the tool-call check says if the template drops it)
    if not isinstance(parsed, dict):
        return call
    parsed = JsonArguments(parsed)
    parsed.text = arguments
    return {**call, "function": {**function, "arguments": parsed}}


def _from_messages_with_system(row: dict[str, Any]) -> Messages:
    """Messages rows, opened by the row's own `system` column where it has one (`_with_row_system`)."""
    return _with_row_system(row, _from_messages(row))


def _from_alpaca(row: dict[str, Any]) -> Messages:
    for key in ("instruction", "output"):
        if not isinstance(row.get(key), str):
            raise RowError(f"alpaca row needs a string {key!r}", "missing_field")
    prompt = row["instruction"]
    if isinstance(row.get("input"), str) and row["input"].strip():
        prompt = f"{prompt}\n\n{row['input']}"
    messages = []
    if isinstance(row.get("system"), str) and row["system"].strip():
        messages.append({"role": "system", "content": row["system"]})
    messages += _alpaca_history(row.get("history"))
    messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": row["output"]}]
    return messages


def _alpaca_history(history: Any) -> Messages:
    """LLaMA-Factory's alpaca `history`: the earlier turns, [[instruction, response], ...], before the row's own."""
    if history is None or history == []:
        return []
    if not isinstance(history, list):
        raise RowError(f"alpaca 'history' must be a list of [instruction, response] pairs, got "
                       f"{type(history).__name__}", "bad_history")
    turns: Messages = []
    for i, pair in enumerate(history, start=1):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(t, str) for t in pair)):
            raise RowError(f"alpaca 'history' item {i} must be an [instruction, response] pair of strings",
                           "bad_history")
        turns += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    return turns


def _from_sharegpt(row: dict[str, Any]) -> Messages:
    turns = decoded_list(row.get("conversations"))
    if not isinstance(turns, list) or not turns:
        raise RowError("'conversations' must be a non-empty list of {from, value} objects (or that list as a JSON "
                       f"string){json_error(row.get('conversations'))}", "missing_messages")
    out = []
    for i, turn in enumerate(turns, start=1):
        speaker = turn.get("from") if isinstance(turn, dict) else None
        if speaker not in SHAREGPT_ROLES:
            raise RowError(f"turn {i} has from={speaker!r}; expected one of {', '.join(SHAREGPT_ROLES)}", "unknown_role")
        if not isinstance(turn.get("value"), str):
            raise RowError(f"turn {i} ({speaker}) has a non-string value", "bad_content_type")
        calls = _sharegpt_calls(turn["value"]) if speaker == "function_call" else None
        out.append({"role": "assistant", "content": "", "tool_calls": calls} if calls else
                   {"role": SHAREGPT_ROLES[speaker], "content": turn["value"]})
        if turn.get("weight") is not None:  # OpenHermes-2.5's per-turn weight: 0 is context (as OpenAI's)
            out[-1]["weight"] = turn["weight"]
    return _with_row_system(row, out)


def _sharegpt_calls(value: str) -> Optional[list]:
    """LLaMA-Factory's sharegpt `function_call` turn: a JSON object {name, arguments} (or a list of them, parallel
    calls) that the model's template writes as its tool call, as OpenAI `tool_calls` are written. None where the
    value is not that (the turn is then the assistant's text, as written)."""
    try:
        parsed = json.loads(value)
    except ValueError:
        return None
    calls = parsed if isinstance(parsed, list) else [parsed]
    if not calls or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
        return None
    return [_with_object_arguments({"type": "function", "function": {"name": c["name"],
                                                                      "arguments": c.get("arguments", {})}})
            for c in calls]


def _from_prompt_completion(row: dict[str, Any]) -> Messages:
    """TRL's prompt-completion rows: two strings (raw text, trained as TRL's SFTTrainer trains them: prompt +
    completion + eos, no chat template, the completion's tokens trained; `to_messages` marks the row), or two lists of role/content messages (conversational: the prompt's turns, then the completion's
    assistant turn(s), which are what trains under --train_on all_assistant, as TRL trains the completion; an
    assistant turn in the prompt, a few-shot example, is context: to_messages marks where the completion starts)."""
    prompt, completion = row.get("prompt"), row.get("completion")
    if isinstance(prompt, str) and isinstance(completion, str):
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
    if isinstance(prompt, list) and isinstance(completion, list) and completion:
        if any(not isinstance(m, dict) or m.get("role") != "assistant" for m in completion):
            raise RowError("'completion' must hold assistant messages (role/content) only", "bad_message")
        return _from_messages({"messages": prompt + completion})
    raise RowError("a prompt-completion row needs 'prompt' and 'completion' both strings, or both lists of "
                   "role/content messages (the completion's non-empty)", "missing_field")


CONVERTERS: dict[str, Callable[[dict[str, Any]], Messages]] = {
    "messages": _from_messages_with_system,
    "alpaca": _from_alpaca,
    "sharegpt": _from_sharegpt,
    "prompt_completion": _from_prompt_completion,
}


def trains(message: dict) -> bool:
    """Whether an assistant message trains: all do but those OpenAI's fine-tuning format weighs 0 (`"weight": 0`:
    an answer kept as context, not to be learned)."""
    return message.get("weight") != 0


def check_trainable(messages: Messages) -> None:
    """A training conversation needs an assistant turn that trains, and none of them empty. Turns after the last
    trained assistant turn (a user's follow-up without its answer, a tool's result) are left out: they train
    nothing, and no token before them sees them (open-instruct keeps them, untrained: the same loss)."""
    assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not assistants:
        raise RowError(f"the conversation has no assistant turn (it ends with a {messages[-1]['role']} turn); a "
                       "training conversation needs one", "no_final_assistant")
    for i in assistants:
        if messages[i].get("weight") not in (None, 0, 1):
            raise RowError(f"message {i + 1} (assistant) has weight {messages[i]['weight']!r}; OpenAI's weight is 0 "
                           "(context, not trained) or 1", "bad_weight")
    trained = [i for i in assistants if trains(messages[i])]
    if not trained:
        raise RowError("every assistant turn has weight 0: the conversation trains nothing", "no_trained_turn")
    del messages[trained[-1] + 1:]
    for i, message in enumerate(messages, start=1):
        if message["role"] == "assistant" and not message["content"].strip() and not (
                message.get("tool_calls") or message.get("function_calls")):
            raise RowError(f"message {i} (assistant) is empty", "empty_assistant")


def without_arrow_fill(row: dict[str, Any]) -> dict[str, Any]:
    """A row read from an Arrow table (parquet, `save_to_disk`, a Hub dataset) without the nulls Arrow filled in:
    a column of objects is one struct type over all rows, so each tool call's arguments and each tool schema got
    every key any row's had, null where the row had none (`{"city": "Oslo", "query": null, "limit": null}`), and
    the template would write them and the model learn them. Nulls inside tool calls, tool schemas and a row's
    chat_template_kwargs are removed (a null a row really held there cannot be told apart from the fill); messages'
    own null keys are dropped by `_from_messages` whatever the source."""
    for column in ("tools", "functions", TEMPLATE_KWARGS):  # TEMPLATE_KWARGS: smoltalk2's struct column
        if isinstance(row.get(column), (list, dict)):
            row[column] = _without_nulls(row[column])
    for value in row.values():
        if isinstance(value, list):
            for message in value:
                if isinstance(message, dict) and isinstance(message.get("tool_calls"), list):
                    message["tool_calls"] = _without_nulls(message["tool_calls"])
    return row


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]  # a list's own items are not filled: kept as they are
    return value


def to_messages(row: dict[str, Any], fmt: str) -> Conversation:
    """Convert and validate one row (RowError says what is wrong)."""
    if fmt.startswith("messages:"):  # --sft_messages_key: the conversation is in another column
        key = fmt.split(":", 1)[1]
        if key not in row:
            raise RowError(f"row has no {key!r} (--sft_messages_key; columns: {sorted(row)})", "missing_messages")
        row, fmt = {**row, "messages": row[key]}, "messages"
    elif fmt.startswith("sharegpt:"):  # ShareGPT's from/value turns in another column (often 'messages')
        key = fmt.split(":", 1)[1]
        if key not in row:
            raise RowError(f"row has no {key!r} (the column of this source's from/value turns; columns: "
                           f"{sorted(row)})", "missing_messages")
        row, fmt = {**row, "conversations": row[key]}, "sharegpt"
    shaped = fmt in SHAPES
    if shaped:  # a popular dataset's own columns (open_sft.data.dataset_shapes)
        row, fmt = messages_row(row, fmt), "messages"
    messages = Conversation(CONVERTERS[fmt](row))
    messages.tool_types_mapped = shaped and bool(row.get(TYPES_MAPPED))
    check_trainable(messages)
    messages.tools = row_tools(row)
    messages.template_kwargs = row_template_kwargs(row)
    if fmt == "prompt_completion" and isinstance(row.get("prompt"), list):
        messages.first_trained = len(messages) - len(row["completion"])
    messages.raw_text = fmt == "prompt_completion" and isinstance(row.get("prompt"), str)
    return messages


def needs_chat_template(fmt: str, first_row: dict[str, Any]) -> bool:
    """Whether a source of this format (its first row shown) is rendered with a chat template: not text
    documents, nor TRL's prompt-completion strings (raw text, as TRL trains them)."""
    return fmt != "text" and not (fmt == "prompt_completion" and isinstance(first_row.get("prompt"), str))
