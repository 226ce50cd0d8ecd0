"""Which special tokens end an assistant turn under a chat template, read off the template by rendering a few
probe conversations (`turn_enders`): an end-of-turn token (`<|im_end|>`, `<|eot_id|>`, Gemma's `<end_of_turn>`), a
token that ends a tool-call turn (`<|call|>`), or, where a template writes none (GLM's), the tag of the turn that
follows (`<|user|>`, `<|observation|>`). A token closing what the turn opened (`</tool_call>`, LFM2's
`<|tool_call_end|>` after `<|tool_call_start|>`) is the turn's text, not its end."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Callable, Optional

from open_sft.data.chat.elements import closes_one_of, opened
from open_sft.data.chat.emptied_trace import doubles_inline, trace_block
from open_sft.data.chat.foreign_fields import openers
from open_sft.data.chat.opened_trace import shared_opening
from open_sft.data.chat.probes import PROBE_TOOLS, PROBE_USER, probe_call, probe_result
from open_sft.data.chat.turns import last_marker_end
from open_sft.data.formats import Messages

Draw = Callable[[Messages, bool, Optional[list]], str]
_TAGS = re.compile(r"<[^<>\s]+>")  # any tag-shaped token: <|im_end|>, <｜Assistant｜>, </s>
_PROBE_ANSWER = {"role": "assistant", "content": "Hello there"}
_PROBE_NEXT = {"role": "user", "content": "Bye now"}
_PROBE_CALL, _PROBE_RESULT = probe_call(), probe_result()


@dataclass(frozen=True)
class TurnEnders:
    """The special tokens that end an assistant turn under a template, longest first (empty: the template
    writes none that this could find, as plain-text templates such as `simple_chat`)."""

    tokens: tuple[str, ...]
    # what the template writes first after a turn that it closes with no end-of-turn token (GLM's): when a
    # user message follows (also what a final answer stops with), and when a tool's result follows a call
    after_answer: str = ""
    after_call: str = ""
    # what generation stops at: what closes a turn that is the last message (not what closes one in history:
    # gpt-oss's <|end|> also ends an analysis the model goes on after), and the tags above; eos first
    stops: tuple[str, ...] = ()
    # what the template writes before and after a trace where it writes one (emptied_trace.py); ("", ""): nowhere
    trace_block: tuple[str, str] = ("", "")
    # what the generation prompt writes to open an assistant turn, which the template writes before the turn too
    # (Gemma 4's `<|turn>model\n`; turn_header); "": none
    header: str = ""
    # the template writes its own block before a content holding a trace in it, so the block twice (doubles_inline)
    inline_doubled: bool = False
    # (separator, eos): a token the template closes every message with that a call turn also writes before its call
    # (GigaChat3's <|message_sep|>: `text<|message_sep|>\n\nfunction call<|role_sep|>\n{...}`), so the model goes
    # on after it and stops with eos, which a turn written as the last message ends with in its place
    eos_in_place: tuple[str, str] = ("", "")
    # (fields, tokens): what the template reads off an assistant message that the model does not write (Gemma 4's
    # tool_responses) and the token it opens that text with inside the turn (<|tool_response>), which the model stops
    # at (foreign_fields.py); ((), ()): none
    foreign: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())

    def as_generated(self, target: str) -> str:
        """`target` (a turn the template writes as the last message) as the model generates it: ending with eos
        where the template closes it with a separator the model goes on after (`eos_in_place`)."""
        separator, eos = self.eos_in_place
        return target[: -len(separator)] + eos if separator and target.endswith(separator) else target

    def last_end(self, text: str) -> int:
        """Where the last end-of-turn token in `text` ends (0: none)."""
        return last_marker_end(text, self.tokens)

    def turn_end(self, target: str) -> int:
        """Where the turn the template writes after its generation prompt (`target`) ends: after its last
        end-of-turn token, or after the first stop token where what follows it opens another turn and writes no
        text, which the model never generates, having stopped (DeepSeek-R1's template writes
        `<｜Assistant｜><｜end▁of▁sentence｜>` once more after a call's `<｜end▁of▁sentence｜>`, for the call's empty
        content; Phi-3's `<|end|>` then eos closes one turn: it trains both); 0: none."""
        end = self.last_end(target)
        firsts = [at + len(token) for token in self.stops if 0 <= (at := target.find(token)) and at + len(token) < end]
        rest = target[min(firsts):] if firsts else ""
        if not _TAGS.sub("", rest).strip() and set(_TAGS.findall(rest)) - set(self.tokens):
            return min(firsts)
        return end

    def generable(self, run: str) -> bool:
        """Whether the model can write `run` (a turn through its end) in one go: no stop token in it with more than
        end-of-turn tokens after it, where generation would have ended (Nemotron-Nano-v2's template writes a last
        turn's content and its calls as two assistant turns, `Let me check.\n<SPECIAL_12>` and then the calls)."""
        firsts = [at + len(token) for token in self.stops if 0 <= (at := run.find(token))]
        rest = run[min(firsts):] if firsts else ""
        for token in self.tokens:
            rest = rest.replace(token, "")
        return not rest.strip()

    def leading(self, text: str, at: int) -> int:
        """The end of the end-of-turn token that `text` has at `at`, after whitespace; 0 if none."""
        start = at + len(text[at:]) - len(text[at:].lstrip())
        for token in self.tokens:
            if text.startswith(token, start):
                return start + len(token)
        return 0

    def stripped(self, text: str) -> str:
        """`text` without the end-of-turn tokens and whitespace it ends with."""
        while True:
            before = text
            text = text.rstrip()
            for token in self.tokens:
                if text.endswith(token):
                    text = text[: -len(token)]
                    break
            if text == before:
                return text


def _candidates(markers: tuple[str, ...], eos: Optional[str], turn: str) -> tuple[str, ...]:
    """Special tokens that may end a turn whose own text (after its generation prompt) is `turn`: any, whatever
    its spelling (Gemma's `<end_of_turn>` too), but a token closing what the turn opened (`</tool_call>` after
    `<tool_call>`, GLM's `</arg_value>`, LFM2's `<|tool_call_end|>` after `<|tool_call_start|>`, Phi-4-mini's
    `<|/tool_call|>`: a tokenizer may mark them special; chat/elements.py), which is the turn's text, and a token
    the turn itself writes before its content (Kimi-K3's `<|close|>think<|sep|><|open|>response<|sep|>`: the model
    writes it and goes on); eos always."""
    names = opened(turn)
    return tuple(m for m in markers if m == eos or not (closes_one_of(m, names) or m in turn))


def _closing_text(tail: str, followed: str, prompt: str) -> str:
    """What the template writes after a turn that is the last message (`tail`), less a generation prompt it writes
    after every conversation (Command R7B's `<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>`): the part that another message
    (`followed`) does not also follow, where the generation prompt ends with it."""
    shared = len(os.path.commonprefix([tail, followed]))
    trailer = tail[shared:].strip()
    return tail[:shared] if trailer and prompt.rstrip().endswith(trailer) else tail


def _first(text: str, tokens: tuple[str, ...]) -> Optional[str]:
    found = [(text.find(token), -len(token), token) for token in tokens if token in text]
    return min(found)[2] if found else None


def turn_enders(draw: Draw, markers: tuple[str, ...], eos: Optional[str],
                history_trains: bool = False, fields: tuple[str, ...] = ()) -> TurnEnders:
    """The tokens this template ends assistant turns with, from probe conversations: those it writes after
    an answer that is the last message; the first it writes after an answer that a user message follows,
    and after a tool call (the last message, or before the tool's result). A probe the template refuses
    (a template without tool calls) tells nothing. `history_trains`: turns in history train with the token
    that closes them there (open_sft's own templates, group_turns' strict=False: OLMo's <|im_end|>, where
    the last turn ends with eos), so that token is a stop too. `fields`: what the template reads off a message that
    the model does not write (foreign_fields.message_fields); the token it opens such text with in a call turn is a
    stop too."""
    found: list[str] = [eos] if eos else []
    stops: list[str] = list(found)
    follows, inside = {}, []

    def add(token: Optional[str]) -> None:
        if token and token not in found:
            found.append(token)

    for kind, last, followed, after in (
            ("answer", [PROBE_USER, _PROBE_ANSWER], [PROBE_USER, _PROBE_ANSWER, _PROBE_NEXT], None),
            ("call", [PROBE_USER, _PROBE_CALL], [PROBE_USER, _PROBE_CALL, _PROBE_RESULT], PROBE_TOOLS)):
        try:
            alone, then = draw(last, False, after), draw(followed, False, after)
            prompt = draw(last[:-1], True, after)
        except Exception:  # noqa: BLE001 (a template without that kind of turn)
            continue
        anchor = "Hello there" if kind == "answer" else "25"
        written = alone.rfind(anchor)
        if written < 0:
            continue
        written += len(anchor)
        start = len(os.path.commonprefix([prompt, alone]))
        if alone.rfind("<", 0, start) > alone.rfind(">", 0, start):  # not from inside a tag both open with (Gemma
            start = alone.rfind("<", 0, start)  # 4's prompt <|channel>, the call's <|tool_call>)
        turn = alone[start: written]
        if kind == "call":  # an answer's closer that the call turn writes before its call: the model goes on there
            inside = [token for token in stops if token != eos and token in turn]
        candidates = _candidates(markers, eos, turn)
        closing = [token for token in candidates if token in _closing_text(alone[written:], then[written:], prompt)]
        for token in closing:  # what it closes the turn with as the last message
            add(token)
            stops.append(token)
        if then.startswith(alone[:written]):  # what it closes it with (or opens next) when another follows
            first = _first(then[written:], candidates)
            add(first)
            if first and not closing:
                follows[kind] = first
            if first and (not closing or history_trains):
                stops.append(first)
    if inside and eos:
        stops = [token for token in stops if token not in inside]
    opening = openers(draw, fields, markers, eos)
    for token in opening:
        add(token)
        stops.append(token)
    block = trace_block(draw)
    return TurnEnders(tuple(sorted(found, key=len, reverse=True)), follows.get("answer", ""), follows.get("call", ""),
                      tuple(dict.fromkeys(stops)), block, turn_header(draw), doubles_inline(draw, block),
                      (inside[0], eos) if inside and eos else ("", ""), (fields, opening) if opening else ((), ()))


def turn_header(draw: Draw) -> str:
    """What the template writes to open an assistant turn where its generation prompt opens one, read off a probe
    answer: the whole tags or lines that the generation prompt after a user message and the answer's rendering share
    (`<|im_start|>assistant\\n`, Gemma 4's `<|turn>model\\n`); "" where they share none (Mistral's prompt opens
    nothing) or the probe is refused."""
    try:
        bare, prompt = draw([PROBE_USER], False, None), draw([PROBE_USER], True, None)
        turn = draw([PROBE_USER, _PROBE_ANSWER], False, None)
    except Exception:  # noqa: BLE001 (a template that refuses the probe tells nothing)
        return ""
    if not (prompt.startswith(bare) and turn.startswith(bare)):
        return ""
    opening = prompt[len(bare):]
    header = opening[: shared_opening(opening, turn[len(bare):])]
    return header if header.strip() else ""


# tag closing an element (</answer>), which a template may write as text
_MARKER = re.compile(r"<\|[^<>|\s]+\|>|<｜[^<>｜\s]+｜>|</s>|<[A-Za-z_][\w-]*>|\[/?[A-Z_]+\]")


def split_turn_closers(draw: Draw, tokenize: Callable[[str], list[str]]) -> list[tuple[str, list[str]]]:
    """The markers the template writes to close an answer (as the last message, and right after it when a user
    message follows), `<|im_end|>`-like or tag-shaped (Gemma's `<end_of_turn>`), that the tokenizer splits into
    several pieces, with the pieces: a template whose tokens are not in the vocabulary trains them as text, and
    generation cannot stop at one id."""
    try:
        alone = draw([PROBE_USER, _PROBE_ANSWER], False, None)
        then = draw([PROBE_USER, _PROBE_ANSWER, _PROBE_NEXT], False, None)
    except Exception:  # noqa: BLE001 (a template that refuses the probe tells nothing)
        return []
    anchor = _PROBE_ANSWER["content"]
    closers = _MARKER.findall(alone[alone.rfind(anchor) + len(anchor):]) if anchor in alone else []
    at = then.find(anchor) + len(anchor)  # what follows the answer at once (not a tag in the next user turn's text)
    following = _MARKER.match(then, at + len(then[at:]) - len(then[at:].lstrip())) if at >= len(anchor) else None
    closers += [following.group()] if following else []
    return [(m, pieces) for m in dict.fromkeys(closers) if len(pieces := tokenize(m)) > 1]
