"""A conversation → its training examples: texts and the [start, end) character spans that carry a loss.

Every assistant turn trains as the model will generate it: after the context its template gives it at that
point, everything the template writes for it, through the token that ends it (turn_render.py, which may make a
conversation several examples). Most rows of role/content messages need none of that machinery: their one
rendering serves every turn so, and the turns are located in it cheaply: for assistant message i,
`render(messages[:i], add_generation_prompt=True)` ends where its content starts, and `render(messages[:i+1])`
ends after its end-of-turn marker; both must be prefixes of the full rendering and the content must occur once
between their ends (or a shape render knows where it was written, shape_render.py). Under open-instruct's
templates such rows are located in their one rendering as open-instruct trains them, also by rendering the row
with a marker in a content's place (`marked_place`). Working in characters (not token counts of prefixes)
keeps the labels exact when BPE merges across a turn boundary; the label step (data/labels.py) turns the spans
into labels.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from transformers import PreTrainedTokenizerBase

from open_sft.data.chat import render
from open_sft.data.chat.call_ids import check_call_ids
from open_sft.data.chat.content_place import end_of_turn_length, marked_place, prefix_place
from open_sft.data.chat.emptied_trace import inline_moved
from open_sft.data.chat.environment_turns import environment_hint
from open_sft.data.chat.foreign_fields import around, message_fields
from open_sft.data.chat.raw_rows import raw_completion
from open_sft.data.chat.reasoning import (answer_of, inline_reasoning, inline_unwritten, masked, reasoning_of,
                                         tags_as_text, trace_of, with_reasoning_aliases)
from open_sft.data.chat.render import DEFAULT_OPTIONS, ChatOptions, TemplateState
from open_sft.data.chat.tool_arguments import as_template_takes, string_arguments, tools_written, wrapped_twice
from open_sft.data.chat.trace_markers import own_texts, trace_markers
from open_sft.data.chat.turn_enders import TurnEnders, turn_enders
from open_sft.data.chat.turn_render import group_turns, kept_history, render_turn
from open_sft.data.chat.turns import call_written, prefix_renders
from open_sft.data.formats import Messages, RowError, same_kind, trains
from open_sft.data.tool_schemas import listed_in_system

@dataclass(frozen=True)
class RowRender:
    """A conversation's training examples, each (text, [start, end) character spans that carry a loss), in
    conversation order (one, unless its template rewrites earlier turns: turn_render.py), and whether a
    reasoning trace of a trained turn is missing from what its template writes."""

    examples: list[tuple[str, list[tuple[int, int]]]]
    reasoning_not_rendered: bool = False
    generation_tags_disagree: bool = False  # the template's {% generation %} spans mark other text
    ends: tuple[int, ...] = ()  # the message each example ends with (empty: the last, for one example)
    reasoning_history_not_kept: bool = False  # --reasoning_history keep could not join its examples
    tools_not_rendered: bool = False  # the row's tool schemas are not in what the template writes
    tool_arguments_not_json: bool = False  # a tool call's arguments are a string that is not a JSON object
    # the special tokens whose text a message's own text (content, reasoning) holds (render.special_text_in)
    special_tokens_in_text: tuple[str, ...] = ()
    reasoning_closed_by_prompt: bool = False  # a trained turn's generation prompt closes its think block empty
    turns_in_one_rendering: bool = False  # a trained turn not located after its own context (_partly_per_turn)
    reasoning_tags_as_text: bool = False  # an inline trace written as text by a tagless template (reasoning.py)
    tool_results_wrapped_twice: bool = False  # a tool result's own tags written around it again (tool_arguments.py)
    tools_listed_twice: bool = False  # the template writes the tools a system message already lists (tool_schemas.py)
    reasoning_opened_by_prompt: bool = False  # a turn trained after a think block its prompt opens (opened_trace.py)
    reasoning_block_filled: bool = False  # a turn's trace trained in the think block its template writes empty
    content_not_rendered: bool = False  # a call turn's content (beside its calls) its template leaves out
    row_template_kwargs: bool = False  # rendered with variables of its own, not the source's (render.row_options)
    tool_types_mapped: bool = False  # its tool schemas' Python type names read as JSON Schema's (data/python_types.py)
    # per example, where such turns start: the text is tokenized apart there, as at inference (data/cuts.py); () none
    cuts: tuple[tuple[int, ...], ...] = ()


# RowRender's notes: what the data report counts per source and warns about (open_sft.data.summary)
RENDER_NOTES = ("reasoning_not_rendered", "generation_tags_disagree", "reasoning_history_not_kept",
                "tools_not_rendered", "tool_arguments_not_json", "special_tokens_in_text",
                "reasoning_closed_by_prompt", "turns_in_one_rendering", "reasoning_tags_as_text",
                "tool_results_wrapped_twice", "reasoning_opened_by_prompt", "reasoning_block_filled",
                "tools_listed_twice", "content_not_rendered", "row_template_kwargs",
                "tool_types_mapped")


def _trained_indices(messages: Messages, train_on: str) -> list[int]:
    indices = [i for i, m in enumerate(messages)
               if m["role"] == "assistant" and i >= getattr(messages, "first_trained", 0) and trains(m)]
    return indices[-1:] if train_on == "last_assistant" else indices


def _enders(state: TemplateState, tokenizer: PreTrainedTokenizerBase, markers: tuple[str, ...]) -> TurnEnders:
    if markers not in state.enders:
        state.enders[markers] = turn_enders(state.draw, markers, tokenizer.eos_token,
                                            fields=message_fields(state.source))
    return state.enders[markers]


def _one_rendering(state: TemplateState, messages: Messages, indices: list[int], markers: tuple[str, ...],
                   text: str, known_ends: Optional[dict], faithful: bool, enders: TurnEnders = TurnEnders(())
                   ) -> Optional[list[tuple[int, int]]]:
    """The trained spans of a row of role/content messages read off its one rendering `text`: each content,
    stripped, and its end of turn. `faithful`: only where that is the turn as the model generates it (the
    generation prompt is a prefix of the text, and the template closes the turn with an end-of-turn token where
    it has any), from the end of the generation prompt (whitespace there too: a content's leading "\n\n" that
    ChatML or Mistral's template writes as it is, DeepSeek-V3.1's after `</think>`, the model generates); else
    None. Not faithful (open-instruct's templates, for parity): a content may also be located by a marked
    rendering."""
    if faithful and enders.eos_in_place[0]:  # a last turn ends with eos where history closes it otherwise
        return None
    draw, tools = state.draw, getattr(messages, "tools", None)
    spans = []
    for i in indices:
        content = messages[i]["content"].strip()
        if known_ends is not None:  # the shape render knows where the content was written (as is, or stripped)
            prompt_end, written_at, through_length = known_ends[i]
            raw = messages[i]["content"]
            start = written_at + (len(raw) - len(raw.lstrip()) if text.startswith(raw, written_at) else 0)
            content_end = start + len(content)
        else:
            place = prefix_place(draw, messages, tools, text, i)
            if place is None:  # the content occurs more than once, or the template is not prefix-stable
                marked = marked_place(state, messages, tools, text, i, markers)
                prompt, through = prefix_renders(draw, messages, tools, text, i) if i and faithful else ("", "")
                if marked is not None and text.startswith(prompt or "") and text.startswith(through):
                    place = (len(prompt) if faithful and i else marked[0], *marked)
            if place is None:
                if faithful:
                    return None
                raise RowError(
                    f"message {i + 1} (assistant): the chat template is not prefix-stable for this conversation "
                    "(or writes this content more than once) and its rendering changes with the assistant's "
                    "content, so the turn cannot be located; choose another template")
            prompt_end, start, content_end, through_length = place
        end = end_of_turn_length(state, text[content_end:through_length], markers)
        if faithful and not end and enders.tokens:
            return None
        if faithful:  # what the template writes before the content (Qwen3's empty think block after the last
            start = prompt_end  # user message, a content's own leading whitespace): the model writes it too
        spans.append((start, content_end + end))
    return spans


def row_examples(tokenizer: PreTrainedTokenizerBase, messages: Messages, train_on: str, markers: tuple[str, ...],
                 options: ChatOptions = DEFAULT_OPTIONS) -> RowRender:
    """The conversation's training examples: every trained assistant turn after the context its template
    gives it at that point, through the token that ends it (turn_render.py). A row of role/content messages
    whose one rendering serves every turn so (most rows, under most templates) is that rendering, its turns
    located cheaply (a shape render, or prefix renders); under open-instruct's templates such rows are
    located in their one rendering as open-instruct trains them. The row's tools (if any) are rendered in
    every prefix too. A template that fails on the row makes it a bad row (`_guarded`)."""
    if getattr(messages, "raw_text", False):
        return RowRender([raw_completion(tokenizer, messages[0]["content"], messages[-1]["content"], train_on)])
    if not tokenizer.chat_template:  # a source of raw rows (checked by its first) may hold a row of messages
        raise RowError("a row of messages needs a chat template and the tokenizer has none; choose one with "
                       "--chat_template_name or --chat_template_path FILE", "template_error")
    own_options = render.row_options(options, messages)
    own_kwargs, options = own_options != options, own_options  # the row's variables change what the template gets
    state = render.template_state(tokenizer, options)
    strings = string_arguments(messages)  # before the template's own form: what the row gave
    messages = _developer_turns(messages, state.source)
    enders = _enders(state, tokenizer, markers)
    if enders.inline_doubled:  # one trace block, not the content's and the template's
        messages = inline_moved(messages, enders.trace_block)
    messages = as_template_takes(state, with_reasoning_aliases(messages))
    check_call_ids(state, messages)
    rendered = _examples(state, tokenizer, messages, train_on, markers, options)
    trained, texts = _trained_indices(messages, train_on), [text for text, _ in rendered.examples]
    if not (rendered.reasoning_not_rendered or rendered.reasoning_closed_by_prompt) and inline_unwritten(
            messages, trained, texts):
        rendered = dataclasses.replace(rendered, reasoning_not_rendered=True)
    if train_on != "all" and state.generation_tags:
        rendered = dataclasses.replace(rendered, generation_tags_disagree=_tags_disagree(
            tokenizer, messages, rendered, options))
    tools = getattr(messages, "tools", None)
    if tools and not tools_written(tools, rendered.examples[0][0]):
        rendered = dataclasses.replace(rendered, tools_not_rendered=True)
    elif tools and listed_in_system(tools, messages):
        rendered = dataclasses.replace(rendered, tools_listed_twice=True)
    if strings:
        rendered = dataclasses.replace(rendered, tool_arguments_not_json=True)
    if found := render.special_text_in(tokenizer, markers, own_texts(messages, trace_markers(state, markers))):
        rendered = dataclasses.replace(rendered, special_tokens_in_text=found)
    if tags_as_text(state, messages, trained, texts):
        rendered = dataclasses.replace(rendered, reasoning_tags_as_text=True)
    if wrapped_twice(messages, texts):
        rendered = dataclasses.replace(rendered, tool_results_wrapped_twice=True)
    mapped = getattr(messages, "tool_types_mapped", False)
    if own_kwargs or mapped:
        rendered = dataclasses.replace(rendered, row_template_kwargs=own_kwargs, tool_types_mapped=mapped)
    return rendered


def _developer_turns(messages: Messages, template: str) -> Messages:
    """OpenAI's `developer` turns as the template's own where it has that role (gpt-oss's), else as system turns,
    the role they replace (a template without it would refuse the row, or leave the turn out)."""
    if "developer" in template or not any(m["role"] == "developer" for m in messages):
        return messages
    return same_kind(messages, ({**m, "role": "system"} if m["role"] == "developer" else m for m in messages))


def _examples(state: TemplateState, tokenizer: PreTrainedTokenizerBase, messages: Messages, train_on: str,
              markers: tuple[str, ...], options: ChatOptions) -> RowRender:
    """row_examples for messages with their reasoning aliased."""
    tools = getattr(messages, "tools", None)
    plain = tools is None and max(map(len, messages)) == 2 and not (  # an inline trace to mask: turn by turn
        options.reasoning_loss == "mask" and any(m["role"] == "assistant" and inline_reasoning(m) for m in messages))
    if train_on == "all" or plain:
        text, known_ends = render.text_and_ends(state, messages)
        if train_on == "all":
            return RowRender([(text, [(0, len(text))])])
        indices = _trained_indices(messages, train_on)
        if known_ends is not None:
            indices = [i for i in indices if i in known_ends]
        spans = _one_rendering(state, messages, indices, markers, text, known_ends, faithful=not state.builtin,
                               enders=_enders(state, tokenizer, markers))
        if spans is not None:
            return RowRender([(text, _joined(spans))])
        try:
            return _per_turn(state, tokenizer, messages, indices, markers, options)
        except RowError:  # a turn that cannot be located after its own context: it alone trains in the one rendering
            return _partly_per_turn(state, tokenizer, messages, indices, markers, options, text, known_ends)
    return _per_turn(state, tokenizer, messages, _trained_indices(messages, train_on), markers, options)


def _partly_per_turn(state: TemplateState, tokenizer: PreTrainedTokenizerBase, messages: Messages,
                     indices: list[int], markers: tuple[str, ...], options: ChatOptions, text: str,
                     known_ends: Optional[dict]) -> RowRender:
    """The turns that are located after their own context train there (_per_turn); those that are not (a turn
    opening the conversation; under Mistral v0.3's template, one answering an empty user message, which its
    system prompt then precedes) train in the row's one rendering `text`, as open-instruct trains them: in the
    per-turn example that is that text, or in one of their own. (The whole row trained so: every turn lost the
    system prompt Mistral's template gives it.)"""
    enders, tools = _enders(state, tokenizer, markers), getattr(messages, "tools", None)
    located = [i for i in indices if _locates(state, messages, tools, i, enders)]
    unlocated = [i for i in indices if i not in located]
    alone = _joined(_one_rendering(state, messages, unlocated, markers, text, known_ends, faithful=False))
    try:
        rendered = _per_turn(state, tokenizer, messages, located, markers, options) if located else None
    except RowError:
        rendered = None
    answered = any(m["role"] == "user" for m in messages[:max(unlocated, default=0)])
    if rendered is None:  # (a conversation's opening turn has no context to lose: not noted)
        return RowRender([(text, _joined(_one_rendering(state, messages, indices, markers, text, known_ends,
                                                        faithful=False)))], turns_in_one_rendering=answered)
    examples, ends = list(rendered.examples), list(rendered.ends)
    same = [k for k, (example, _) in enumerate(examples) if example == text]
    if same:
        examples[same[0]] = (text, _joined(sorted(examples[same[0]][1] + alone)))
    else:
        examples.append((text, alone))
        ends.append(len(messages) - 1)
    cuts = rendered.cuts + ((),) * (len(examples) - len(rendered.examples)) if rendered.cuts else ()
    return dataclasses.replace(rendered, examples=examples, ends=tuple(ends), turns_in_one_rendering=answered,
                               cuts=cuts)


def _locates(state: TemplateState, messages: Messages, tools: Optional[list], i: int, enders: TurnEnders) -> bool:
    try:
        render_turn(state.draw, messages, tools, i, enders, opens=not state.builtin)
        return True
    except RowError:
        return False


def _per_turn(state: TemplateState, tokenizer: PreTrainedTokenizerBase, messages: Messages, indices: list[int],
              markers: tuple[str, ...], options: ChatOptions) -> RowRender:
    tools = getattr(messages, "tools", None)
    enders = _enders(state, tokenizer, markers)
    keep = options.reasoning_history == "keep"
    examples, turns = group_turns(state.draw, messages, tools, indices, enders,
                                  strict=not state.builtin, contiguous=keep)
    not_kept = False
    if keep and len(examples) > 1:
        joined = kept_history(state.draw, messages, tools, examples, enders)
        examples, not_kept = ([joined], False) if joined is not None else (examples, True)
    unwritten = closed = opened = filled = dropped = False
    for i, turn in turns.items():
        message = messages[i]
        where = f"message {i + 1} (assistant, with {'tool calls' if message.get('tool_calls') else 'more than a content'})"
        missing = call_written(message, turn.target)
        if missing:
            raise RowError(f"{where}: the chat template does not write its tool calls ({', '.join(missing)}: some or "
                           "all of them, or their arguments); use a template that renders them (the model's own, or "
                           "--chat_template_path FILE); a template that writes one call a turn (gpt-oss's) needs "
                           f"parallel calls split into turns{environment_hint(state.source, messages)}",
                           "tool_calls_not_rendered")
        if not turn.target.strip():
            raise RowError(f"message {i + 1} (assistant): the chat template writes nothing for this turn; choose "
                           "another template")
        reasoning = reasoning_of(message)
        closed |= turn.reasoning_closed
        opened |= turn.reasoning_opened
        filled |= turn.reasoning_filled
        unwritten |= bool(reasoning) and not turn.reasoning_closed and reasoning.strip() not in turn.target
        said = answer_of(message) if message.get("tool_calls") else ""
        dropped |= bool(said) and said not in turn.target
    out, cuts = [], tuple(tuple(a for i, (a, _) in example.turns if turns[i].reasoning_opened) for example in examples)
    for example in examples:
        spans: list[tuple[int, int]] = []
        for i, span in example.turns:
            for piece in around(span, turns[i].hole):  # a tool's output written in the turn is context
                spans += masked(piece, example.text, trace_of(messages[i])) if options.reasoning_loss == "mask" \
                    else [piece]
        out.append((example.text, _joined(spans)))
    return RowRender(out, unwritten, ends=tuple(max(i for i, _ in example.turns) for example in examples),
                     reasoning_history_not_kept=not_kept, reasoning_closed_by_prompt=closed,
                     reasoning_opened_by_prompt=opened, cuts=cuts if opened else (), reasoning_block_filled=filled,
                     content_not_rendered=dropped)


def _tags_disagree(tokenizer: PreTrainedTokenizerBase, messages: Messages, rendered: RowRender,
                   options: ChatOptions) -> bool:
    """Whether a trained span is not what the template marks with `{% generation %}` (a second opinion on the
    labels, from transformers' own tracking): each example's trained texts, stripped, must each be the text of
    a generation block of the template's rendering of the conversation through that example's last turn, or its
    end where what the block marks before it is the generation prompt, which ends the span's context (SmolLM3's
    block holds the turn's `<|im_start|>assistant\n`, which the generation prompt writes: context, never trained;
    any other untrained start, a trace left out of the labels, disagrees)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    def render(conversation: list, **kwargs: Any) -> tuple:
        return render_jinja_template([conversation], tools=getattr(messages, "tools", None),
                                     chat_template=tokenizer.chat_template, **kwargs,
                                     **tokenizer.special_tokens_map, **options.kwargs())

    assistant = any(m["role"] == "assistant" for m in messages)
    for (text, spans), last in zip(rendered.examples, rendered.ends or [len(messages) - 1]):
        try:
            (whole,), (blocks,) = render(messages[: last + 1], return_assistant_tokens_mask=True)
            marked = {whole[a:b].strip() for a, b in blocks}
            # the generation prompt's two renders only for a span no block marks whole (a row's one render else)
            unmarked = [(text[:a], text[a:b].strip()) for a, b in spans if text[a:b].strip() not in marked]
            if unmarked:
                (before,), _ = render(messages[:last])
                (prompted,), _ = render(messages[:last], add_generation_prompt=True)
        except Exception:  # noqa: BLE001 (the row rendered above; nothing to compare otherwise)
            return True
        if unmarked:
            prompt = prompted[len(before):].strip() if last and prompted.startswith(before) else None
            if not all(_marked_after_prompt(context, trained, marked, prompt) for context, trained in unmarked):
                return True
        if not spans and assistant:
            return True
    return False


def _marked_after_prompt(context: str, trained: str, marked: set[str], prompt: Optional[str]) -> bool:
    """Whether a generation block marks the trained text after the generation prompt (`prompt`, stripped), which
    ends its context."""
    return bool(prompt) and context.rstrip().endswith(prompt) and any(
        block.endswith(trained) and block[: len(block) - len(trained)].strip() == prompt for block in marked)


def trained_spans(tokenizer: PreTrainedTokenizerBase, messages: Messages, train_on: str, markers: tuple[str, ...],
                  options: ChatOptions = DEFAULT_OPTIONS) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and its trained spans, for a row that makes one example (row_examples)."""
    rendered = row_examples(tokenizer, messages, train_on, markers, options)
    if len(rendered.examples) != 1:
        raise ValueError(f"this conversation makes {len(rendered.examples)} examples; use row_examples")
    return rendered.examples[0]


def _joined(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Spans that touch made one (assistant_message_only writes the turns back to back): one run of
    trained tokens, which a token holding the end of one and the start of the next may straddle."""
    out: list[tuple[int, int]] = []
    for start, end in spans:
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(end, out[-1][1]))
        else:
            out.append((start, end))
    return out
