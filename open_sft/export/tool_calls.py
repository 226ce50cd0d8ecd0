"""Tool calls in a generated reply, read by the chat template's own layout of a call.

The template renders a probe assistant message that calls PROBE_NAME with PROBE_ARGUMENTS, and the text it
writes says where a call's name and arguments sit; five layouts cover the templates models ship:

- `json`: one JSON value holds the name and the arguments (Qwen3's and Hermes' `<tool_call>\\n{"name": ...,
  "arguments": {...}}\\n</tool_call>`, Mistral's `[TOOL_CALLS] [{"name": ..., "arguments": {...}}]`, a list: each
  item a call); the probe says under which keys.
- `name_json`: the name written as text, the arguments as a JSON object after it (gpt-oss's commentary channel:
  ` to=functions.NAME<|channel|>commentary json<|message|>{...}<|call|>`; its model's own order, the recipient after
  the channel, and a preamble on that channel read too: open_sft.export.call_headers).
- `pairs`: the name as text, each argument as a key and a value between the template's tags (GLM-4.5's
  `<tool_call>NAME<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>`); a value is read as JSON where it
  is (a number, an object) unless the tool's schema says string.
- `object`: the name as text, the arguments as an object in the template's own notation (Gemma 4's
  `<|tool_call>call:NAME{city:<|"|>Bern<|"|>,days:3}<tool_call|>`), read off the probe and checked on a probe of
  every JSON kind (open_sft.export.call_objects).
- `python`: a Python call, keyword arguments of literal values (LFM2's `<|tool_call_start|>[NAME(city='Bern')]
  <|tool_call_end|>`), read with Python's parser and checked likewise (open_sft.export.call_python).

Each call starts at the template's call `marker`: what it writes right before the name (or the JSON value) both
when the call is the whole message and after some content (`<tool_call>`, `to=functions.`, `[TOOL_CALLS]`); a
template that writes a bare JSON call with nothing before it (Llama 3.1's `{"name": ..., "parameters": {...}}`)
has no marker, and a reply is then a call when the whole of it is one, with its arguments key, naming one of the
tools the prompt was given (without tools such a reply is text: a JSON answer with a "name" key is no call).
Calls are read in the reply's answer part only, past its reasoning (open_sft.export.reply): a call written inside
a think block is reasoning. The text before the first call is the reply's content and reasoning, less what the
template writes between a trace and a call (gpt-oss's `<|end|><|start|>assistant`); text written after the last
call's closing (the template's `</tool_call>`, special tokens aside) is kept after that content, not dropped. A
marker whose call does not read (JSON cut off or not JSON, arguments not an object, no name, no closing where the
template writes one after a call and not after an answer, `</tool_call>` or gpt-oss's `<|call|>`, the token its model
stops at: cut off at --max_new_tokens) makes the reply an unreadable call, shown as written, even after
calls that read: a reply's calls are read all or none (chat could keep no message that renders the reply as the
model wrote it, and compare scores the reply, not its first call). A template whose probe renders no call (no
tool-call support) has no layout: its replies are text. The probe is given as the template takes it
(open_sft.export.call_probe): arguments as JSON text (DeepSeek's templates concatenate them), and where the template
writes the id in the name's place (Kimi-K2's), an id that carries the name, read back out of a reply's id.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any, Optional

from open_sft.data.per_tokenizer import PerTokenizer
from open_sft.data.tool_schemas import function_of
from open_sft.export.call_headers import split_head
from open_sft.export.call_objects import NOTATION_PROBE, Notation, checked_notation, probe_notation, read_object
from open_sft.export.call_pairs import (PROBE_ARGUMENTS, as_arguments, literal, pair_arguments, pair_layout,
                                       schema_types)
from open_sft.export.call_probe import NAME_CHARS, PROBE_NAME, name_in_id, probe_form, rendered_reply
from open_sft.export.call_python import checked_python, probe_python, read_python
from open_sft.export.template_text import common_suffix, strip_specials, without_shared_ending

PROBE_CONTENT, PROBE_TRACE = "ANSWER_5c2e", "TRACE_8d1f"
_LAYOUTS = PerTokenizer()  # read once per tokenizer, again if its template or tokens change
NAME = re.compile(rf"\s*({NAME_CHARS}+)")


@dataclass(frozen=True)
class CallLayout:
    """Where a template writes a call (module docstring): `kind` (json, name_json, pairs, object, python), the
    `marker` a call starts at, in `json` the key paths of the name and the arguments in a call object (`listed`: the
    calls are a JSON list; in `python` a Python list), in `pairs` the key's opening, the text between a key and its
    value and the value's closing; `before_call`: what the template writes between a trace and a call."""

    kind: str
    marker: str
    name_path: tuple = ()
    arguments_path: tuple = ()
    listed: bool = False
    pair: tuple[str, ...] = ("", "", "")
    before_call: str = ""
    closing: str = ""  # what it writes after a call's arguments and not after an answer (`</tool_call>`, `<|call|>`)
    arguments_after: str = ""  # name_json: the end of what it writes between name and arguments (`json<|message|>`)
    channel: str = ""  # name_json: the rest of it (`<|channel|>commentary`): open_sft.export.call_headers
    # where a turn's later calls start inside the block its first opens, if that is less than `marker` (MiniMax-M2's
    # `<invoke name="` after `<minimax:tool_call>\n<invoke name="`): _next_marker
    next_marker: str = ""
    block_end: str = ""  # what closes that block after its last call (`</minimax:tool_call>`): a call without it is cut
    id_name: str = ""  # a regex reading the name out of the id written in its place (open_sft.export.call_probe)
    text_arguments: bool = False  # it takes a call's arguments as JSON text (open_sft.export.call_probe)
    notation: Optional[Notation] = None  # object: the template's notation of the arguments (call_objects)
    raw_strings: bool = False  # python: it writes a string between quotes unescaped (call_python.checked_python)


