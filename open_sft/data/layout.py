"""One template render per row: a conversation shape's layout, with the contents as slots.

The label step needs, for each assistant turn, where its prompt ends and where its turn ends in the
rendered text. Rendering those two prefixes of every row (render.py's definition) costs two more
template renders per assistant turn: most of a build's time. Rows share few shapes (the sequence of
roles), so for each shape the prefixes are rendered once with placeholder contents, and the result is
kept as a layout: the literal text between content slots, and each prefix's end as a place in it.

A row of that shape is still rendered by the real template (so its text is always exactly the
template's), and its prefix ends are read off the layout only if the layout, filled with the row's
contents (as they are, or stripped, for templates that `trim` them), is that very text. A template that
reads the contents (branches on them, renders one twice) fails that test and the row takes the
prefix-rendering path. The label check (tokenize.py) verifies every row's trained tokens either way.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Callable, Optional

_SLOT = "\x00{}\x00"  # the placeholder for message j's content: a string no template writes by itself
_SLOT_PATTERN = re.compile("\x00(\\d+)\x00")

Place = tuple[int, int]  # (literal index, offset in that literal)


@dataclass(frozen=True)
class Layout:
    literals: tuple[str, ...]  # text between slots: one more than slots
    slots: tuple[int, ...]  # the message whose content fills each slot, in text order
    ends: dict[int, tuple[Place, Place]]  # assistant message i → (end of its prompt, end of its turn)
    # Derived: the literals as one format string (filled by one C call), and each end as (slots
    # before it, its position counting literal characters only).
    _format: str = field(init=False, repr=False)
    _ends: dict[int, tuple[int, int, int, int]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        escaped = (literal.replace("{", "{{").replace("}", "}}") for literal in self.literals)
        object.__setattr__(self, "_format", "{}".join(escaped))
        literal_chars = [0, *accumulate(map(len, self.literals))]
        flat = lambda place: (place[0], literal_chars[place[0]] + place[1])  # noqa: E731
        object.__setattr__(self, "_ends", {i: (*flat(p), *flat(t)) for i, (p, t) in self.ends.items()})

    def prefix_ends(self, contents: list[str], text: str) -> Optional[dict[int, tuple[int, int]]]:
        """Assistant message i → (prompt length, length through its turn) in `text`, or None when the
        layout filled with these contents (as they are, or stripped) is not `text`."""
        inserted = [contents[j] for j in self.slots]
        if self._format.format(*inserted) != text:
            inserted = [content.strip() for content in inserted]
            if self._format.format(*inserted) != text:
                return None
        content_chars = [0, *accumulate(map(len, inserted))]
        return {i: (p + content_chars[slots_p], t + content_chars[slots_t])
                for i, (slots_p, p, slots_t, t) in self._ends.items()}


Draw = Callable[[list, bool, Optional[list]], str]


def build_layout(draw: Draw, roles: tuple[str, ...]) -> Optional[Layout]:
    """The layout of conversations with these roles, or None when the template does not give one
    (it renders a content twice or out of order, is not prefix-stable, or raises)."""
    messages = [{"role": role, "content": _SLOT.format(j)} for j, role in enumerate(roles)]
    try:
        full = draw(messages, False, None)
        parts = _SLOT_PATTERN.split(full)
        literals, slots = tuple(parts[0::2]), tuple(int(j) for j in parts[1::2])
        if list(slots) != sorted(set(slots)):
            return None
        literal_starts, position = [], 0
        for literal, slot in zip(literals, slots + (None,)):
            literal_starts.append(position)
            position += len(literal) + (len(_SLOT.format(slot)) if slot is not None else 0)

        def place(length: int) -> Optional[Place]:
            for index in range(len(literals) - 1, -1, -1):
                offset = length - literal_starts[index]
                if offset >= 0:
                    return (index, offset) if offset <= len(literals[index]) else None  # None: inside a slot
            return None

        ends = {}
        for i, role in enumerate(roles):
            if role != "assistant":
                continue
            prompt = draw(messages[:i], True, None)
            through = full if i == len(roles) - 1 else draw(messages[: i + 1], False, None)
            prompt_end, through_end = place(len(prompt)), place(len(through))
            if i not in slots or not (full.startswith(prompt) and full.startswith(through)) \
                    or prompt_end is None or through_end is None:
                return None
            ends[i] = (prompt_end, through_end)
        return Layout(literals, slots, ends)
    except Exception:  # a template that rejects this shape: the prefix path reports it for the row
        return None
