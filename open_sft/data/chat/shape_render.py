"""One template render per conversation shape (the sequence of roles), with holes where the contents go.

The label step needs, for each assistant turn, where its prompt ends, where its content starts (its
hole: a search for the content could find it in text the template writes before it, such as an empty
`<think>` block) and where its turn ends in the rendered text. Rendering the two prefixes of every row
(render.py's definition) costs two more template renders per assistant turn: most of a build's time.
Rows share few shapes (the sequence of roles), so for each shape the prefixes are rendered once with
placeholder contents, and the result is kept as a shape render: the literal text between content holes, and
each prefix's end and each content's start as a place in it.

A row of that shape is still rendered by the real template (so its text is always exactly the
template's), and its prefix ends are read off the shape render only if the shape render, filled with the row's
contents (as they are, or stripped, for templates that `trim` them), is that very text. A template that
reads the contents (branches on them, renders one twice) fails that test and the row takes the
prefix-rendering path. The label check (data/labels.py) verifies every row's trained tokens either way.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from dataclasses import dataclass
from itertools import accumulate
from typing import Callable, Optional

_HOLE = "\x00{}\x00"  # the placeholder for message j's content: a string no template writes by itself
_HOLE_PATTERN = re.compile("\x00(\\d+)\x00")


@dataclass(frozen=True)
class ShapeRender:
    text_format: str  # the shape's literal text, "{}" where each hole's content goes (other braces doubled)
    holes: tuple[int, ...]  # the message whose content fills each hole, in text order
    # assistant message i → for the end of its prompt, the start of its content (its hole) and the end
    # of its turn: (holes before that place, literal characters before it)
    ends: dict[int, tuple[int, int, int, int, int, int]]

    def prefix_ends(self, contents: list[str], text: str) -> Optional[dict[int, tuple[int, int, int]]]:
        """Assistant message i → (prompt length, where its content as written starts, length through its
        turn) in `text`, or None when the shape render filled with these contents (as they are, or stripped)
        is not `text`."""
        inserted = [contents[j] for j in self.holes]
        if self.text_format.format(*inserted) != text:
            inserted = [content.strip() for content in inserted]
            if self.text_format.format(*inserted) != text:
                return None
        return self._ends(inserted)

    def fill(self, contents: list[str], trimmed: bool) -> tuple[str, dict[int, tuple[int, int, int]]]:
        """The text of a row of this shape and its prefix ends, for a template known to write each
        content once, in order, as it is (or stripped) and nothing that depends on it (templates.py)."""
        inserted = contents if len(self.holes) == len(contents) else [contents[j] for j in self.holes]  # holes ascend
        if trimmed:
            inserted = [content.strip() for content in inserted]
        return self.text_format.format(*inserted), self._ends(inserted)

    def _ends(self, inserted: list[str]) -> dict[int, tuple[int, int, int]]:
        content_chars = [0, *accumulate(map(len, inserted))]
        return {i: (p + content_chars[slots_p], c + content_chars[slots_c], t + content_chars[slots_t])
                for i, (slots_p, p, slots_c, c, slots_t, t) in self.ends.items()}


Draw = Callable[[list, bool, Optional[list]], str]


def render_shape(draw: Draw, roles: tuple[str, ...]) -> Optional[ShapeRender]:
    """The shape render of conversations with these roles, or None when the template does not give one
    (it renders a content twice or out of order, is not prefix-stable, or raises)."""
    messages = [{"role": role, "content": _HOLE.format(j)} for j, role in enumerate(roles)]
    try:
        full = draw(messages, False, None)
        matches = list(_HOLE_PATTERN.finditer(full))
        holes = tuple(int(match.group(1)) for match in matches)
        if list(holes) != sorted(set(holes)):
            return None
        slot_ends = [match.end() for match in matches]
        placeholder_chars = [0, *accumulate(match.end() - match.start() for match in matches)]

        def place(length: int) -> Optional[tuple[int, int]]:
            """(holes before, literal characters before) a prefix of `length` characters; None if it
            ends inside a placeholder."""
            before = bisect_right(slot_ends, length)
            if before < len(matches) and matches[before].start() < length:
                return None
            return before, length - placeholder_chars[before]

        ends = {}
        for i, role in enumerate(roles):
            if role != "assistant":
                continue
            prompt = draw(messages[:i], True, None)
            through = full if i == len(roles) - 1 else draw(messages[: i + 1], False, None)
            prompt_end, through_end = place(len(prompt)), place(len(through))
            if i not in holes or not (full.startswith(prompt) and full.startswith(through)) \
                    or prompt_end is None or through_end is None:
                return None
            hole = holes.index(i)
            content_start = (hole, matches[hole].start() - placeholder_chars[hole])
            if not prompt_end <= content_start < through_end:
                return None
            ends[i] = (*prompt_end, *content_start, *through_end)
        literals = _HOLE_PATTERN.split(full)[0::2]
        text_format = "{}".join(literal.replace("{", "{{").replace("}", "}}") for literal in literals)
        return ShapeRender(text_format, holes, ends)
    except Exception:  # a template that rejects this shape: the prefix path reports it for the row
        return None
