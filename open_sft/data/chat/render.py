"""Chat template rendering and the character spans of the assistant turns.

The trained character spans are found by rendering prefixes of the conversation: for assistant
message i, `render(messages[:i], add_generation_prompt=True)` ends where its content starts, and
`render(messages[:i+1])` ends after its end-of-turn marker. Both must be prefixes of the full
rendering (the template is prefix-stable for this row) and the content must occur once between their
ends; where not, the content is located by rendering the row with a marker in its place
(`_marked_place`), else the row is rejected. Rows of a shape with a shape render (shape_render.py) know where each
content was written. Working in
characters (not token counts of prefixes) keeps the labels exact when BPE merges across a turn
boundary; the label step (data/labels.py) turns the spans into labels.
"""

from __future__ import annotations

import operator
import os
import weakref
from dataclasses import dataclass, field
from typing import Callable, Optional

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from open_sft.data.formats import Messages, RowError
from open_sft.data.chat.shape_render import ShapeRender, render_shape
from open_sft.data.chat.templates import content_writing
from open_sft.data.chat.turns import last_marker_end, middle_closing, prefix_renders, whole_turn_span

Renderer = Callable[[Messages, bool, Optional[list]], str]

_PROBE = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"},
          {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3 + 3?"},
          {"role": "assistant", "content": " 6 \n"}]
_PROBE_TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                   "required": ["a", "b"]}}}]
_RENDERERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _public_renderer(tokenizer: PreTrainedTokenizerBase) -> Renderer:
    def public(messages: Messages, add_generation_prompt: bool, tools: Optional[list]) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             tools=tools)
    return public


def _direct_renderer(tokenizer: PreTrainedTokenizerBase) -> Optional[Renderer]:
    """Render with the compiled Jinja template and a context built from a dict prepared once.

    apply_chat_template's per-call argument handling, and Jinja's own `Template.render` (which merges
    the environment's globals, a ChainMap, into a new dict on every call), cost about 4× the template
    itself on short rows. Used only if it reproduces apply_chat_template exactly on probe
    conversations with and without tools; otherwise None (use the public API)."""
    try:
        from jinja2.runtime import new_context
        from transformers.utils.chat_template_utils import _compile_jinja_template

        compiled = _compile_jinja_template(tokenizer.chat_template)
        environment = compiled.environment
        base = {**compiled.globals, **tokenizer.special_tokens_map, "documents": None}

        def direct(messages: Messages, add_generation_prompt: bool, tools: Optional[list]) -> str:
            variables = {**base, "messages": messages, "add_generation_prompt": add_generation_prompt, "tools": tools}
            context = new_context(environment, compiled.name, compiled.blocks, variables, shared=True)
            return environment.concat(compiled.root_render_func(context))

        public = _public_renderer(tokenizer)
        for tools in (None, _PROBE_TOOLS):
            for k in range(1, len(_PROBE) + 1):
                for generation_prompt in (False, True):
                    if direct(_PROBE[:k], generation_prompt, tools) != public(_PROBE[:k], generation_prompt, tools):
                        return None
        return direct
    except Exception:  # any template or transformers/jinja change: fall back to the public API
        return None


@dataclass
class _Template:
    """What rendering a tokenizer's current template needs: the renderer, the shape renders of the shapes seen,
    and (for a template open_sft ships) how it writes contents, so rows are filled into shape renders."""

    source: str
    draw: Renderer
    shape_renders: dict[tuple[str, ...], Optional[ShapeRender]] = field(default_factory=dict)
    contents: Optional[str] = None  # "as_is" / "trimmed": templates.content_writing
    markers: tuple[str, ...] = ()  # the markers `end_of_turn` remembers lengths for
    end_of_turn: dict[str, int] = field(default_factory=dict)  # suffix → its end-of-turn length
    closers: dict[tuple[str, ...], tuple[str, ...]] = field(default_factory=dict)  # turns.py
    middle_closings: dict[tuple[str, ...], str] = field(default_factory=dict)  # turns.py


def _guarded(draw: Renderer) -> Renderer:
    """The renderer, with any failure of the template raised as the row's error (reason template_error)
    rather than a crash of the whole build: raise_exception on a role it has no turn for, turns that do
    not alternate, a variable it assumes (a tool-use template iterating `tools` the row does not have)."""
    def guarded(messages: Messages, add_generation_prompt: bool, tools: Optional[list]) -> str:
        try:
            return draw(messages, add_generation_prompt, tools)
        except Exception as exc:
            problem = str(exc) if isinstance(exc, TemplateError) else f"{type(exc).__name__}: {exc}"
            raise RowError(f"the chat template rejects this conversation ({problem}); fix the row, choose another "
                           "template with --chat_template_name or --chat_template_path, or skip such rows with "
                           "--on_bad_row drop", "template_error") from None
    return guarded


