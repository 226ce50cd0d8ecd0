"""Where chat's /tool results go in the conversation it renders: `tool` messages after the calling reply, or, where
the reply stopped at the token its template opens a message field with that the model does not write (Gemma 4's
`<|tool_response>`, opening `tool_responses` on the calling message: open_sft.data.chat.foreign_fields), entries of
that field on the calling message, as the model was taught to go on: its template writes a `tool` message as a turn
of its own (`<|turn>tool\\n...`), and the model that stops at `<|tool_response>` expects
`<|tool_response>response:get_weather{temp_c:5}<tool_response|>` right after its call, in the same turn.

chat keeps its history as tool messages (a result answers the next call, by id and name) and folds them into the
field when it renders the prompt (`folded`), as llama.cpp does for Gemma 4; a result that is a JSON object is the
entry's `response` as that object (`response:get_weather{temp_c:5}`), other text as it is (`{value:<|"|>...<|"|>}`).
"""

from __future__ import annotations

from typing import Optional

from open_sft.data.chat.foreign_fields import message_fields, openers
from open_sft.data.per_tokenizer import PerTokenizer
from open_sft.export.call_pairs import as_arguments

_FIELDS = PerTokenizer()  # read once per tokenizer, again if its template or tokens change


def result_field(tokenizer, stop_token: Optional[str]) -> Optional[str]:
    """The message field a reply's calls take their results in: the one whose opening token the reply stopped at;
    None (tool messages) where it stopped at another token, or was cut off."""
    template = getattr(tokenizer, "chat_template", None)
    if not stop_token or not isinstance(template, str):
        return None
    return _FIELDS.get(tokenizer, (template, len(tokenizer)), lambda: _field_openers(tokenizer)).get(stop_token)


def _field_openers(tokenizer) -> dict[str, str]:
    """{the token the template opens a field's text with inside a call turn: the field} for the fields it reads off
    a message that the model does not write (none: no probe rendered)."""
    from open_sft.data.chat.render import renderer_for, special_markers

    fields = message_fields(tokenizer.chat_template)
    if not fields:
        return {}
    found, draw, markers = {}, renderer_for(tokenizer), special_markers(tokenizer)
    for name in fields:
        found.update({token: name for token in openers(draw, (name,), markers, tokenizer.eos_token)})
    return found


def folded(messages: list[dict], fields: dict[int, str]) -> list[dict]:
    """`messages` with the tool messages right after message i held in its field `fields[i]` instead, each as an
    entry: the tool message's keys, and its content as the `response` (a JSON object as that object)."""
    shown: list[dict] = []
    owner: Optional[int] = None
    for i, message in enumerate(messages):
        if message["role"] == "tool" and owner is not None:
            response = as_arguments(message["content"])
            entry = {**message, "response": response if isinstance(response, dict) else message["content"]}
            field = fields[owner]
            shown[-1] = {**shown[-1], field: [*(shown[-1].get(field) or []), entry]}
            continue
        owner = i if i in fields else None
        shown.append(message)
    return shown
