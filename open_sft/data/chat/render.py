"""Chat template rendering: the fastest renderer that matches apply_chat_template, per tokenizer, template and
--chat_template_kwargs, and the shape renders that place contents without rendering prefixes.

How a rendered conversation becomes training examples (which characters train) is data/chat/examples.py.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import operator
import re
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from open_sft.data.formats import Messages, RowError
from open_sft.data.tool_schemas import function_of
from open_sft.data.chat.environment_turns import environment_hint
from open_sft.data.chat.shape_render import ShapeRender, render_shape
from open_sft.data.chat.templates import content_writing, has_generation_tags, is_builtin_template
from open_sft.data.chat.thinking_blocks import reads_thinking_blocks, with_thinking_blocks
from open_sft.data.chat.turn_enders import TurnEnders, split_turn_closers

logger = logging.getLogger(__name__)

Renderer = Callable[[Messages, bool, Optional[list]], str]

_PROBE = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"},
          {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3 + 3?"},
          {"role": "assistant", "content": " 6 \n"}]
_PROBE_TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                   "required": ["a", "b"]}}}]
_RENDERERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _public_renderer(tokenizer: PreTrainedTokenizerBase, kwargs: Optional[dict] = None) -> Renderer:
    extra = dict(kwargs or {})

    def public(messages: Messages, add_generation_prompt: bool, tools: Optional[list]) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             tools=tools, **extra)
    return public


# per tokenizer, (its template, whether the direct renderer reproduced apply_chat_template on the probes): the probes
# (20 renders) run once per template, not again for each row with template variables of its own (smoltalk2's)
_DIRECT_CHECKED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _direct_renderer(tokenizer: PreTrainedTokenizerBase, kwargs: Optional[dict] = None) -> Optional[Renderer]:
    """Render with the compiled Jinja template and a context built from a dict prepared once.

    apply_chat_template's per-call argument handling, and Jinja's own `Template.render` (which merges
    the environment's globals, a ChainMap, into a new dict on every call), cost about 4× the template
    itself on short rows. Used only if it reproduces apply_chat_template exactly on probe
    conversations with and without tools (checked once per template: the variables only fill its
    context); otherwise None (use the public API)."""
    template, checked = _DIRECT_CHECKED.get(tokenizer, (None, None))
    if template == tokenizer.chat_template and checked is not None:
        return _compiled_renderer(tokenizer, kwargs) if checked else None
    direct = _checked_renderer(tokenizer, kwargs)
    _DIRECT_CHECKED[tokenizer] = (tokenizer.chat_template, direct is not None)
    return direct


def _compiled_renderer(tokenizer: PreTrainedTokenizerBase, kwargs: Optional[dict] = None) -> Renderer:
    from jinja2.runtime import new_context
    from transformers.utils.chat_template_utils import _compile_jinja_template

    compiled = _compile_jinja_template(tokenizer.chat_template)
    environment = compiled.environment
    base = {**compiled.globals, **tokenizer.special_tokens_map, "documents": None, **(kwargs or {})}

    def direct(messages: Messages, add_generation_prompt: bool, tools: Optional[list]) -> str:
        variables = {**base, "messages": messages, "add_generation_prompt": add_generation_prompt, "tools": tools}
        context = new_context(environment, compiled.name, compiled.blocks, variables, shared=True)
        return environment.concat(compiled.root_render_func(context))
    return direct


def _checked_renderer(tokenizer: PreTrainedTokenizerBase, kwargs: Optional[dict] = None) -> Optional[Renderer]:
    """The compiled renderer where it reproduces apply_chat_template on the probe conversations, else None."""
    try:
        direct = _compiled_renderer(tokenizer, kwargs)
        public = _public_renderer(tokenizer, kwargs)
        for tools in (None, _PROBE_TOOLS):
            for k in range(1, len(_PROBE) + 1):
                for generation_prompt in (False, True):
                    if direct(_PROBE[:k], generation_prompt, tools) != public(_PROBE[:k], generation_prompt, tools):
                        return None
        return direct
    except Exception:  # any template or transformers/jinja change: fall back to the public API
        return None


@dataclass
class TemplateState:
    """What rendering a tokenizer's current template needs: the renderer, the shape renders of the shapes seen,
    and (for a template open_sft ships) how it writes contents, so rows are filled into shape renders."""

    source: str
    draw: Renderer
    shape_renders: dict[tuple[str, ...], Optional[ShapeRender]] = field(default_factory=dict)
    contents: Optional[str] = None  # "as_is" / "trimmed": templates.content_writing
    markers: tuple[str, ...] = ()  # the markers `end_of_turn` remembers lengths for
    end_of_turn: dict[str, int] = field(default_factory=dict)  # suffix → its end-of-turn length
    middle_closings: dict[tuple[str, ...], str] = field(default_factory=dict)  # turns.py
    enders: dict[tuple[str, ...], TurnEnders] = field(default_factory=dict)  # turn_enders.py, per marker set
    builtin: bool = False  # a template open_sft ships (templates.is_builtin_template)
    generation_tags: bool = False  # it marks what the assistant writes with {% generation %}
    string_arguments: Optional[bool] = None  # it takes tool-call arguments as strings only (tool_arguments.py)
    tagless_reasoning: Optional[bool] = None  # it writes a reasoning field without <think> tags (reasoning.py)
    call_ids: Optional[tuple[bool, bool]] = None  # it writes calls' ids, results' tool_call_id (call_ids.py)
    trace_markers: Optional[tuple[str, str]] = None  # the special tokens around a trace it writes (trace_markers.py)


def schema_key_hint(problem: str, tools: Optional[list]) -> str:
    """`; each tool schema needs 'description' under this template` where the template's error names a key some
    tool schema lacks (gpt-oss's writes every schema's description: `'dict object' has no attribute
    'description'`), else ""."""
    missing = re.search(r"has no attribute '(\w+)'", problem)
    if not missing or not tools:
        return ""
    key = missing.group(1)
    schemas = [function_of(tool) for tool in tools]
    lacking = [schema.get("name", "?") for schema in schemas if isinstance(schema, dict) and key not in schema
               and key not in (schema.get("parameters") if isinstance(schema.get("parameters"), dict) else {})]
    if not lacking:
        return ""
    return f"; each tool schema needs '{key}' under this template (without it: {', '.join(map(str, lacking))})"


def _guarded(draw: Renderer, source: str = "") -> Renderer:
    """The renderer, with any failure of the template raised as the row's error (reason template_error)
    rather than a crash of the whole build: raise_exception on a role it has no turn for, turns that do
    not alternate, a variable it assumes (a tool-use template iterating `tools` the row does not have).
    A template that assigns to a message's or tool's attribute (`source`, its text) is named so
    (template_not_jinja2)."""
    def guarded(messages: Messages, add_generation_prompt: bool, tools: Optional[list]) -> str:
        try:
            return draw(messages, add_generation_prompt, tools)
        except Exception as exc:
            problem = str(exc) if isinstance(exc, TemplateError) else f"{type(exc).__name__}: {exc}"
            assigned = attribute_assignment(source) if "non-namespace object" in problem else ""
            if assigned:
                raise RowError(f"the chat template assigns to an attribute of an object that is no namespace "
                               f"({assigned}), which llama.cpp's template engine allows and Jinja2, which "
                               "transformers renders chat templates with (apply_chat_template, vLLM too), refuses "
                               f"({problem}): the row is fine, this form of the template does not run under "
                               "Jinja2. Give a form written for Jinja2 (the model repository's own, or one that keeps "
                               "such values in a {% set ns = namespace(...) %}) with --chat_template_path",
                               "template_not_jinja2") from None
            problem += schema_key_hint(problem, tools) + environment_hint(source, messages)
            if not tools and _renders_with_tools(draw, messages, add_generation_prompt):
                raise RowError(f"the chat template cannot render a conversation without tools ({problem}; it renders "
                               "this one given a tools list): the row is fine, the template needs a tools list. Choose "
                               "a form of the template that renders conversations without tools with "
                               "--chat_template_name or --chat_template_path, or give such rows the 'tools' they "
                               "may call",
                               "template_needs_tools") from None
            raise RowError(f"the chat template rejects this conversation ({problem}); fix the row, choose another "
                           "template with --chat_template_name or --chat_template_path, or skip such rows with "
                           "--on_bad_row drop", "template_error") from None
    return guarded


_ATTRIBUTE_SET = re.compile(r"{%-?\s*set\s+(\w+)\.(\w+)\s*=")  # {% set message.tool_calls = ... %}


def attribute_assignment(source: str) -> str:
    """The first statement of template `source` that assigns to an attribute of a name it never makes a namespace,
    with its line and how many more there are (`{% set tool.mt_visited = … %} (line 96; 6 more)`, as llama.cpp's form
    of MiroThinker-v1's writes them), "" if none."""
    found = [(f"{{% set {m.group(1)}.{m.group(2)} = … %}}", source.count("\n", 0, m.start()) + 1)
             for m in _ATTRIBUTE_SET.finditer(source)
             if not re.search(r"set\s+" + m.group(1) + r"\s*=\s*namespace\(", source)]
    if not found:
        return ""
    (statement, line), more = found[0], len(found) - 1
    return f"{statement} (line {line}{f'; {more} more' if more else ''})"


def _renders_with_tools(draw: Renderer, messages: Messages, add_generation_prompt: bool) -> bool:
    """Whether the template renders `messages`, which it refused without tools, given an (empty) tools list: one
    that iterates `tools` whenever it is defined (llama.cpp's form of Phi-4-mini's; apply_chat_template always
    defines it, None for a row without tools)."""
    try:
        draw(messages, add_generation_prompt, [])
    except Exception:  # noqa: BLE001 (it refuses the row for another reason)
        return False
    return True


@dataclass(frozen=True)
class ChatOptions:
    """How a source's conversations are rendered and trained, besides the template: `template_kwargs`
    (--chat_template_kwargs, as sorted JSON: passed to every render, `enable_thinking` say), `reasoning_loss`
    ("train", or "mask": the reasoning text is context, not trained) and `reasoning_history` ("template": the
    context of a turn is what the template renders, or "keep": earlier turns as generated, one example)."""

    template_kwargs: str = "{}"
    reasoning_loss: str = "train"
    reasoning_history: str = "template"  # or "keep": one example a conversation (turn_render.kept_history)

    def kwargs(self) -> dict:
        return json.loads(self.template_kwargs)


DEFAULT_OPTIONS = ChatOptions()


def chat_options(args, spec=None) -> ChatOptions:
    """The options of DataArguments' --chat_template_kwargs (validated up front: config.checks), with a source's
    own variables over them (`spec`, a SourceSpec), --reasoning_loss and --reasoning_history."""
    kwargs = json.loads(args.chat_template_kwargs) if args.chat_template_kwargs else {}
    if spec is not None and spec.chat_template_kwargs:
        kwargs.update(json.loads(spec.chat_template_kwargs))
    return ChatOptions(json.dumps(kwargs, sort_keys=True), args.reasoning_loss, args.reasoning_history)


def row_options(options: ChatOptions, messages: Messages) -> ChatOptions:
    """`options` with the row's own template variables over theirs (its chat_template_kwargs column, smoltalk2's:
    data/row_template_kwargs.py): the row's value of a variable wins over the source's and --chat_template_kwargs'."""
    own = getattr(messages, "template_kwargs", None)
    if not own:
        return options
    return dataclasses.replace(options, template_kwargs=json.dumps({**options.kwargs(), **own}, sort_keys=True))


_MAX_OPTION_STATES = 64  # template states kept per tokenizer: rows with their own variables (tools) make many


def template_state(tokenizer: PreTrainedTokenizerBase, options: ChatOptions = DEFAULT_OPTIONS) -> TemplateState:
    """The tokenizer's template state for these options, made again when its template changes (the states of the
    least recently used options dropped past _MAX_OPTION_STATES: the source's own, which most rows use between rows
    with variables of their own, stays)."""
    by_options = _RENDERERS.get(tokenizer)
    if by_options is None or by_options.get("source") != tokenizer.chat_template:
        by_options = {"source": tokenizer.chat_template}
        _RENDERERS[tokenizer] = by_options
    cached = by_options.pop(options.template_kwargs, None)
    if cached is not None:  # the most recently used now: last in the dict's order
        by_options[options.template_kwargs] = cached
    else:
        if len(by_options) > _MAX_OPTION_STATES:
            del by_options[next(key for key in by_options if key != "source")]
        kwargs = options.kwargs()
        cached = TemplateState(tokenizer.chat_template, _guarded(_direct_renderer(tokenizer, kwargs)
                                                             or _public_renderer(tokenizer, kwargs),
                                                             tokenizer.chat_template))
        if reads_thinking_blocks(cached.draw):  # Magistral's: a trace as a content block only
            cached.draw = with_thinking_blocks(cached.draw)
        cached.builtin = is_builtin_template(tokenizer.chat_template)
        cached.generation_tags = has_generation_tags(tokenizer.chat_template)
        contents = content_writing(tokenizer.chat_template)
        if contents is not None and not kwargs and _fill_agrees(cached, contents):
            cached.contents = contents
        by_options[options.template_kwargs] = cached
    return cached


def renderer_for(tokenizer: PreTrainedTokenizerBase, options: ChatOptions = DEFAULT_OPTIONS) -> Renderer:
    """The fastest renderer that matches apply_chat_template, checked once per tokenizer and template."""
    return template_state(tokenizer, options).draw


_MAX_SHAPE_RENDERS = 4096  # distinct role sequences remembered per tokenizer (a few dozen in real data)
_ROLE, _CONTENT = operator.itemgetter("role"), operator.itemgetter("content")


def _shape_render(state: TemplateState, roles: tuple[str, ...]) -> Optional[ShapeRender]:
    if roles in state.shape_renders:
        return state.shape_renders[roles]
    shape = render_shape(state.draw, roles)
    if len(state.shape_renders) < _MAX_SHAPE_RENDERS:
        state.shape_renders[roles] = shape
    return shape


def text_and_ends(state: TemplateState, messages: Messages) -> tuple[str, Optional[dict]]:
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


def _fill_agrees(state: TemplateState, contents: str) -> bool:
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
           tools: Optional[list] = None, options: ChatOptions = DEFAULT_OPTIONS) -> str:
    """The chat template's text for `messages` (and the row's tool schemas, if any)."""
    return renderer_for(tokenizer, options)(messages, add_generation_prompt, tools)


def special_markers(tokenizer: PreTrainedTokenizerBase) -> tuple[str, ...]:
    """Strings that can close an assistant turn: the tokenizer's special tokens, including added
    tokens flagged special (Llama 3's `<|eot_id|>`, chatml's `<|im_end|>`), longest first."""
    tokens = set(tokenizer.all_special_tokens)
    tokens |= {token.content for token in tokenizer.added_tokens_decoder.values() if token.special}
    return tuple(sorted(tokens, key=len, reverse=True))


@functools.lru_cache(maxsize=16)
def special_text(markers: tuple[str, ...]) -> Optional[re.Pattern]:
    """What finds the literal text of a special token (special_markers) in a row's own text, where the tokenizer
    encodes it as that control token (transformers' default, as open-instruct's and TRL's tokenization): a
    `<|im_end|>` in an answer trains a fake end of turn, an `<|endoftext|>` in a web page a fake document end.
    None for a tokenizer without special tokens. (A literal alternation: the regex engine skips every position
    whose character opens no marker, GB/s on real text.)"""
    return re.compile("|".join(map(re.escape, markers))) if markers else None


# the prefix of the notes' keys (workers, documents) that count the rows holding one special token's text: the
# key `FOUND_NOTE + "<|im_end|>"` beside the note `special_tokens_in_text` (open_sft.data.summary)
FOUND_NOTE = "special_tokens_in_text "


def special_text_in(tokenizer: PreTrainedTokenizerBase, markers: tuple[str, ...], texts: Iterable[Any]
                    ) -> tuple[str, ...]:
    """The special tokens (of `markers`, special_markers) whose literal text the strings among `texts` hold, but
    those the user added with --add_tokens or --add_special_tokens (`open_sft_user_tokens`): tool or role tokens
    written in the data on purpose."""
    return special_text_finder(tokenizer, markers)(*texts)


def special_text_finder(tokenizer: PreTrainedTokenizerBase, markers: tuple[str, ...]
                        ) -> Callable[..., tuple[str, ...]]:
    """special_text_in's search, its pattern and the user's tokens looked up once: for a chunk of documents, where a
    lookup per document would hash Llama 3's 256 markers each time."""
    found, user = special_text(markers), frozenset(getattr(tokenizer, "open_sft_user_tokens", ()))

    def tokens_in(*texts: Any) -> tuple[str, ...]:
        if found is None:
            return ()
        hits = {hit for text in texts if isinstance(text, str) for hit in found.findall(text)}
        return tuple(sorted(hits - user)) if hits else ()

    return tokens_in


def warn_split_turn_closers(tokenizer) -> None:
    """Warn once where the chat template closes an answer with a marker that is not one token of the tokenizer
    (a tokenizer's own chatml template without <|im_end|> in its vocabulary): it trains as several pieces and
    generation_config.json cannot list it, so the model never stops."""
    if not isinstance(getattr(tokenizer, "chat_template", None), str):
        return
    for marker, pieces in split_turn_closers(renderer_for(tokenizer), tokenizer.tokenize):
        logger.warning("the chat template closes an assistant turn with %s, which the tokenizer splits into %d "
                       "pieces (%s): it trains as text and generation cannot stop at it; choose a template with "
                       "--chat_template_name (which adds its tokens, e.g. chatml), or add it with "
                       "--add_special_tokens FILE (a file with the line %s)", marker, len(pieces), " ".join(pieces),
                       marker)
