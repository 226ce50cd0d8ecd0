"""Every assistant turn trained as the model will generate it, under any chat template.

For assistant turn i the context is what the template renders for the messages before it with the
generation prompt (`prompt_i`), and the trained text is what the template writes for turn i after that
context (`draw(messages[:i+1])` past `prompt_i`) through the token that ends the turn. One rendering of
the whole conversation serves every turn only when the template never rewrites what it wrote: Qwen3's and
GLM-4.5's drop the reasoning of turns before the last user message, gpt-oss's drops the analysis of a
tool call once a final answer follows and writes `<|end|>` in history where the model generated
`<|return|>`. So a conversation becomes as few examples as needed (`group_turns`): the latest turn not yet
trained gives an example, the text through that turn as the template writes it last; every earlier turn
whose context and whole turn that text carries exactly, followed by its end-of-turn token, trains there
too; the rest go to the next example, made the same way.

The end of a turn is what the template writes to end it (`TurnEnders`): an end-of-turn token
(`<|im_end|>`, `<|eot_id|>`, Gemma's `<end_of_turn>`), a token that ends a tool-call turn (`<|call|>`), or,
where a template writes none (GLM's), the tag of the turn that follows (`<|user|>`, `<|observation|>`), which is what the
model generates to stop. Which special tokens play that part is read off the template by rendering a
few probe conversations (turn_enders.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from open_sft.data.chat.elements import closed_block
from open_sft.data.chat.emptied_trace import filled_turn
from open_sft.data.chat.foreign_fields import Span, context_hole
from open_sft.data.chat.opened_trace import opened_turn, shared_opening, worded_turn
from open_sft.data.chat.reasoning import answer_of, trace_of, without_reasoning
from open_sft.data.chat.turn_enders import Draw, TurnEnders
from open_sft.data.chat.turns import call_written
from open_sft.data.formats import Messages, RowError
from open_sft.data.tool_schemas import function_of


@dataclass
class Turn:
    """Assistant message `index` rendered as the last message: its context (`prompt`), what the template
    writes for it after that context (`target`), and where in `target` the turn ends (0: no end-of-turn
    token written; `core` is `target` without its closing tokens). `reasoning_closed`: the generation prompt
    holds what the template writes for the turn without reasoning (the empty think block of Qwen3's
    enable_thinking false), so the model generates none there: `target` is the turn without its trace."""

    index: int
    prompt: str
    target: str
    end: int
    core: str
    reasoning_closed: bool = False
    reasoning_opened: bool = False  # the prompt opens a trace (<think>, words) the template leaves out (opened_trace)
    reasoning_filled: bool = False  # the template writes the turn's think block empty (emptied_trace.py)
    hole: Optional[Span] = None  # [start, end) in `target`: text of a field not the model's, context (foreign_fields)


def render_turn(draw: Draw, messages: Messages, tools: Optional[list], i: int, enders: TurnEnders,
                opens: bool = True) -> Turn:
    """Assistant message i as the model generates it (Turn); `opens`: a generation prompt that opens a reasoning
    block the turn's rendering leaves out trains the turn as written there (opened_trace.py), and a think block the
    template writes empty holds the turn's trace (emptied_trace.py; neither under open-instruct's templates, for
    parity). A turn whose rendering opens with the header a generation prompt writes elsewhere (`enders.header`)
    where its own generation prompt leaves that header out (Gemma 4's after a tool response, `<tool_response|>`, ends
    with no `<|turn>model\n`: the model goes on in the turn it called from) trains without it: the model never
    writes it. Text the template writes in the turn from a field that is not the model's (Gemma 4's tool_responses)
    is context past the token that opens it (`hole`): the turn ends at that token where nothing follows the text,
    and what follows it trains as a run of its own (foreign_fields.py)."""
    where = f"message {i + 1} (assistant)"
    if i == 0:
        raise RowError(f"{where}: the conversation opens with this assistant turn, which has no context to "
                       "render; start the row with the user (or system) message it answers", "no_context")
    prompt, through = draw(messages[:i], True, tools), draw(messages[: i + 1], False, tools)
    closed = opened = False
    if not through.startswith(prompt) and trace_of(messages[i]):
        bare_turn = draw([*messages[:i], without_reasoning(messages[i])], False, tools)
        if bare_turn.startswith(prompt):  # the generation prompt closes the think block before the turn
            through, closed = bare_turn, True
    if through.startswith(prompt):
        target = through[len(prompt):]
    else:
        bare = draw(messages[:i], False, tools)
        target = (opened_turn(messages[i], prompt, bare, through)
                  or worded_turn(draw, messages, tools, i, prompt, bare, through)) if opens else None
        opened = target is not None
        if not opened:
            prompt, target = _turn_after_rewritten_history(prompt, through, bare, messages[i - 1].get("content"))
        if target is None:
            target = _turn_before_trailer(prompt, through, bare, messages[i])
        if target is None:
            raise RowError(f"{where}: {_unlocated(draw, messages, tools, i)}", "turn_not_located")
    if enders.header and target.startswith(enders.header):  # a header the generation prompt leaves out
        target = target[len(enders.header):]
    filled = None if closed or opened or not opens else filled_turn(messages[i], target, enders.trace_block)
    target = enders.as_generated(filled or target)
    hole = context_hole(draw, messages, tools, i, target, enders.foreign)
    end = hole[0] if hole and not target[hole[1]:].strip() else enders.turn_end(target)
    written = target[:end] if end else target
    if not all(enders.generable(run) for run in ([written[: hole[0]], written[hole[1]:]] if hole else [written])):
        prompt, target = _as_in_history(draw, messages, tools, i, enders)
        end, hole = enders.turn_end(target), None
    core = enders.stripped(target[:end]) if end else target.rstrip()
    return Turn(i, prompt, target, end, core, closed, opened, filled is not None, hole)


def _as_in_history(draw: Draw, messages: Messages, tools: Optional[list], i: int, enders: TurnEnders
                   ) -> tuple[str, str]:
    """The context and the text through its stop token of assistant turn i as the template writes it in history
    (once a message follows it), for a turn whose rendering as the last message holds a stop token with more text
    after it, which the model, having stopped there, never writes: Nemotron-Nano-v2's template writes a last turn
    with content and calls as two assistant turns (`Let me check.\n<SPECIAL_12>\n\n<SPECIAL_11>Assistant\n
    <TOOLCALL>[...]`), and in history as one (`Let me check.\n\n<TOOLCALL>[...]</TOOLCALL>\n<SPECIAL_12>`), as the
    model generates it. The context is as much of the generation prompt as that turn writes (as for any turn whose
    rendering does not follow the generation prompt: _turn_after_rewritten_history)."""
    message = messages[i]
    calls = message.get("tool_calls") or []
    following = messages[i + 1: i + 2] or [_probe_follower(calls)]
    prompt, bare = draw(messages[:i], True, tools), draw(messages[:i], False, tools)
    try:
        history = draw([*messages[: i + 1], *following], False, tools)
    except RowError:
        history = ""
    if prompt.startswith(bare) and history.startswith(bare):
        shared = shared_opening(prompt[len(bare):], history[len(bare):])
        turn = history[len(bare) + shared:]
        ends = [at + len(token) for token in enders.stops if 0 <= (at := turn.find(token))]
        turn = turn[: min(ends)] if ends else ""
        said = answer_of(message)
        if turn and said in turn and not call_written(message, turn):
            return prompt[: len(bare) + shared], turn
    carried = _carried_call_state(draw, messages, tools, i)  # R1's second call turn with content lands here
    if carried:
        raise RowError(f"message {i + 1} (assistant): {carried}", "turn_not_located")
    raise RowError(f"message {i + 1} (assistant): the chat template writes this turn, as the last message, past a "
                   "token that ends generation, so the model cannot write it as the template does (it stops there), "
                   "and its history does not show the turn whole either; choose another template",
                   "turn_not_generable")


def _probe_follower(calls: list) -> dict:
    """A message to follow a turn that ends the row, so that the template writes the turn as history."""
    if not calls:
        return {"role": "user", "content": "Thanks."}
    first = calls[0] if isinstance(calls[0], dict) else {}
    function = function_of(first)
    return {"role": "tool", "content": "{}", **({"tool_call_id": first["id"]} if first.get("id") else {}),
            **({"name": function["name"]} if isinstance(function, dict) and function.get("name") else {})}


def _unlocated(draw: Draw, messages: Messages, tools: Optional[list], i: int) -> str:
    """Why assistant turn i cannot be located after its generation prompt (_carried_call_state, else in general)."""
    return _carried_call_state(draw, messages, tools, i) or (
        "what the template writes for this turn does not follow the generation prompt it renders for the messages "
        "before it, so the turn cannot be located; choose another template")


def _carried_call_state(draw: Draw, messages: Messages, tools: Optional[list], i: int) -> Optional[str]:
    """What is wrong, where assistant turn i is a call turn after an earlier one that the template writes without
    the opening it gives a row's first call turn (DeepSeek-R1 distills': its state, ns.is_first, is never reset, so
    a second call turn lacks `<｜Assistant｜><｜tool▁calls▁begin｜>`); None otherwise."""
    start = next(k for k, m in enumerate(messages) if m["role"] == "assistant")
    if not messages[i].get("tool_calls") or not any(m.get("tool_calls") for m in messages[start:i]):
        return None
    alone = [*messages[:start], messages[i]]  # the same call turn as the row's first
    try:
        first = draw(alone, False, tools)[len(draw(alone[:-1], False, tools)):]
        bare, through = draw(messages[:i], False, tools), draw(messages[: i + 1], False, tools)
    except RowError:
        return None
    later = through[len(os.path.commonprefix([bare, through])):]
    opening = first[: len(first) - len(os.path.commonprefix([first[::-1], later[::-1]]))]
    if not opening.strip() or opening.strip() in later:
        return None
    return (f"the template writes this call turn, after an earlier call turn, without the opening it writes for a "
            f"row's first call turn ({opening.strip()!r}): it cannot render a conversation with more than one call "
            "turn (its state carries over from the first). Keep one call turn a row under it, or choose another "
            "template")


def _turn_after_rewritten_history(prompt: str, through: str, bare: str, previous: object = None
                                  ) -> tuple[str, Optional[str]]:
    """The context and what the template writes for a turn whose rendering as the last message is not its
    generation prompt's continuation; (prompt, None) where it cannot be told.

    - A generation prompt that opens more than the turn writes (a thinker's "<think>", which the turn writes
      from its content): the context is as much of the prompt as the turn's rendering shares, in whole tags or
      lines (R1's "<think>\n" before a turn that writes a tool call: none of it, not the "<" both open with). One
      that ends with a block it opens and closes, which the turn does not write (Gemma 4's empty thought channel,
      `<|channel>thought\n<channel|>`): the whole prompt is the context, as at inference.
    - A template that rewrites earlier turns once this one follows them (gpt-oss drops the analysis of a tool
      call once a final answer follows; Mistral v0.3's and Nemo's write the system prompt into the last user
      turn only while it is the last message; Hermes 2 Pro's and 3's close a tool result `</tool_response>\n
      <|im_end|>` once a turn follows it, `</tool_response><|im_end|>` while it is the last message): the turn is
      what follows, in `through`, the end of the messages before it (the longest end of their rendering that
      `through` has followed by the generation prompt's text) and that text. Where the
      generation prompt opens nothing (Mistral's), that end must reach into the text of the message before the
      turn (`previous`, its content), not only the tags the template closes it with."""
    if not prompt.startswith(bare):
        return prompt, None
    opening = prompt[len(bare):]
    if through.startswith(bare):
        shared = shared_opening(opening, through[len(bare):])
        if closed_block(opening[shared:]):  # an empty thought block the prompt closes: context, as at inference
            return prompt, through[len(bare) + shared:]
        return prompt[: len(bare) + shared], through[len(bare) + shared:]
    low, high = 0, len(bare)  # the longest end of `bare` that `through` has before the generation prompt's text
    while low < high:  # (shorter ends have it too)
        middle = (low + high + 1) // 2
        if through.find(bare[len(bare) - middle:] + opening) >= 0:
            low = middle
        else:
            high = middle - 1
    if low == 0 or not opening and not _reaches_into(bare, low, previous):
        return prompt, None
    return prompt, through[through.rfind(bare[len(bare) - low:] + opening) + low + len(opening):]


def _turn_before_trailer(prompt: str, through: str, bare: str, message: dict) -> Optional[str]:
    """What the template writes for a turn where it writes the same text after whatever message comes last,
    generation prompt or not (Hunyuan's, with enable_thinking false, ends every rendering with
    `<think>\n\n</think>\n`): that trailer is the end `bare` and `through` share, from a whole tag or line on; the
    turn is what `through` holds between the messages before it and the trailer. The context stays the whole prompt,
    trailer and all, as the model sees it at inference. None where the prompt does not end with such a trailer, or
    the text between does not hold the turn's content and its calls' names."""
    shared = min(len(os.path.commonprefix([bare[::-1], through[::-1]])), len(bare) - 1)
    while shared > 0 and not (bare[-shared - 1] == ">" or bare[-shared - 1].isspace()):
        shared -= 1
    trailer, before = bare[len(bare) - shared:], bare[: len(bare) - shared]
    if not trailer.strip() or not prompt.endswith(trailer) or not through.startswith(before) or (
            len(through) - shared < len(before)):
        return None
    turn = through[len(before): len(through) - shared]
    said = [answer_of(message)] + [
        f["name"] for f in map(function_of, message.get("tool_calls") or []) if isinstance(f, dict)
        and isinstance(f.get("name"), str)]
    return turn if all(piece in turn for piece in said) else None


def _reaches_into(bare: str, length: int, previous: object) -> bool:
    """Whether the last `length` characters of `bare` (the messages before a turn) hold some of the text of
    the message before the turn (`previous`, its content), not only what the template writes after it."""
    text = previous.strip() if isinstance(previous, str) else ""
    at = bare.rfind(text) if text else -1
    return at >= 0 and length > len(bare) - at - len(text)


def _closer(messages: Messages, turn: Turn, enders: TurnEnders) -> str:
    """The token the model generates to end this turn: the first end-of-turn token after what it writes, or,
    for a template that writes none, the tag of the turn after it."""
    if not turn.end:
        return _follow_tag(messages, turn, enders)
    rest = turn.target[len(turn.core): turn.end]
    at = enders.leading(rest, 0)
    return rest[:at].strip()


def _follow_tag(messages: Messages, turn: Turn, enders: TurnEnders) -> str:
    """For a template that writes no end-of-turn token (GLM's): the tag of the turn after this one, which the
    model generates to stop: a tool result's after a call (also where the call ends the row: a single-turn
    function-calling row, or one whose result was left out after the last assistant turn), else a user's (""
    when the probes found none)."""
    message = messages[turn.index]
    following = messages[turn.index + 1]["role"] if turn.index + 1 < len(messages) else "user"
    calls = message.get("tool_calls") or message.get("function_calls")
    return enders.after_call if (calls or following == "tool") and enders.after_call else enders.after_answer


@dataclass(frozen=True)
class TurnExample:
    """One example of a conversation: its text and the assistant turns it trains, each as
    (message index, [start, end) of the turn's text in it)."""

    text: str
    turns: tuple[tuple[int, tuple[int, int]], ...]


def group_turns(draw: Draw, messages: Messages, tools: Optional[list], indices: list[int],
                enders: TurnEnders, strict: bool = True, contiguous: bool = False
                ) -> tuple[list[TurnExample], dict[int, Turn]]:
    """The conversation's examples (in conversation order) training the assistant turns `indices`, each turn
    in exactly one, after the context the template gives it, and each turn's rendering as the last message.
    `strict`: an earlier turn trains in a later example only where it is closed there by the token that closes
    it as the last message (not so under open-instruct's templates, for parity: OLMo's closes the final turn
    with eos and earlier ones with <|im_end|>, which open-instruct trains; nor does a turn after a generation prompt
    opening a think block it leaves out train as written there: render_turn). `contiguous`: an example trains a run
    of consecutive turns (what kept_history joins), not also an earlier one beyond a turn it cannot train."""
    turns = {i: render_turn(draw, messages, tools, i, enders, opens=strict) for i in indices}
    examples: list[TurnExample] = []
    left = sorted(indices)
    while left:
        last = turns[left.pop()]
        text = last.prompt + last.target
        end = len(last.prompt) + last.end
        if not last.end and enders.tokens:
            tag = _follow_tag(messages, last, enders)
            text = last.prompt + last.core + tag
            end = len(text) if tag else len(last.prompt) + len(last.core)
        trained = [(last.index, (len(last.prompt), end))]
        for i in reversed(left[:]):
            turn = turns[i]
            start = len(turn.prompt)
            if not text.startswith(turn.prompt) or not text.startswith(turn.core, start):
                if contiguous:
                    break
                continue
            core_end = start + len(turn.core)
            closed = enders.leading(text, core_end) if enders.tokens else core_end
            # closed by what the model generates to end it: gpt-oss writes <|end|> after an answer in history,
            # where the model generated <|return|> (that answer makes an example of its own)
            if not closed or strict and enders.tokens and text[core_end:closed].strip() != _closer(messages, turn, enders):
                if contiguous:
                    break
                continue
            trained.append((i, (start, closed)))
            left.remove(i)
        examples.append(TurnExample(text, tuple(sorted(trained))))
    return examples[::-1], turns


def _history_end(draw: Draw, messages: Messages, tools: Optional[list], j: int, enders: TurnEnders) -> Optional[str]:
    """The text of the conversation through assistant turn j as the template writes it once the next message
    follows (in history), through the token that closes the turn there; None where it is not found. The turn's
    last writing is found by what it ends with: its content (what follows a trace written in it, `<think>trace
    </think>answer`, which templates keep alone in history), else its last tool call's name."""
    calls = messages[j].get("tool_calls") or []
    anchor = answer_of(messages[j]) or (
        calls and (calls[-1].get("function") or calls[-1]).get("name"))
    if not isinstance(anchor, str) or not anchor or j + 1 >= len(messages):
        return None
    try:
        history = draw(messages[: j + 2], False, tools)
    except RowError:
        return None
    following = messages[j + 1].get("content")
    limit = history.rfind(following) if isinstance(following, str) and following.strip() else len(history)
    at = history.rfind(anchor, 0, max(limit, 0))
    if at < 0:
        return None
    ends = [(history.find(token, at + len(anchor)), token) for token in enders.tokens]
    ends = [(where, token) for where, token in ends if 0 <= where < limit]
    if not ends:
        return None
    where, token = min(ends)
    return history[: where + len(token)]


def kept_history(draw: Draw, messages: Messages, tools: Optional[list], examples: list[TurnExample],
                 enders: TurnEnders) -> Optional[TurnExample]:
    """--reasoning_history keep: a conversation's examples joined into one, each turn as the model generates it
    and earlier turns kept as they were generated (their reasoning in the context of later ones, as TRL's
    training templates keep it), rather than as the template rewrites history. Example b goes on from where
    the last turn of example a ends: the end of that turn as the template writes it in history (`_history_end`;
    example b must start with that text). None where the examples cannot be joined so (the caller keeps them
    apart)."""
    text, spans = examples[0].text, dict(examples[0].turns)
    for previous, example in zip(examples, examples[1:]):
        j = max(i for i, _ in previous.turns)
        closed = _history_end(draw, messages, tools, j, enders)
        if not closed or not example.text.startswith(closed) or min(a for _, (a, _) in example.turns) < len(closed):
            return None
        closed = len(closed)
        cut = spans[j][1]
        text = text[:cut] + example.text[closed:]
        spans.update({i: (a + cut - closed, b + cut - closed) for i, (a, b) in example.turns})
    return TurnExample(text, tuple(sorted(spans.items())))


# what reads as one token: <|im_end|>, DeepSeek's <｜end▁of▁sentence｜>, </s>, Gemma's <end_of_turn>, [/INST]; not a