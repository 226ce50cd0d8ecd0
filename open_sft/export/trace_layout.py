"""A chat template's reasoning layout: where a reply writes its trace and where its answer starts, read off the
template's renderings of probe messages after a user turn (open_sft.export.reply splits replies by it).

A template shows it in one of four ways:

- It writes a message's reasoning field (`reasoning_content` TRACE, content ANSWER, which transformers also hands
  over as `thinking`) after the generation prompt: what it writes before the trace is the `opening` (`<think>`),
  what it writes between the two is `between`, and the part of that the message without a trace writes too is the
  marker the answer follows (`</think>`, gpt-oss's `<|channel|>final<|message|>`).
- It writes a trace given as a content chunk of type `thinking` (mistral-common's and Anthropic's form; the reasoning
  templates of Mistral's models, `[THINK]TRACE[/THINK]ANSWER`) and no reasoning field: read as the field is, and a
  reply's trace goes back into its message as such a chunk (`chunks`), where the template writes it in history too.
- Its generation prompt opens the trace with words the message's rendering leaves out, and that rendering writes the
  trace right where those words stand (Apriel-1.6's prompt ends `<|begin_assistant|>\\nHere are my reasoning
  steps:\\n`; its turn is `TRACE\\n[BEGIN FINAL RESPONSE]\\nANSWER`): the reply starts inside its trace (`opened`), and
  the marker is what the template writes between trace and answer (`[BEGIN FINAL RESPONSE]`), as the data side trains
  it (open_sft.data.chat.opened_trace.worded_turn).
- It writes no reasoning field, its generation prompt closes an empty block (Gemma 4's `<|channel>thought\\n
  <channel|>`, left out under enable_thinking) and it drops that block, filled, from an assistant content (Gemma 4's
  strip_thinking): the block is the trace's, `<|channel>thought` its opening and `<channel|>` the marker. A reply
  after the prompt that closes it is its answer (`closed`); one after a prompt that leaves it out writes its trace
  there (`<|channel>thought\\nTRACE<channel|>ANSWER`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Optional

from open_sft.data.chat.elements import closed_block, element
from open_sft.data.chat.opened_trace import shared_opening
from open_sft.data.per_tokenizer import PerTokenizer
from open_sft.export.template_text import common_suffix

PROBE_TRACE, PROBE_ANSWER = "TRACE_8d1f", "ANSWER_5c2e"  # text no template writes by itself
INLINE_OPEN, INLINE_CLOSE = "<think>", "</think>"  # a trace in the content (open_sft.data.chat.reasoning)
_LAYOUTS = PerTokenizer()  # reasoning_layout's
_TAG = re.compile(r"<[^<>\s]+>")  # a tag-shaped piece of text: <|channel>, <channel|>, </think>
_WORDS_TAG = re.compile(r"<[^<>]*>|\[[^\[\]]*\]")  # a tag or a bracketed token in an opening's words


@dataclass(frozen=True)
class ReasoningLayout:
    """What the template writes before a trace (`opening`, e.g. `<think>`), between trace and answer
    (`between`, e.g. `\\n</think>\\n\\n`) and where an answer without a trace starts (`answer_marker`, the part
    of `between` it shares: `</think>`, gpt-oss's `<|channel|>final<|message|>`); `opened`: the generation prompt
    opens the trace (the reply starts inside it: one without the marker stopped there); `closed`: the generation
    prompt closes an empty trace (the reply is its answer); `chunks`: the template takes the trace as a `thinking`
    chunk of the content."""

    opening: str
    between: str
    answer_marker: str
    opened: bool = False
    closed: bool = False
    chunks: bool = False


def reasoning_layout(template: str, tokenizer) -> ReasoningLayout | None:
    """The reasoning layout of the tokenizer's template (`template`), read from its rendering of probe messages after
    a user turn (module docstring); None when it shows none (an instruct template, or one that fails). Read once per
    tokenizer (not kept alive by it), again if its template or tokens change."""
    return _LAYOUTS.get(tokenizer, (template, len(tokenizer)), lambda: _reasoning_layout(tokenizer))


def _reasoning_layout(tokenizer) -> ReasoningLayout | None:
    """The layout the template shows with the chat template variables bound to the tokenizer (open_sft.export.
    template_kwargs), else with its defaults: a run's variables may hide the layout (Gemma 4's enable_thinking leaves
    out the empty block its default prompt closes, the block its replies then write their trace in); the reply is
    read against the prompt it followed (open_sft.export.reply). The defaults' layout holds for the bound prompt only
    where it is `closed` (the reply, an answer there, may write the block that prompt closes): an `opened` one would
    read the bound prompt's whole answers as cut inside a trace."""
    from open_sft.export.template_kwargs import unbound_renderer

    layout = _rendered_layout(tokenizer.apply_chat_template)
    defaults = unbound_renderer(tokenizer)
    if layout is not None or defaults is None:
        return layout
    default = _rendered_layout(defaults)
    return default if default is not None and default.closed else None


