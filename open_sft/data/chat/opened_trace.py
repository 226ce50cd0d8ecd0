"""Turns under a template whose generation prompt opens a reasoning block that its rendering of the turn leaves out.

DeepSeek-R1 distills' template ends the generation prompt with `<｜Assistant｜><think>\\n` and writes every assistant
content only after its `</think>`, the last turn's too; QwQ's does the same after `<|im_start|>assistant\\n<think>\\n`;
DeepSeek-V3.1's in thinking mode opens `<think>` and writes a turn `</think>answer`. The model writes after that prompt
its trace, the block's closer, the answer and the end of its turn; the template's own rendering of the turn holds
neither the opening nor the trace. So the turn trains what the model writes there (`opened_turn`), after the
generation prompt as it is at inference, the earlier turns in it as the template writes history (their traces
dropped, as the model sees them):

- The opening is what the generation prompt writes past the whole tags the turn's rendering shares with it (R1's
  `<｜Assistant｜>`): one tag that it leaves open, and the whitespace after it (`<think>\\n`). The closer is that
  tag's closing tag (`</think>`).
- A trace written in the content (`<think>trace</think>answer`, or `trace</think>answer`) trains as the content has
  it: from after its opening tag (less the whitespace the prompt already wrote) through the last closer and the
  whitespace after it. A trace given as a field (`reasoning_content`), or none at all (an empty block: at inference
  the model has to close the block the prompt opened), is closed as the prompt opened it: the opening's whitespace
  before the closer and twice that after it (`\\n</think>\\n\\n` after R1's and QwQ's `<think>\\n`, the block as
  DeepSeek and Qwen write it, and the template of a Qwen3 Thinking-2507 model for the turn it writes; `</think>`
  right after V3.1's `<think>`, as its template writes history).
- Then what the template writes for the turn, its leading whitespace (and a closer it writes itself: V3.1's) left
  out: the answer and the end of the turn.

The template's rendering of the conversation with the turn's content replaced by what the model wrote (the opening,
then that text) is its rendering of the row: it writes the generated turn in history as it writes the data's (tested).
Turns that write tool calls keep the context their rendering shares with the prompt (turn_render's
`_turn_after_rewritten_history`), and open-instruct's templates (`tulu_thinker_r1_style`, which keeps only the answer)
are left as open-instruct trains them: the caller asks only where neither holds.

A generation prompt may open the trace with words instead of a tag: Apriel-1.6's ends `<|begin_assistant|>\nHere are
my reasoning steps:\n`, and its rendering of the turn writes the trace (then `\n[BEGIN FINAL RESPONSE]\n` and the
answer) where those words stand, without them. Read off the template (`worded_turn`): the prompt's words past what
the turn shares with it hold no tag, and the turn rendered with a trace writes it right there. The turn trains what
the template writes for it there, after the whole prompt; a turn without a trace (an answer, a call) trains an empty
one closed as the template closes a trace (`\n[BEGIN FINAL RESPONSE]\n`, read off the turn rendered with a probe
trace), for the model has to close the trace the prompt opened.
"""

from __future__ import annotations

import os
import re
from typing import Callable, Optional

from open_sft.data.chat.reasoning import REASONING_KEYS, answer_of, reasoning_of

_OPENING = re.compile(r"<([A-Za-z_][\w-]*)>(\s*)")  # one tag opened, then whitespace: "<think>\n"
_TAG = re.compile(r"<[^<>]*>|\[[^\[\]]*\]")  # a tag or a bracketed token: <think>, [THINK]
_PROBE_TRACE = "probe trace"


def shared_opening(opening: str, turn: str) -> int:
    """How much of the generation prompt's `opening` (what it writes after the messages before the turn) the turn's
    own rendering `turn` writes too, in whole tags or lines (R1's `<｜Assistant｜>`, not the "<" of `<think>` that a
    tool call's `<｜tool▁calls▁begin｜>` opens with too)."""
    shared = len(os.path.commonprefix([opening, turn]))
    while 0 < shared < len(opening) and not (opening[shared - 1] == ">" or opening[shared - 1].isspace()):
        shared -= 1
    return shared