@dataclass(frozen=True)
class ReadCalls:
    """A reply's answer part read for calls: `head` the text before the first call, `calls` each {name,
    arguments}, `after` text the reply wrote after its last call (past the template's closing of it) or as a
    preamble before it (open_sft.export.call_headers), kept in the answer, `unreadable` the reply's text from its
    first call marker on where a call there does not read as one (cut off, not JSON, no name): no `calls` then."""

    head: str
    calls: tuple[dict, ...] = ()
    after: str = ""
    unreadable: Optional[str] = None
    ids: tuple[str, ...] = ()  # each call's id as written, where the template writes it as the name (Kimi-K2's)
    text_arguments: bool = False  # the template takes arguments as JSON text: a history gives them back so


def _json_values(text: str) -> list[tuple[int, int, Any]]:
    """(start, end, value) of every JSON object or list that starts in `text`."""
    decoder, found = json.JSONDecoder(), []
    for match in re.finditer(r"[{\[]", text):
        try:
            value, end = decoder.raw_decode(text, match.start())
        except ValueError:
            continue
        found.append((match.start(), end, value))
    return found


def _path_to(value: Any, wanted: Any, path: tuple = ()) -> Optional[tuple]:
    """The key path under which `value` holds `wanted` (arguments may be held as a JSON string)."""
    if value == wanted or (wanted == PROBE_ARGUMENTS and as_arguments(value) == wanted):
        return path
    if isinstance(value, dict):
        for key, item in value.items():
            if (found := _path_to(item, wanted, path + (key,))) is not None:
                return found
    return None


def _anchor(text: str) -> Optional[tuple[int, dict, int]]:
    """Where the probe's call starts in the rendered reply, what the layout reads there, and where the call's
    arguments end."""
    name_at = text.find(PROBE_NAME)
    if name_at < 0:
        return None
    for start, end, value in _json_values(text):
        call = value[0] if isinstance(value, list) and value else value
        if start <= name_at < end and isinstance(call, dict):
            name_path, arguments_path = _path_to(call, PROBE_NAME), _path_to(call, PROBE_ARGUMENTS)
            if name_path is not None and arguments_path is not None:
                return start, {"kind": "json", "name_path": name_path, "arguments_path": arguments_path,
                               "listed": isinstance(value, list)}, end
    after = name_at + len(PROBE_NAME)
    for start, end, value in _json_values(text):
        if start >= after and as_arguments(value) == PROBE_ARGUMENTS:
            *channel, last = text[after:start].split() or [""]
            return name_at, {"kind": "name_json", "arguments_after": last, "channel": " ".join(channel)}, end
    if (notation := probe_notation(text[after:])) is not None:
        return name_at, {"kind": "object", "notation": notation[0]}, after + notation[1]
    if (python := probe_python(text, name_at)) is not None:
        return python[0], {"kind": "python", "listed": python[1]}, python[2]
    pair = pair_layout(text[after:])
    if not pair:
        return None
    return name_at, {"kind": "pairs", "pair": pair}, text.rfind(pair[2]) + len(pair[2])


