"""The chat template variables `generate`, `chat` and `compare` render with (--chat_template_kwargs): the flag's,
else the ones the run trained with (its run.json), so that a prompt is the context training rendered (Qwen3 trained
with enable_thinking false closes an empty think block in its prompt; Gemma 4 trained with enable_thinking true writes
`<|think|>` in its system turn). They are bound to the loaded tokenizer, so every render of a command has them: its
prompts and the probes that read a template's reasoning and call layouts (open_sft.export.trace_layout, call_probe).

A run whose sources trained with different variables (a per-source chat_template_kwargs) has no one set its prompts
follow: the run's --chat_template_kwargs are used, and the sources that differed are named with the flag to choose.
"""

from __future__ import annotations

import argparse
import functools
import json
import keyword
import weakref
from pathlib import Path
from typing import Any, Callable, Optional

from open_sft.data.per_tokenizer import renders_changed
from open_sft.errors import UserError
from open_sft.export.names import MERGED_DIR

FLAG = "--chat_template_kwargs"
_BOUND: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # tokenizer → the variables bound to it


def add_template_kwargs_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(FLAG, default=None, metavar="JSON",
                        help="a JSON object of chat template variables passed to every render, as finetune's "
                             "--chat_template_kwargs (e.g. '{\"enable_thinking\": false}'); default: the ones the run "
                             "in the model directory trained with (its run.json), else none")


def parse_template_kwargs(value: str) -> dict[str, Any]:
    """--chat_template_kwargs as finetune reads it (open_sft.data.chat.templates.template_kwargs_problems)."""
    from open_sft.data.chat.templates import template_kwargs_problems

    problems = template_kwargs_problems(value)
    if problems:
        raise UserError("; ".join(problems))
    return json.loads(value)


def run_record(directory: Path) -> Optional[Path]:
    """The run.json of the run that wrote `directory` (its output directory, an `open_sft export` of a checkpoint,
    or its merged/), None where there is none (a base model, a directory copied without it)."""
    for candidate in (directory, directory.parent if directory.name == MERGED_DIR else None):
        if candidate is not None and (candidate / "run.json").is_file():
            return candidate / "run.json"
    return None