def opened_turn(message: dict, prompt: str, bare: str, through: str) -> Optional[str]:
    """What the model writes after the generation prompt `prompt` for assistant `message` where that prompt opens a
    reasoning block its rendering of the turn (`through`, the conversation through it; `bare`, the messages before it
    without the generation prompt) does not write (module doc); None where that is not so (the caller locates the
    turn as before)."""
    if message.get("tool_calls") or not (prompt.startswith(bare) and through.startswith(bare)):
        return None
    opening, turn = prompt[len(bare):], through[len(bare):]
    shared = shared_opening(opening, turn)
    opened = _OPENING.fullmatch(opening[shared:])
    if opened is None:
        return None
    tag, space = opened.group(1), opened.group(2)
    start, closer = f"<{tag}>", f"</{tag}>"
    written = turn[shared:]
    trace = _inline(message.get("content"), start, closer, space) or _as_opened(reasoning_of(message), space, closer)
    said, answer = trace[: trace.rindex(closer)].strip(), answer_of(message)
    beside = written.replace(answer, "", 1) if answer else written  # a trace may recur in the answer ("42")
    if start in written or said and said in beside:
        return None  # the template writes a block, or the trace, itself: not this case
    answer = written.lstrip()
    if answer.startswith(closer):  # V3.1 writes the closer before a turn's answer itself
        answer = answer[len(closer):].lstrip()
    return trace + answer


def _inline(content: object, start: str, closer: str, space: str) -> str:
    """A trace written in the content as the model writes it after the prompt's opening: from after its opening
    tag (or the content's start), less the opening's whitespace, through the last closer and the whitespace after it;
    "" where the content has no closer."""
    if not isinstance(content, str) or closer not in content:
        return ""
    end = content.rindex(closer) + len(closer)
    at = content.find(start, 0, end)
    text = content[at + len(start) if at >= 0 else 0:]
    if space and text.startswith(space):
        text = text[len(space):]
    after = text[text.rindex(closer) + len(closer):]
    return text[: len(text) - len(after)] + after[: len(after) - len(after.lstrip())]


def _as_opened(trace: str, space: str, closer: str) -> str:
    """A trace given apart from the content (or none), closed as the prompt opened its block: the opening's
    whitespace before the closer, twice that after it."""
    return trace.strip() + space + closer + space * 2


def worded_turn(draw: Callable, messages: list, tools: Optional[list], i: int, prompt: str, bare: str,
                through: str) -> Optional[str]:
    """What the model writes after the generation prompt `prompt` for assistant message i where that prompt opens the
    trace with words the template's rendering of the turn leaves out (module doc: Apriel-1.6's `Here are my reasoning
    steps:\n`): the turn as the template writes it past what it shares with the prompt, an empty trace closed first
    where the message has none; None where that is not so."""
    if not (prompt.startswith(bare) and through.startswith(bare)):
        return None
    opening, turn = prompt[len(bare):], through[len(bare):]
    shared = shared_opening(opening, turn)
    words, written = opening[shared:], turn[shared:]
    if not words.strip() or _TAG.search(words) or written.startswith(words):
        return None
    message = messages[i]
    trace = reasoning_of(message).strip()
    probe = {**{k: v for k, v in message.items() if k not in REASONING_KEYS},
             "reasoning_content": trace or _PROBE_TRACE, "thinking": trace or _PROBE_TRACE}
    probed = draw([*messages[:i], probe], False, tools)
    if not probed.startswith(bare + turn[:shared]) or not probed.startswith(trace or _PROBE_TRACE, len(bare) + shared):
        return None  # the template writes no trace where the prompt's words stand
    probed = probed[len(bare) + shared + len(trace or _PROBE_TRACE):]
    if trace or not probed.endswith(written):
        return written if trace else None
    closer = probed[: len(probed) - len(written)]
    return written if not closer.strip() or closer.strip() in written else closer + written