def _layout(tokenizer) -> Optional[CallLayout]:
    form = probe_form(tokenizer, lambda text: _anchor(text) is not None)
    if form is None:
        return None
    alone = form.reply(tokenizer)
    start, parts, end = _anchor(alone)
    checked = {"object": _checked, "python": checked_python}.get(parts["kind"])  # read back on every JSON kind
    if checked is not None and (parts := checked(tokenizer, form, parts)) is None:
        return None
    answer = rendered_reply(tokenizer, {"role": "assistant", "content": PROBE_CONTENT})
    closing = without_shared_ending(alone[end:], answer[answer.find(PROBE_CONTENT) + len(PROBE_CONTENT):], tokenizer) \
        if answer and PROBE_CONTENT in answer else strip_specials(alone[end:], tokenizer)
    after_content = form.reply(tokenizer, PROBE_CONTENT)
    anchored = _anchor(after_content) if after_content is not None else None
    marker = common_suffix(alone[:start], after_content[:anchored[0]]) if anchored else alone[:start]
    after_trace, before_call = form.reply(tokenizer, reasoning=PROBE_TRACE), ""
    traced = _anchor(after_trace) if after_trace is not None and PROBE_TRACE in after_trace else None
    if traced and common_suffix(marker, after_trace[:traced[0]]).strip():  # not its empty plan (Command R7B's
        marker = common_suffix(marker, after_trace[:traced[0]])  # <|START_THINKING|><|END_THINKING|>)
    if not marker.strip() and (parts["kind"] != "json" or alone[:start].strip()):
        return None  # a name written with nothing before it to find it by
    if after_trace is not None and PROBE_TRACE in after_trace:
        rest = after_trace[after_trace.index(PROBE_TRACE) + len(PROBE_TRACE):]
        at = rest.find(marker.strip()) if marker.strip() else -1
        before_call = rest[:at].strip() if at >= 0 else ""
    two = form.reply(tokenizer, calls=2)
    following = _next_marker(two, alone[:start]) if two and parts["kind"] not in ("json", "python") else ""
    following = following if following != marker.strip() and marker.strip().endswith(following) else ""
    block_end = ""
    if following:  # a call inside the block closes with what the template writes before the next one too
        between, whole = two[two.find(PROBE_NAME):two.rfind(PROBE_NAME)], closing.strip()
        while closing and closing not in between:
            closing = closing[:-1]
        closing = re.sub(r"[^>\s]*$", "", closing).strip()  # in whole tags
        ends = re.match(r"\s*(<[^<>]*>)", whole[len(closing):]) if whole.startswith(closing) else None
        block_end = ends.group(1) if ends else ""  # its first tag
    return CallLayout(marker=marker.strip(), before_call=before_call, closing=closing.strip(), id_name=form.id_name,
                      next_marker=following, block_end=block_end, text_arguments=isinstance(form.arguments, str),
                      **parts)


def _checked(tokenizer, form, parts: dict) -> Optional[dict]:
    """An object layout's parts with the notation checked on the template's rendering of a probe call holding a
    value of each JSON kind (open_sft.export.call_objects), None where that does not read back."""
    rendered = replace(form, arguments=NOTATION_PROBE).reply(tokenizer) or ""
    at = rendered.find(PROBE_NAME)
    notation = checked_notation(parts["notation"], rendered[at + len(PROBE_NAME):]) if at >= 0 else None
    return {**parts, "notation": notation} if notation else None


def _next_marker(two: str, before_first: str) -> str:
    """What the template writes right before the second of two calls in one turn (`two`), as far as it writes it
    before a call alone too (`before_first`), in whole tags or lines: "" where it writes no second call."""
    first = two.find(PROBE_NAME)
    second = two.find(PROBE_NAME, first + len(PROBE_NAME)) if first >= 0 else -1
    shared = common_suffix(two[first:second], before_first) if second >= 0 else ""
    while shared and not (len(shared) == len(before_first) or before_first[-len(shared) - 1] in ">\n "):
        shared = shared[1:]
    return shared.strip()


def call_layout(tokenizer) -> Optional[CallLayout]:
    """The template's call layout (module docstring), or None where its probe renders no call we can read."""
    template = tokenizer.chat_template
    if not isinstance(template, str):
        return None
    return _LAYOUTS.get(tokenizer, (template, len(tokenizer)), lambda: _layout(tokenizer))


