"""The header of a call in a model's own order, where it differs from its template's (open_sft.export.tool_calls).

gpt-oss's template writes the recipient before the channel (`<|start|>assistant to=functions.NAME<|channel|>commentary
json<|message|>{...}`), and the model often writes it after (`<|start|>assistant<|channel|>commentary
to=functions.NAME <|constrain|>json<|message|>{...}`), or says a line on the call's channel first (a preamble:
`<|channel|>commentary<|message|>Let me check.<|end|><|start|>assistant to=functions...`). The call reads either
way (its arguments follow the header's last word, `json<|message|>`); the text before it is cleaned here, with
what the template itself writes: the call's `channel` (the header less that last word) and the message opening
on it (the channel and the last word's special part: `<|channel|>commentary<|message|>`). Layouts without a
channel in the call's header (Qwen3's, GLM's, Mistral's) are left as they are.
"""

from __future__ import annotations

import re


def _without_suffix(text: str, suffix: str) -> str:
    """`text` less `suffix` at its end (spacing aside), as it was where it does not end so."""
    trimmed = text.rstrip()
    return trimmed[:-len(suffix)] if suffix and trimmed.endswith(suffix) else text


def split_head(head: str, channel: str, arguments_after: str, before_call: str) -> tuple[str, str]:
    """(the text before a call, less what a template writes between a trace and a call (`before_call`) and the
    call's `channel` written before its recipient; a preamble on that channel, as text: "" where none)."""
    if channel:
        head = re.sub(r"\s*" + r"\s*".join(map(re.escape, channel.split())) + r"\s*$", "", head)
    head = _without_suffix(head, before_call)
    opening = channel + re.sub(r"^\w+", "", arguments_after) if channel else ""
    if not opening or opening == channel or opening not in head:
        return head, ""
    head, _, preamble = head.rpartition(opening)
    return _without_suffix(head, before_call), preamble.strip()
