"""Tool-call arguments written in a template's own object notation after the call's name (the `object` layout of
open_sft.export.tool_calls: Gemma 4's `<|tool_call>call:NAME{city:<|"|>Bern<|"|>,days:3}<tool_call|>`).

JSON's brackets, commas and colons, with the rest read off the template: the string quote (Gemma 4's `<|"|>`, the
same token closing the string, nothing escaped inside it), keys bare or in that quote, and how true, false and null
are spelled (Gemma 4's `None`: Jinja writes Python's null as it is). The notation is read off the probe call's
rendering and then checked on a probe call holding a value of each JSON kind (NOTATION_PROBE: nested objects, a
list, a string holding `,` `}` `:` and a quote-like `"`): a template whose rendering of it does not read back as
exactly those values has no object layout (its replies stay text, never a call made up from them).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Optional

from open_sft.export.call_pairs import PROBE_ARGUMENTS

NOTATION_PROBE = {**PROBE_ARGUMENTS, "probe_key_3": True, "probe_key_4": False, "probe_key_5": None,
                  "probe_key_6": [2.5, 'probe, "item": }', -3], "probe_key_7": {"probe_inner": {"probe_deep": "x y"}}}
_LITERALS = {"probe_key_3": True, "probe_key_4": False, "probe_key_5": None}
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?")
_BARE_KEY = re.compile(r"[^\s:,{}\[\]]+")


@dataclass(frozen=True)
class Notation:
    """The template's object notation (module docstring): its string `quote` and `literals`, each (spelling, value)."""

    quote: str
    literals: tuple[tuple[str, Any], ...] = (("true", True), ("false", False), ("null", None))


def probe_notation(segment: str) -> Optional[tuple[Notation, int]]:
    """(the notation, where the arguments end) of the probe's arguments written right after its name (`segment`):
    `{` opens them, a key is bare or quoted, the string's quote sits between `:` and its value and closes it; None
    where the segment is not so written or does not read back as the probe's arguments."""
    (key_1, value_1), _ = PROBE_ARGUMENTS.items()
    k1, v1 = segment.find(key_1), segment.find(value_1)
    if not segment.startswith("{") or k1 < 0 or v1 < k1:
        return None
    key_quote = segment[1:k1]
    between = segment[k1 + len(key_1):v1]
    if not between.startswith(key_quote + ":"):
        return None
    quote = between[len(key_quote) + 1:]
    if not quote.strip() or key_quote not in ("", quote) or not segment[v1 + len(value_1):].startswith(quote):
        return None
    read = read_object(Notation(quote), segment, 0)
    return (Notation(quote), read[1]) if read and read[0] == PROBE_ARGUMENTS else None


def checked_notation(notation: Notation, segment: str) -> Optional[Notation]:
    """The notation with the template's spelling of true, false and null, read off its rendering of NOTATION_PROBE's
    arguments (`segment`, from right after the name), where that rendering reads back as exactly those values; None
    where it does not (another notation than this module reads)."""
    literals = []
    for key, value in _LITERALS.items():
        written = re.search(re.escape(key) + rf"(?:{re.escape(notation.quote)})?:([^\s,{{}}\[\]]+)", segment)
        if not written:
            return None
        literals.append((written.group(1), value))
    checked = Notation(notation.quote, tuple(literals))
    read = read_object(checked, segment, 0)
    return checked if read and read[0] == NOTATION_PROBE else None


def read_object(notation: Notation, text: str, at: int) -> Optional[tuple[dict, int]]:
    """(the object written at `text[at]` in the notation, where it ends), or None where none is (cut off, a value
    not in the notation: a bare word, an unclosed string)."""
    try:
        read = _value(notation, text, _skip(text, at))
    except RecursionError:  # nesting past Python's depth: no call we read
        return None
    return read if read and isinstance(read[0], dict) else None


def _skip(text: str, at: int) -> int:
    return len(text) - len(text[at:].lstrip()) if at < len(text) else at


def _value(notation: Notation, text: str, at: int) -> Optional[tuple[Any, int]]:
    if text.startswith(notation.quote, at):
        end = text.find(notation.quote, at + len(notation.quote))
        return (text[at + len(notation.quote):end], end + len(notation.quote)) if end >= 0 else None
    if text.startswith("{", at) or text.startswith("[", at):
        return _items(notation, text, at)
    for spelling, value in notation.literals:
        if text.startswith(spelling, at) and not _BARE_KEY.match(text, at + len(spelling)):
            return value, at + len(spelling)
    number = _NUMBER.match(text, at)
    return (json.loads(number.group()), number.end()) if number else None


def _items(notation: Notation, text: str, at: int) -> Optional[tuple[Any, int]]:
    """The object or list opening at `text[at]`, each key bare or quoted, and where it ends past its bracket."""
    is_object = text[at] == "{"
    found, close, at = ({} if is_object else []), ("}" if is_object else "]"), _skip(text, at + 1)
    if text.startswith(close, at):
        return found, at + 1
    while True:
        if is_object:
            quoted = text.startswith(notation.quote, at)
            bare = None if quoted else _BARE_KEY.match(text, at)
            key = _value(notation, text, at) if quoted else (bare.group(), bare.end()) if bare else None
            at = _skip(text, key[1]) if key else -1
            if at < 0 or not text.startswith(":", at):
                return None
            at += 1
        value = _value(notation, text, _skip(text, at))
        if value is None:
            return None
        if is_object:
            found[key[0]] = value[0]
        else:
            found.append(value[0])
        at = _skip(text, value[1])
        if text.startswith(close, at):
            return found, at + 1
        if not text.startswith(",", at):
            return None
        at = _skip(text, at + 1)
