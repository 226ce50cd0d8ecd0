"""Tool call ids under templates that read them.

Some templates write each call's id (Mistral's `"id": "a1b2c3d4e"` after the arguments, Kimi-K2's
`<|tool_call_begin|>functions.get_weather:0`), which the model learns to generate, or name a tool result's call by
it (`"call_id"`, `## Return of …`). xLAM- and glaive-style rows carry no ids: Mistral-Small-3.1's template then
failed with `'dict object' has no attribute 'id'` (reported as a tool schema lacking 'id'), and Kimi-K2's wrote an
empty id, which the model would learn to generate. The id's form is the model's own (Mistral's tokenizer makes 9
letters and digits, Kimi's `functions.NAME:INDEX`), which the template does not say, so such a row is a bad row
named with the fix rather than one trained with ids made up here: a row whose rendering holds the ids it lacks
(a template may write them in history only, as Apriel-1.5's does)."""

from __future__ import annotations

import itertools
from typing import Optional

from open_sft.data.chat.probes import PROBE_TOOLS, PROBE_USER, probe_call, probe_result
from open_sft.data.chat.render import TemplateState
from open_sft.data.formats import Messages, RowError, same_kind

# ids of 9 letters and digits, the form Mistral's templates check for (Mistral-Small-3.2's raises on any other)
_FILLS = ("a1b2c3d4e", "z9y8x7w6v")


def _probe(call_id: str, result_id: str) -> list[dict]:
    return [PROBE_USER, probe_call(call_id=call_id), probe_result(result_id)]


def reads_call_ids(state: TemplateState) -> tuple[bool, bool]:
    """Whether the template writes a call's id, and whether it writes (or links by) a tool result's tool_call_id:
    probes rendered with other ids differ (asked once per template state; nothing where the probe fails)."""
    if state.call_ids is None:
        try:
            first, calls, results = (state.draw(_probe(a, b), False, PROBE_TOOLS) for a, b in (
                (_FILLS[0], _FILLS[0]), (_FILLS[1], _FILLS[0]), (_FILLS[0], _FILLS[1])))
            state.call_ids = (first != calls, first != results)
        except RowError:
            state.call_ids = (False, False)
    return state.call_ids


def _id_of(value: object) -> bool:
    return isinstance(value, str) and bool(value.strip())


def _filled(messages: Messages, fill: str) -> Messages:
    """The row with every missing call id and tool_call_id filled with `fill` ending in a number, as long as it."""
    count = itertools.count()

    def numbered() -> str:
        n = str(next(count))
        return fill[: len(fill) - len(n)] + n

    def call(c):
        return c if not isinstance(c, dict) or _id_of(c.get("id")) else {**c, "id": numbered()}
    return same_kind(messages, (
        {**m, "tool_calls": [call(c) for c in m["tool_calls"]]} if m["role"] == "assistant" and m.get("tool_calls")
        else {**m, "tool_call_id": numbered()} if m["role"] == "tool" and not _id_of(m.get("tool_call_id"))
        else m for m in messages))


def _writes_ids(state: TemplateState, messages: Messages) -> bool:
    """Whether this row's rendering holds the ids it lacks: rendered with two fillings it differs (Apriel-1.5's
    template writes ids in history only, so a row whose one call turn is its last needs none). A template that
    fails on the filled row is left to the row's own rendering, which names that failure."""
    tools = getattr(messages, "tools", None)
    try:
        first, second = (state.draw(_filled(messages, fill), False, tools) for fill in _FILLS)
    except RowError:
        return False
    return first != second


def check_call_ids(state: TemplateState, messages: Messages) -> None:
    """A row whose tool calls (or tool results) lack the ids its template writes is a bad row, named with the fix."""
    calls = [(i, m) for i, m in enumerate(messages) if m["role"] == "assistant" and m.get("tool_calls")]
    if not calls:
        return
    needs_calls, needs_results = reads_call_ids(state)
    missing: Optional[str] = None
    if needs_calls:
        missing = next((f"message {i + 1} (assistant, with tool calls): a tool call has no 'id'" for i, m in calls
                        if not all(isinstance(c, dict) and _id_of(c.get("id")) for c in m["tool_calls"])), None)
    if missing is None and needs_results:
        missing = next((f"message {i + 1} (tool): it has no 'tool_call_id'" for i, m in enumerate(messages)
                        if m["role"] == "tool" and not _id_of(m.get("tool_call_id"))), None)
    if missing and _writes_ids(state, messages):
        raise RowError(
            f"{missing}, and the chat template writes tool call ids (the model learns to generate a call's id, and "
            "a tool result names its call by it); xLAM- and glaive-style rows carry none: give every tool call an "
            "'id' in the form the model generates (Mistral's: 9 letters and digits; Kimi-K2's: functions.NAME:INDEX) "
            "and every tool message the 'tool_call_id' of the call it answers, or skip such rows with --on_bad_row "
            "drop", "tool_call_ids_missing")
