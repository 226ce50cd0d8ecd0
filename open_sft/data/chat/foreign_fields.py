"""Text a chat template writes inside an assistant message from a field that is not the model's: Gemma 4's
`tool_responses` on the calling message (`<|tool_call>call:f{…}<tool_call|><|tool_response>response:f{…}
<tool_response|>`, the form llama.cpp turns OpenAI tool messages into). The model writes its calls and stops at the
special token that opens that text (`<|tool_response>`, one of Gemma 4's generation_config eos ids); the inference
engine writes the rest after it, and the model goes on from there. So that token ends the call turn (trained, a
stop), the rest is context (a hole in the message's trained text), and what the message says after it (the merged
form's answer) trains as a run of its own.

Which fields: those the template reads off a message (`message['tool_responses']`, read from its source) other than
the standard ones (`message_fields`); which token: the special token the template writes first for such a field,
read off a probe call turn holding the probe result as the field's one entry (`openers`)."""

from __future__ import annotations

import functools
import os
import re
from typing import Callable, Optional

import jinja2
from jinja2 import nodes

from open_sft.data.chat.probes import PROBE_TOOLS, PROBE_USER, probe_call, probe_result
from open_sft.data.chat.reasoning import REASONING_KEYS
from open_sft.data.formats import Messages

Draw = Callable[[Messages, bool, Optional[list]], str]
Span = tuple[int, int]
# what a message says that the model writes, or the roles around it write (a tool message's name and call id)
_STANDARD = frozenset({"role", "content", "tool_calls", "function_call", "name", "tool_call_id", *REASONING_KEYS})
_GENERATION_TAGS = re.compile(r"{%-?\s*(?:end)?generation\s*-?%}")  # transformers' own tag: no jinja2 parser knows it


@functools.lru_cache(maxsize=8)  # a template state per row's own variables (smoltalk2's) asks again: parsed once
def message_fields(source: Optional[str]) -> tuple[str, ...]:
    """The keys the template reads off a message (`message`, or the variable of a loop over a `…messages` list)
    other than the standard ones (role, content, tool_calls, a trace, a tool message's name and call id); () for a
    template that does not parse."""
    try:
        tree = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(_GENERATION_TAGS.sub("", source or ""))
    except jinja2.TemplateError:
        return ()
    loops = {"message"} | {loop.target.name for loop in tree.find_all(nodes.For)
                           if isinstance(loop.target, nodes.Name) and "messages" in _root(loop.iter)}
    keys = set()
    for node in tree.find_all((nodes.Getitem, nodes.Getattr)):
        if isinstance(node.node, nodes.Name) and node.node.name in loops:
            key = node.attr if isinstance(node, nodes.Getattr) else getattr(node.arg, "value", None)
            keys |= {key} if isinstance(key, str) else set()
    return tuple(sorted(key for key in keys if key not in _STANDARD and not hasattr(dict, key)))


def _root(node: nodes.Node) -> str:
    """The name an expression reads from (`loop_messages` of `loop_messages[1:] | list`), "" where none."""
    while isinstance(node, (nodes.Getitem, nodes.Getattr, nodes.Filter, nodes.Test)) and node.node is not None:
        node = node.node
    return node.name if isinstance(node, nodes.Name) else ""


def probe_entry() -> dict:
    """The probe call's result as an entry of such a field: the tool message's keys, and its content as the
    `response` too (Gemma 4's entries are {name, response})."""
    result = probe_result()
    return {**result, "response": result["content"]}


def openers(draw: Draw, fields: tuple[str, ...], markers: tuple[str, ...], eos: Optional[str]) -> tuple[str, ...]:
    """The special tokens the template writes first for `fields` in a probe call turn (one entry each), where it
    writes them inside the turn: what the model stops at to have that text written for it."""
    found: list[str] = []
    for name in fields:
        try:
            bare = draw([PROBE_USER, probe_call()], False, PROBE_TOOLS)
            held = draw([PROBE_USER, probe_call(**{name: [probe_entry()]})], False, PROBE_TOOLS)
        except Exception:  # noqa: BLE001 (a template that refuses the probe tells nothing)
            continue
        span = written_span(bare, held)
        text = held[span[0]: span[1]].lstrip() if span else ""
        token = next((m for m in markers if m != eos and text.startswith(m)), None)
        if token and token not in found:
            found.append(token)
    return tuple(found)


def written_span(bare: str, held: str) -> Optional[Span]:
    """Where `held` (a rendering with a field) has text that `bare` (the same without it) lacks, in whole tags: from
    the end of what both start with to the start of what both end with; None where they are the same."""
    start = len(os.path.commonprefix([bare, held]))
    if held.rfind("<", 0, start) > held.rfind(">", 0, start):  # not from inside a tag both open with
        start = held.rfind("<", 0, start)
    shared = len(os.path.commonprefix([bare[start:][::-1], held[start:][::-1]]))
    end = len(held) - shared
    tail = held[end:]
    closing, opening = tail.find(">"), tail.find("<")
    if closing >= 0 and (opening < 0 or closing < opening):  # not from inside a tag both close with
        end += closing + 1
    return (start, end) if end > start else None


def context_hole(draw: Draw, messages: Messages, tools: Optional[list], i: int, target: str,
                 foreign: tuple[tuple[str, ...], tuple[str, ...]]) -> Optional[Span]:
    """Where in `target` (assistant message i as written after its context) the text of its fields that are not
    the model's (`foreign`: the fields and their opening tokens) lies past the token that opens it: context inside
    the message. None where it has none, or where that text opens with no such token (trained as written)."""
    fields, tokens = foreign
    message = messages[i]
    if not tokens or not any(message.get(name) for name in fields):
        return None
    bare = {key: value for key, value in message.items() if key not in fields}
    try:
        held, without = draw(messages[: i + 1], False, tools), draw([*messages[:i], bare], False, tools)
    except Exception:  # noqa: BLE001 (the message renders with the field: without it tells nothing)
        return None
    span = written_span(without, held)
    text = held[span[0]: span[1]] if span else ""
    token = next((token for token in tokens if text.lstrip().startswith(token)), None)
    at = target.rfind(text) if token else -1
    if at < 0:
        return None
    return at + text.index(token) + len(token), at + len(text)


def around(span: Span, hole: Optional[Span]) -> list[Span]:
    """A trained span ([start, end), start where its turn's text starts) less its turn's `hole` (offsets in it)."""
    if hole is None:
        return [span]
    start, end = span
    pieces = [(start, min(end, start + hole[0])), (max(start, start + hole[1]), end)]
    return [(a, b) for a, b in pieces if b > a]