def _state(tokenizer: PreTrainedTokenizerBase) -> _Template:
    """The tokenizer's template state, made again when its template changes."""
    cached = _RENDERERS.get(tokenizer)
    if cached is None or cached.source != tokenizer.chat_template:
        cached = _Template(tokenizer.chat_template,
                           _guarded(_direct_renderer(tokenizer) or _public_renderer(tokenizer)))
        contents = content_writing(tokenizer.chat_template)
        if contents is not None and _fill_agrees(cached, contents):
            cached.contents = contents
        _RENDERERS[tokenizer] = cached
    return cached


def renderer_for(tokenizer: PreTrainedTokenizerBase) -> Renderer:
    """The fastest renderer that matches apply_chat_template, checked once per tokenizer and template."""
    return _state(tokenizer).draw


_MAX_SHAPE_RENDERS = 4096  # distinct role sequences remembered per tokenizer (a few dozen in real data)
_MAX_SUFFIXES = 1 << 16  # distinct end-of-turn suffixes remembered per tokenizer
_ROLE, _CONTENT = operator.itemgetter("role"), operator.itemgetter("content")


def _shape_render(state: _Template, roles: tuple[str, ...]) -> Optional[ShapeRender]:
    if roles in state.shape_renders:
        return state.shape_renders[roles]
    shape = render_shape(state.draw, roles)
    if len(state.shape_renders) < _MAX_SHAPE_RENDERS:
        state.shape_renders[roles] = shape
    return shape


def _text_and_ends(state: _Template, messages: Messages) -> tuple[str, Optional[dict]]:
    """The row's text and, when its shape render (shape_render.py) gives them, the prompt and turn ends of
    each assistant message; else None, and the row renders its prefixes (rows with tools: their
    schemas are part of the text). A template open_sft ships is not rendered at all: its shape render is
    filled with the contents, one string format instead of a Jinja render."""
    tools = getattr(messages, "tools", None)
    # Rows with tools, or with messages carrying more than role and content (tool calls), are rendered
    # whole: the template writes more than the contents.
    plain = tools is None and max(map(len, messages)) == 2
    shape = _shape_render(state, tuple(map(_ROLE, messages))) if plain else None
    if shape is None:
        return state.draw(messages, False, tools), None
    contents = list(map(_CONTENT, messages))
    if state.contents is not None:
        return shape.fill(contents, trimmed=state.contents == "trimmed")
    text = state.draw(messages, False, None)
    return text, shape.prefix_ends(contents, text)


def _fill_agrees(state: _Template, contents: str) -> bool:
    """Filling shape renders gives the renderer's text and prefix ends on the probe conversations (a guard:
    the special tokens or Jinja could make a shipped template render differently than assumed)."""
    for k in range(2, len(_PROBE) + 1):
        probe = _PROBE[:k]
        shape = _shape_render(state, tuple(m["role"] for m in probe))
        if shape is None:
            return False
        text, ends = shape.fill([m["content"] for m in probe], trimmed=contents == "trimmed")
        if text != state.draw(probe, False, None) or {i: (p, t) for i, (p, _, t) in ends.items()} != {
                i: (len(state.draw(probe[:i], True, None)), len(state.draw(probe[: i + 1], False, None)))
                for i, m in enumerate(probe) if m["role"] == "assistant"}:
            return False
    return True


def render(tokenizer: PreTrainedTokenizerBase, messages: Messages, add_generation_prompt: bool = False,
           tools: Optional[list] = None) -> str:
    """The chat template's text for `messages` (and the row's tool schemas, if any)."""
    return renderer_for(tokenizer)(messages, add_generation_prompt, tools)


def special_markers(tokenizer: PreTrainedTokenizerBase) -> tuple[str, ...]:
    """Strings that can close an assistant turn: the tokenizer's special tokens, including added
    tokens flagged special (Llama 3's `<|eot_id|>`, chatml's `<|im_end|>`), longest first."""
    tokens = set(tokenizer.all_special_tokens)
    tokens |= {token.content for token in tokenizer.added_tokens_decoder.values() if token.special}
    return tuple(sorted(tokens, key=len, reverse=True))


def _end_of_turn_length(state: _Template, suffix: str, markers: tuple[str, ...]) -> int:
    """Characters of `suffix` (text after an assistant's content) that belong to its end of turn:
    everything up to and including the last special-token marker, nothing after it. Remembered per
    template state (keyed by the suffix alone while the markers are the same object: hashing Llama 3's
    256 markers for every row would cost more than the lookup saves); a few suffixes recur in every row."""
    if state.markers is not markers:
        state.markers, state.end_of_turn = markers, {}
    end = state.end_of_turn.get(suffix)
    if end is None:
        end = last_marker_end(suffix, markers)
        if len(state.end_of_turn) < _MAX_SUFFIXES:
            state.end_of_turn[suffix] = end
    return end


_MARK = "\x00assistant content\x00"  # a string no template writes by itself