def trained_kwargs(record: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(the variables a run's prompts render with, the sources that trained with others) from run.json: every
    source's own (its per-source chat_template_kwargs over the run's) where they are all the same, else the run's
    --chat_template_kwargs, and each source that differs from them named with its variables."""
    data = record.get("args", {}).get("data", {})
    shared = json.loads(data.get("chat_template_kwargs") or "{}")
    per_source = data.get("dataset_mixer_list_chat_template_kwargs") or []
    if not per_source:
        return shared, []
    names = (data.get("dataset_mixer_list") or [])[0::2] or [f"source {i + 1}" for i in range(len(per_source))]
    own = [{**shared, **json.loads(per_source[0 if len(per_source) == 1 else i] or "{}")} for i in range(len(names))]
    if all(kwargs == own[0] for kwargs in own):
        return own[0], []
    return shared, [f"{name} {json.dumps(kwargs, sort_keys=True)}" for name, kwargs in zip(names, own)
                    if kwargs != shared]


def template_kwargs(value: Optional[str], directories: tuple[Path, ...]) -> tuple[dict[str, Any], Optional[str]]:
    """(the variables to render with, the line that says where they come from: None where there are none to say):
    --chat_template_kwargs `value` when given, else those of the first of `directories` that a run wrote (compare
    asks its AFTER directory first: both models answer the same prompts). A bad flag is a UserError naming it."""
    if value is not None:
        return parse_template_kwargs(value), None
    for directory in directories:
        path = run_record(directory)
        if path is None:
            continue
        try:
            kwargs, differing = trained_kwargs(json.loads(path.read_text()))
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            raise UserError(f"{path} is not a readable run record ({exc}); pass {FLAG} JSON with the chat template "
                            f"variables the run trained with ('{{}}' for none)") from exc
        if not kwargs and not differing:
            return {}, None
        line = f"{directory}: prompts render with the chat template variables the run trained with, " \
               f"{json.dumps(kwargs, sort_keys=True)} ({path}; {FLAG} JSON overrides)"
        if differing:
            line += f"; its sources trained with others, not used here: {', '.join(differing)}"
        return kwargs, line
    return {}, None


def bind_template_kwargs(tokenizer: Any, kwargs: dict[str, Any]) -> Any:
    """`tokenizer` with `kwargs` passed to each of its apply_chat_template calls (a call's own arguments over them);
    what was read off its renders before (the probes' layouts, kept per tokenizer) is read again. Binding twice is
    an error (the second set would stack on the first): bind once, after loading it."""
    if tokenizer in _BOUND:
        raise ValueError(f"chat template variables {json.dumps(_BOUND[tokenizer], sort_keys=True)} are bound to this "
                         "tokenizer already")
    if kwargs:
        _BOUND[tokenizer] = dict(kwargs)  # the variables alone: a method here would keep the tokenizer alive
        tokenizer.apply_chat_template = functools.partial(unbound(tokenizer), **kwargs)
        renders_changed(tokenizer)
    return tokenizer


def unbound(tokenizer: Any) -> Callable[..., Any]:
    """The tokenizer's own apply_chat_template, whatever is bound to it."""
    return type(tokenizer).apply_chat_template.__get__(tokenizer)


def unbound_renderer(tokenizer: Any) -> Optional[Callable[..., Any]]:
    """The tokenizer's apply_chat_template without the variables bound to it (its template's defaults), None where
    none are bound."""
    return unbound(tokenizer) if tokenizer in _BOUND else None


def template_kwargs_or_exit(args: argparse.Namespace, directories: tuple[Path, ...]) -> Optional[dict[str, Any]]:
    """template_kwargs for a command's arguments, their line said on stderr; None after printing the error."""
    import sys

    try:
        kwargs, line = template_kwargs(args.chat_template_kwargs, directories)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None
    if line and not getattr(args, "raw", False):  # --raw renders no template: nothing to say
        print(line, file=sys.stderr, flush=True)
    return kwargs


def card_section(record: dict[str, Any]) -> list[str]:
    """The model card's section on the variables the run rendered its template with (none: no section): no file of a
    model directory carries them to other tools (transformers' apply_chat_template takes them per call, vLLM per
    request or by `vllm serve --default-chat-template-kwargs`), so the card says how to pass them."""
    kwargs, differing = trained_kwargs(record)
    if not kwargs and not differing:
        return []
    lines = ["## Chat template variables", ""]
    if kwargs:
        text = json.dumps(kwargs, sort_keys=True)
        lines += [f"The run rendered its chat template with `{text}` (--chat_template_kwargs): render prompts with "
                  "them, as the model trained, or it is asked in a form it never saw (a think block opened or closed, a "
                  "system turn's marker). They are not stored in the model's files; pass them:", "",
                  f"- transformers: `tokenizer.apply_chat_template(messages, add_generation_prompt=True, "
                  f"{python_keywords(kwargs)})`",
                  f"- vLLM: `vllm serve MODEL_DIR --default-chat-template-kwargs '{text}'`, or per request "
                  f"`\"chat_template_kwargs\": {text}`",
                  "- `open_sft generate`, `chat` and `compare` read them from run.json (--chat_template_kwargs overrides)"]
    else:
        lines.append("The run set no chat template variables (--chat_template_kwargs); its sources rendered the "
                     "template with their own, so no one set is the form the model trained in.")
    if differing:
        lines += ["", "Sources that trained with their own variables: " + "; ".join(f"`{d}`" for d in differing)]
    return lines + [""]


def python_keywords(kwargs: dict[str, Any]) -> str:
    """`kwargs` as a Python call's keyword arguments: `enable_thinking=False`, a key no keyword can name in
    `**{...}`."""
    named = {name: value for name, value in kwargs.items() if name.isidentifier() and not keyword.iskeyword(name)}
    others = {name: value for name, value in kwargs.items() if name not in named}
    words = [f"{name}={value!r}" for name, value in sorted(named.items())]
    return ", ".join(words + ([f"**{dict(sorted(others.items()))!r}"] if others else []))