def _rendered_layout(apply_chat_template) -> ReasoningLayout | None:
    user = [{"role": "user", "content": "Q"}]

    def render(message: Optional[dict] = None, **kwargs) -> str | None:
        try:
            text = apply_chat_template(user + ([message] if message else []), tokenize=False, **kwargs)
        except Exception:  # noqa: BLE001  (a template that cannot render a probe is read as having no layout)
            return None
        return text if isinstance(text, str) else None

    prompt, context = render(add_generation_prompt=True), render()
    full = render({"role": "assistant", "content": PROBE_ANSWER, "reasoning_content": PROBE_TRACE})
    bare = render({"role": "assistant", "content": PROBE_ANSWER})
    if prompt is None or full is None or bare is None:
        return None
    layout = _field_layout(prompt, full, bare) or _chunk_layout(prompt, bare, render)
    if layout is not None or context is None:
        return layout
    return _worded_layout(prompt, context, full, bare) or _content_block_layout(prompt, context, bare, render)


def _field_layout(prompt: str, full: str, bare: str) -> ReasoningLayout | None:
    """The layout of a template that writes the reasoning field after the generation prompt."""
    if not (full.startswith(prompt) and bare.startswith(prompt)):
        return None
    full, bare = full[len(prompt):], bare[len(prompt):]
    trace, answer = full.find(PROBE_TRACE), full.find(PROBE_ANSWER)
    if trace < 0 or answer < trace:
        return None
    between = full[trace + len(PROBE_TRACE):answer].strip()
    marker = common_suffix(between, bare[:max(bare.find(PROBE_ANSWER), 0)].strip()) or between
    if not marker.strip():
        return None
    return ReasoningLayout(full[:trace].strip(), between, marker.strip())


def _chunk_layout(prompt: str, bare: str, render) -> ReasoningLayout | None:
    """The layout of a template that writes a `thinking` chunk of the content (Mistral's reasoning templates); one
    that writes a text chunk as it writes the text (not the chunk as JSON, GigaChat3's)."""
    full = render({"role": "assistant", "content": [{"type": "thinking", "thinking": PROBE_TRACE},
                                                    {"type": "text", "text": PROBE_ANSWER}]})
    if full is None or render({"role": "assistant", "content": [{"type": "text", "text": PROBE_ANSWER}]}) != bare:
        return None
    layout = _field_layout(prompt, full, bare)
    return replace(layout, chunks=True) if layout is not None else None


def _worded_layout(prompt: str, context: str, full: str, bare: str) -> ReasoningLayout | None:
    """The layout of a template whose generation prompt opens the trace with words (Apriel-1.6's): the words hold no
    tag, and the message's rendering writes the trace where they stand, then the marker, then the answer."""
    if not all(text.startswith(context) for text in (prompt, full, bare)):
        return None
    opening, turn = prompt[len(context):], full[len(context):]
    shared = shared_opening(opening, turn)
    words, written = opening[shared:], turn[shared:]
    if not words.strip() or _WORDS_TAG.search(words) or not written.startswith(PROBE_TRACE):
        return None
    answer = written.find(PROBE_ANSWER)
    between = written[len(PROBE_TRACE):answer].strip() if answer > 0 else ""
    alone = bare[len(context) + shared:]  # the answer without a trace: what it writes before it is no marker
    marker = common_suffix(between, alone[:max(alone.find(PROBE_ANSWER), 0)].strip()) or between
    if not marker.strip():
        return None
    return ReasoningLayout("", between, marker.strip(), opened=True)


def _content_block_layout(prompt: str, context: str, bare: str, render) -> ReasoningLayout | None:
    """The layout of a template that closes an empty trace block in its generation prompt and drops that block,
    filled, from an assistant content (Gemma 4's)."""
    if not (prompt.startswith(context) and bare.startswith(context)):
        return None
    opening = prompt[len(context):]
    block = opening[shared_opening(opening, bare[len(context):]):]
    closers = [tag for tag in _TAG.finditer(block) if (found := element(tag.group())) is not None and found[1]]
    if not closed_block(block) or not closers:
        return None
    start, closer = block[:closers[-1].start()], closers[-1].group()
    filled = render({"role": "assistant", "content": start + PROBE_TRACE + closer + PROBE_ANSWER}) or ""
    if not filled.startswith(context) or PROBE_TRACE in filled or PROBE_ANSWER not in filled[len(context):]:
        return None  # the template keeps such a block in the content: not a trace it reads
    return ReasoningLayout(start.strip(), closer, closer, closed=True)


def _generation_prompt(tokenizer) -> str | None:
    """The template's generation prompt after a user turn (with the variables bound to the tokenizer), None where it
    fails."""
    try:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Q"}], add_generation_prompt=True,
                                               tokenize=False)
    except Exception:  # noqa: BLE001  (a template that cannot render the probe opens nothing)
        return None
    return prompt if isinstance(prompt, str) else None


def opens_reasoning(tokenizer) -> bool:
    """Whether the template's generation prompt opens a trace the reply writes into (`<think>` last: DeepSeek-R1
    distills, open-instruct's thinker and r1_simple_chat templates): the answer follows the reply's `</think>`."""
    prompt = _generation_prompt(tokenizer)
    return prompt is not None and prompt.rstrip().endswith(INLINE_OPEN)


def writes_reasoning(template: str | None, tokenizer) -> bool:
    """Whether replies under the template begin with reasoning: a reasoning field it writes, or a trace its
    generation prompt opens; not where the prompt closes the trace empty (Gemma 4's by default, Qwen3's under
    enable_thinking false: it ends in the layout's answer marker)."""
    if template is None:
        return False
    layout, prompt = reasoning_layout(template, tokenizer), (_generation_prompt(tokenizer) or "").rstrip()
    return layout is not None and not prompt.endswith(layout.answer_marker) or prompt.endswith(INLINE_OPEN)