def _marked_place(state: _Template, messages: Messages, tools: Optional[list], text: str, i: int,
                  markers: tuple[str, ...]) -> Optional[tuple[int, int, int]]:
    """Where what the template writes of assistant message i's content, stripped, starts and ends in
    `text`, and where the text its turn closes with ends; for rows the prefix renderings cannot place (a
    template that is not prefix-stable, one writing the system prompt into the last user turn, say; a
    content that also occurs in the text the template writes before it). Its place: the row rendered
    with that content replaced by a marker must be `text` with, in the marker's place, the content (as
    is, or stripped) or only its end (templates that keep only the answer after a `</think>`). Its
    closing: what the template writes after the content when it is the last message, as far as `text`
    has the same there (Phi-3 closes only the final turn with eos after <|end|>), or else when another
    message follows (OLMo's template: <|im_end|> there, eos at the end). None when the template reads
    the content otherwise."""
    marked = [dict(m, content=_MARK) if k == i else m for k, m in enumerate(messages)]
    before, *after = state.draw(marked, False, tools).split(_MARK)
    if len(after) != 1 or not (text.startswith(before) and text.endswith(after[0])) \
            or len(before) + len(after[0]) > len(text):
        return None
    inserted_end = len(text) - len(after[0])
    inserted = text[len(before): inserted_end]
    content = messages[i]["content"]
    if not (inserted in (content, content.strip()) or (inserted.strip() and content.strip().endswith(inserted.strip()))):
        return None
    _, *closing = state.draw(marked[: i + 1], False, tools).split(_MARK)
    if len(closing) != 1:
        return None
    closed = os.path.commonprefix([closing[0], text[inserted_end : inserted_end + len(closing[0])]])
    if not last_marker_end(closed, markers):  # a turn the template closes differently when another follows
        middle = middle_closing(state, markers)
        if middle and text.startswith(middle, inserted_end):
            closed = middle
    start = len(before) + len(inserted) - len(inserted.lstrip())
    return start, start + len(inserted.strip()), inserted_end + len(closed)


def _prefix_place(draw: Renderer, messages: Messages, tools: Optional[list], text: str, i: int
                  ) -> Optional[tuple[int, int, int]]:
    """Where assistant message i's content, stripped, starts and ends in `text`, and where its turn ends:
    from the renderings of the messages before it (with the generation prompt) and through it, which
    must be prefixes of `text`, when the content occurs just once between their ends. None otherwise (a
    first message has no prefix to render: apply_chat_template refuses an empty conversation)."""
    prompt, through = prefix_renders(draw, messages, tools, text, i)
    if prompt is None or not (text.startswith(prompt) and text.startswith(through)):
        return None
    content = messages[i]["content"].strip()
    start = text.find(content, len(prompt), len(through))
    if start < 0 or text.find(content, start + 1, len(through)) >= 0:
        return None
    return start, start + len(content), len(through)


def trained_spans(
    tokenizer: PreTrainedTokenizerBase, messages: Messages, train_on: str, markers: tuple[str, ...]
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the [start, end) character spans that carry a loss. The row's tools
    (if any) are rendered in every prefix too, so the prefixes stay prefixes of the full text. A
    template that fails on the row makes it a bad row (`_guarded`), reported with its place or dropped."""
    state = _state(tokenizer)
    draw, tools = state.draw, getattr(messages, "tools", None)
    text, known_ends = _text_and_ends(state, messages)
    if train_on == "all":
        return text, [(0, len(text))]
    if known_ends is not None:  # its keys: the assistant messages, in order
        assistant_indices = list(known_ends)
    else:
        assistant_indices = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    assistant_indices = [i for i in assistant_indices if i >= getattr(messages, "first_trained", 0)]
    if train_on == "last_assistant":
        assistant_indices = assistant_indices[-1:]
    spans = []
    for i in assistant_indices:
        if len(messages[i]) > 2:  # tool calls, a reasoning trace: all the turn writes is trained
            spans.append(whole_turn_span(state, messages, tools, text, i, markers))
            continue
        content = messages[i]["content"].strip()
        if known_ends is not None:  # the shape render knows where the content was written (as is, or stripped)
            _, written_at, through_length = known_ends[i]
            raw = messages[i]["content"]
            start = written_at + (len(raw) - len(raw.lstrip()) if text.startswith(raw, written_at) else 0)
            content_end = start + len(content)
        else:
            place = _prefix_place(draw, messages, tools, text, i) or _marked_place(state, messages, tools, text, i, markers)
            if place is None:
                raise RowError(
                    f"message {i + 1} (assistant): the chat template is not prefix-stable for this conversation "
                    "(or writes this content more than once) and its rendering changes with the assistant's "
                    "content, so the turn cannot be located; choose another template")
            start, content_end, through_length = place
        spans.append((start, content_end + _end_of_turn_length(state, text[content_end:through_length], markers)))
    return text, _joined(spans)


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
