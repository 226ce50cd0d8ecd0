"""The probe call open_sft.export.tool_calls renders through a chat template to find its layout of a call, given
in the form the template takes it:

- its arguments as a JSON object, or as JSON text where the template takes them so, as the data side decides it
  (open_sft.data.chat.tool_arguments: it fails on an object, writing them by string concatenation, DeepSeek-V3.1's
  `NAME<｜tool▁sep｜>` + arguments and the R1 distills' `'```json\\n'` + arguments; or writes an object as Python's
  repr, Apriel-1.5's `|string`): a model trained by open_sft writes the arguments as JSON there;
- its id in the form its model generates (ID_FORMS) where the template writes the id in the name's place (Kimi-K2's
  `<|tool_call_begin|>{id}<|tool_call_argument_begin|>{arguments}`, its models' ids `functions.NAME:INDEX`): the
  name is read back out of a reply's id by the form the probe shows (`functions.` before the name, `:` and a number
  after it), and an id not in that form names no call (the call is unreadable, never a wrong one).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from open_sft.data.chat.opened_trace import shared_opening
from open_sft.export.call_pairs import PROBE_ARGUMENTS

PROBE_NAME, PROBE_ID = "probe_fn_3a7c", "a1b2c3d4e"  # Mistral's templates take 9-character alphanumeric ids
PROBE_TOOLS = [{"type": "function", "function": {
    "name": PROBE_NAME, "description": "A probe.", "parameters": {"type": "object", "properties": {
        "probe_key_1": {"type": "string"}, "probe_key_2": {"type": "integer"}}, "required": ["probe_key_1"]}}}]
# ids that carry the call's name, as models generate them: Kimi-K2's (Moonshot's docs, vLLM's kimi_k2 tool parser)
ID_FORMS = ("functions.{name}:{index}",)
NAME_CHARS = r"[A-Za-z0-9_.:\-]"  # OpenAI's function names, and namespaced ones


@dataclass(frozen=True)
class ProbeForm:
    """How the template takes the probe call: its `arguments` (an object or JSON text), its `call_id`, and where the
    template writes the id as the name, the id as it `shows` it (read as the probe's name: `reply`)."""

    arguments: Any = field(default_factory=lambda: PROBE_ARGUMENTS)
    call_id: str = PROBE_ID
    shows: str = ""

    def message(self, content: str = "", reasoning: Optional[str] = None, calls: int = 1) -> dict:
        call = {"id": self.call_id, "type": "function", "function": {"name": PROBE_NAME, "arguments": self.arguments}}
        message = {"role": "assistant", "content": content, "tool_calls": [call] * calls}
        return {**message, "reasoning_content": reasoning} if reasoning is not None else message

    def reply(self, tokenizer, content: str = "", reasoning: Optional[str] = None, calls: int = 1) -> Optional[str]:
        """What the template writes for the probe message after the generation prompt (rendered_reply), the id it
        writes as a name replaced by the probe's name."""
        text = rendered_reply(tokenizer, self.message(content, reasoning, calls))
        return text.replace(self.shows, PROBE_NAME) if text is not None and self.shows else text

    @property
    def id_name(self) -> str:
        """A regex reading a call's name (its group) out of an id in the form the template shows: "" where it writes
        names."""
        if not self.shows:
            return ""
        before, _, after = self.shows.partition(PROBE_NAME)
        return _numbered(before) + f"({NAME_CHARS}+?)" + _numbered(after)


def _numbered(text: str) -> str:
    """`text` as a regex, any number in it any number (a call's index)."""
    return "".join(r"\d+" if part.isdigit() else re.escape(part) for part in re.split(r"(\d+)", text) if part)


def rendered_reply(tokenizer, message: dict) -> Optional[str]:
    """What the template writes for `message` after the generation prompt (None where it fails or differs), or
    after as much of it as the message's rendering shares where the prompt opens a think block that a call without
    a trace leaves out (MiniMax-M2's `]~b]ai\n<think>\n`: the reply reads past its `</think>`)."""
    question = [{"role": "user", "content": "Q"}]
    try:
        prompt = tokenizer.apply_chat_template(question, tools=PROBE_TOOLS, add_generation_prompt=True, tokenize=False)
        full = tokenizer.apply_chat_template(question + [message], tools=PROBE_TOOLS, tokenize=False)
        bare = tokenizer.apply_chat_template(question, tools=PROBE_TOOLS, tokenize=False)
    except Exception:  # noqa: BLE001  (a template that cannot render the probe writes no calls we can read)
        return None
    if full.startswith(prompt):
        return full[len(prompt):]
    if not (prompt.startswith(bare) and full.startswith(bare)):
        return None
    return full[len(bare) + shared_opening(prompt[len(bare):], full[len(bare):]):]


def probe_form(tokenizer, reads: Callable[[str], bool]) -> Optional[ProbeForm]:
    """The first form of the probe call whose rendering `reads` as a call (module docstring), None where none does."""
    as_object = rendered_reply(tokenizer, ProbeForm().message())
    forms = [(PROBE_ARGUMENTS, as_object)]
    if as_object is None or str(PROBE_ARGUMENTS) in as_object:  # it takes the arguments as JSON text
        as_text = json.dumps(PROBE_ARGUMENTS)
        forms.append((as_text, rendered_reply(tokenizer, ProbeForm(as_text).message())))
    for arguments, text in forms:
        if text is None:
            continue
        if reads(text):
            return ProbeForm(arguments)
        if PROBE_NAME in text or PROBE_ID not in text:
            continue
        for form in ID_FORMS:  # the template writes the id where a name would be
            call_id = form.format(name=PROBE_NAME, index=0)
            shown = rendered_reply(tokenizer, ProbeForm(arguments, call_id).message()) or ""
            word = re.search(f"{NAME_CHARS}*{re.escape(PROBE_NAME)}{NAME_CHARS}*", shown)
            if word and word.group() != PROBE_NAME and reads(shown.replace(word.group(), PROBE_NAME)):
                return ProbeForm(arguments, call_id, word.group())
    return None


def name_in_id(id_name: str, written: str) -> Optional[str]:
    """The call's name read out of the id it wrote in the name's place, by the template's form (`id_name`, a regex):
    None where the id is not in that form (it names no call). Where the template writes names: the name written."""
    if not id_name:
        return written
    match = re.fullmatch(id_name, written)
    return match.group(1) if match else None