def _get(value: Any, path: tuple) -> Any:
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def _has(value: Any, path: tuple) -> bool:
    """Whether `value` holds the key path (its last key present, whatever its value)."""
    return bool(path) and isinstance(parent := _get(value, path[:-1]), dict) and path[-1] in parent


def _calls_in(layout: CallLayout, segment: str, tools: Optional[list]) -> Optional[tuple[list[dict], int]]:
    """(the calls one marker's segment holds: one, or a JSON list's; where they end, past their closing), or None
    where it holds none that reads as a call (JSON cut off or not JSON, arguments not an object, a name or the
    template's closing missing)."""
    if layout.kind == "json":
        values = _json_values(segment)
        if not values or segment[:values[0][0]].strip():
            return None
        value = values[0][2]
        calls = [{"name": _get(call, layout.name_path), "arguments": as_arguments(_get(call, layout.arguments_path))}
                 for call in (value if layout.listed and isinstance(value, list) else [value])]
        readable = all(isinstance(c["name"], str) and c["name"] and isinstance(c["arguments"], (dict, type(None)))
                       for c in calls)
        end = _closed(layout, segment, values[0][1])
        return ([{**c, "arguments": c["arguments"] or {}} for c in calls], end) if calls and readable \
            and end is not None else None
    if layout.kind == "python":  # a Python call (or list of them), its closing after it
        read = read_python(segment, layout.listed, layout.raw_strings)
        end = _closed(layout, segment, read[1]) if read else None
        return (read[0], end) if end is not None else None
    named = NAME.match(segment)
    name = name_in_id(layout.id_name, named.group(1)) if named else None
    if name is None:
        return None  # no name, or an id that carries none in the template's form
    rest = segment[named.end():]
    if layout.kind == "name_json":
        header = re.search(literal(layout.arguments_after), rest) if layout.arguments_after else None
        at = header.end() if header else 0
        at += len(rest[at:]) - len(rest[at:].lstrip())
        try:  # the arguments: a JSON object right after the header (a string, a list, cut-off JSON: no call)
            arguments, end = json.JSONDecoder().raw_decode(rest, at)
        except ValueError:
            return None
        end = _closed(layout, segment, named.end() + end)
        return ([{"name": name, "arguments": arguments}], end) if isinstance(arguments, dict) \
            and (header or not layout.arguments_after) and end is not None else None
    if layout.kind == "object":  # the arguments right after the name, in the template's notation
        read = read_object(layout.notation, rest, 0)
        end = _closed(layout, segment, named.end() + read[1]) if read else None
        return ([{"name": name, "arguments": read[0]}], end) if end is not None else None
    closed = rest.find(layout.closing) if layout.closing else len(rest)
    if closed < 0:
        return None  # cut off before its closing (--max_new_tokens): its last pair may be cut too
    body, end = rest[:closed], named.end() + closed + len(layout.closing)
    arguments = pair_arguments(layout.pair, body, schema_types(tools, name))
    return None if arguments is None else ([{"name": name, "arguments": arguments}], end)


def _closed(layout: CallLayout, segment: str, end: int) -> Optional[int]:
    """`end` moved past the template's closing of a call (`</tool_call>`, if any); None where the call lacks it."""
    closing = re.match(r"\s*" + literal(layout.closing), segment[end:])
    return end + closing.end() if closing else None


def read_calls(tokenizer, text: str, tools: Optional[list] = None, ended_by: str = "") -> ReadCalls:
    """`text` (the answer part of a reply decoded with its special tokens: what follows its reasoning) read for
    calls by the template's layout (ReadCalls), `ended_by` the token that ended the reply (a call's closing may be
    it: gpt-oss's `<|call|>`; "" where --max_new_tokens cut it). Text after the last call's closing, special tokens
    aside, is kept as `after`; a marker whose call does not read makes the reply an unreadable call."""
    layout = call_layout(tokenizer)
    if layout is None:
        return ReadCalls(text)
    if not layout.marker:
        return _bare_call(layout, tokenizer, text, tools)
    text, written = text + ended_by, text
    markers = (layout.marker, layout.next_marker) if layout.next_marker else (layout.marker,)
    found = list(re.finditer("|".join(f"(?:{literal(marker)})" for marker in markers), text))
    if not found:
        return ReadCalls(written)
    head, preamble = split_head(text[:found[0].start()], layout.channel, layout.arguments_after, layout.before_call)
    calls, after, ids = [], "", []
    for match, end in zip(found, [later.start() for later in found[1:]] + [len(text)]):
        read = _calls_in(layout, text[match.end():end], tools)
        if read is None:
            return ReadCalls(head, after=strip_specials(preamble, tokenizer).strip(),
                             unreadable=written[found[0].start():].strip())
        calls += read[0]
        after = text[match.end():end][read[1]:]
        ids += [NAME.match(text[match.end():end]).group(1)] if layout.id_name else []
    if layout.block_end and not (closed := re.match(r"\s*" + literal(layout.block_end), after)):
        return ReadCalls(head, unreadable=written[found[0].start():].strip())  # cut before its block's end
    after = after[closed.end():] if layout.block_end else after
    return ReadCalls(head, tuple(calls), strip_specials(f"{preamble}\n\n{after}", tokenizer).strip(),
                     ids=tuple(ids), text_arguments=layout.text_arguments)


