"""Tags that open and close an element inside an assistant turn, in the spellings templates give them.

A token that closes what the turn itself opened is the turn's text, never its end, whatever its spelling: XML-like
`<tool_call>` … `</tool_call>` (Seed-OSS's `<seed:tool_call>` … `</seed:tool_call>`, MiniMax-M2's
`</minimax:tool_call>`), `<|tool_call|>` … `<|/tool_call|>` (Phi-4-mini's), `<|tool_call_begin|>` …
`<|tool_call_end|>` (Kimi-K2's; DeepSeek's `<｜tool▁call▁end｜>`; LFM2's `<|tool_call_start|>` … `<|tool_call_end|>`),
`<|START_RESPONSE|>` … `<|END_RESPONSE|>` (Command R7B's) and Gemma 4's halves, `<|tool_call>` … `<tool_call|>`. Taken
for the end of the turn, such a token cut the turns in history short of their real end of turn (`<|end|>`,
`<|im_end|>`, `<turn|>`), and generation stopped after a turn's first call.
"""

from __future__ import annotations

import re

# <x>, </x>, <|x|>, <|/x|>, <ns:x>, DeepSeek's <｜tool▁call▁end｜>
_ELEMENT = re.compile(r"<([|｜]?)(/?)([A-Za-z_][\w:.▁-]*)\1>")
# Gemma 4's halves: <|tool_call> opens, <tool_call|> closes
_HALF = re.compile(r"<(\|)?([A-Za-z_][\w:.▁-]*)(\|)?>")
_TAG = re.compile(r"<[|｜]?/?[A-Za-z_][\w:.▁-]*[|｜]?>")
# <|START_RESPONSE|> and <|END_RESPONSE|>; <|tool_call_begin|> and <|tool_call_end|>
_PREFIXED = re.compile(r"(start|begin|open|end|close)[_▁](.+)", re.IGNORECASE)
_SUFFIXED = re.compile(r"(.+)[_▁](start|begin|open|end|close)", re.IGNORECASE)


def element(tag: str) -> tuple[str, bool] | None:
    """(the element's name, whether `tag` closes it) for a tag-shaped token; None for any other text."""
    found = _ELEMENT.fullmatch(tag)
    if found is None:
        half = _HALF.fullmatch(tag)
        if half is None or bool(half.group(1)) == bool(half.group(3)):
            return None
        return half.group(2).lower(), bool(half.group(3))
    name = found.group(3)
    for pattern, word, rest in ((_PREFIXED, 1, 2), (_SUFFIXED, 2, 1)):
        paired = pattern.fullmatch(name)
        if paired:
            return paired.group(rest).lower(), bool(found.group(2)) or paired.group(word).lower() in ("end", "close")
    return name.lower(), bool(found.group(2))


def opened(text: str) -> set[str]:
    """The elements `text` opens and leaves open (a call's `<tool_call>` before its arguments)."""
    depth: dict[str, int] = {}
    for name, closing in filter(None, map(element, _TAG.findall(text))):
        depth[name] = depth.get(name, 0) + (-1 if closing else 1)
    return {name for name, count in depth.items() if count > 0}


def closed_block(text: str) -> bool:
    """Whether `text` closes an element it opens and leaves none open: an empty thought block a generation prompt
    ends with (Gemma 4's `<|channel>thought\n<channel|>`)."""
    tags = list(filter(None, map(element, _TAG.findall(text))))
    return not opened(text) and any(not closing and (name, True) in tags for name, closing in tags)


def closes_one_of(tag: str, names: set[str]) -> bool:
    """Whether `tag` closes one of the elements `names`."""
    found = element(tag)
    return found is not None and found[1] and found[0] in names