def _bare_call(layout: CallLayout, tokenizer, text: str, tools: Optional[list]) -> ReadCalls:
    """A template without a marker (Llama 3.1's bare JSON call): the reply is a call when the whole of it (special
    tokens aside) is one JSON call object that has the arguments key and names one of `tools`. Without tools it is
    text: any JSON answer with a "name" key (`{"name": "Alice", "age": 30}`) would otherwise read as a call."""
    names = _tool_names(tools)
    values = _json_values(text.strip())
    if not names or not values or values[0][0] != 0 or strip_specials(text.strip()[values[0][1]:], tokenizer).strip():
        return ReadCalls(text)
    objects = values[0][2] if layout.listed and isinstance(values[0][2], list) else [values[0][2]]
    if not all(_has(value, layout.arguments_path) for value in objects):
        return ReadCalls(text)  # no arguments key: a JSON answer, not a call
    read = _calls_in(layout, text.strip(), tools)
    return ReadCalls("", tuple(read[0])) if read and all(call["name"] in names for call in read[0]) \
        else ReadCalls(text)


def _tool_names(tools: Optional[list]) -> set[str]:
    """The function names of tool schemas (OpenAI tool objects or bare function schemas)."""
    names = set()
    for tool in tools or ():
        function = function_of(tool)
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            names.add(function["name"])
    return names


def split_calls(tokenizer, text: str, tools: Optional[list] = None) -> tuple[str, list[dict]]:
    """(the reply's text before its first call, less what the template writes between a trace and a call; the
    calls, each {name, arguments}) of a reply's answer part (read_calls). No calls, or one that does not read as a
    call: (text, [])."""
    read = read_calls(tokenizer, text, tools)
    return (read.head, list(read.calls)) if read.calls else (text, [])


def call_text(call: dict) -> str:
    """`get_weather {"city": "Oslo"}`: a call as compare's table and expected answers show it."""
    return f"{call['name']} {json.dumps(call['arguments'], ensure_ascii=False)}"


def call_line(call: dict) -> str:
    """`[tool call] get_weather {"city": "Oslo"}`: how generate's and chat's output show a call."""
    return f"[tool call] {call_text(call)}"


def expected_calls(message: dict) -> list[dict]:
    """A data row's assistant message's calls as {name, arguments} (arguments given as JSON text read as JSON)."""
    calls = []
    for call in message.get("tool_calls") or ():
        function = function_of(call)
        calls.append({"name": function.get("name"), "arguments": as_arguments(function.get("arguments") or {})})
    return calls


def same_calls(expected: list[dict], got: list[dict]) -> bool:
    """Whether the calls are the same, in order: the same names and the same arguments as JSON values (key order
    and spacing aside; 7 and 7.0 are one number)."""
    return len(expected) == len(got) and all(
        e["name"] == g["name"] and e["arguments"] == g["arguments"] for e, g in zip(expected, got))


def task_tools(row: dict) -> Optional[list]:
    """A task row's own `tools` (or legacy `functions`), as the data layer reads them for training."""
    from open_sft.data.formats import row_tools

    return row_tools(row)


def scores_calls(row: dict) -> bool:
    """Whether a task's expected reply (its last message) is a tool call: it is scored by its calls."""
    return bool(row["messages"][-1].get("tool_calls"))


def was_right(row: dict, reply, text_match) -> bool:
    """A task's reply scored: an expected call by same_calls, an answer by `text_match(expected, got)` (a reply
    cut inside its reasoning is a miss)."""
    if getattr(reply, "unreadable_call", None) is not None:
        return False  # a call that does not read as one is a miss, whatever text came before it
    if scores_calls(row):
        return same_calls(expected_calls(row["messages"][-1]), list(reply.tool_calls))
    return reply.answered and text_match(row["answer"], reply.text)
