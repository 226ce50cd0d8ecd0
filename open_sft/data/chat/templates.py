"""Built-in chat templates, and choosing the one a run uses.

Every name of open-instruct's --chat_template_name renders what open-instruct's template of that name
renders (oi_templates.py); chatml and llama3 are open_sft's own. Not all are prefix-stable (several
close only the last assistant turn with eos, or write the generation prompt differently from the
turn), which the label step handles (render.py). If the tokenizer lacks a template's special tokens
(say `<|im_end|>` on a GPT-NeoX tokenizer) they are added as special tokens, and the model's
embeddings are resized to match.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from open_sft.data.chat.oi_templates import CHATML_TOKENS, OPEN_INSTRUCT_TEMPLATES
from open_sft.data.row_template_kwargs import RESERVED_KWARGS
from open_sft.errors import UserError

logger = logging.getLogger(__name__)

_RAISE_UNKNOWN = "{{ raise_exception('unknown role ' + message['role']) }}"


CHATML = (
    "{% for message in messages %}"
    "{% if message['role'] in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% else %}" + _RAISE_UNKNOWN + "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] in ['system', 'user', 'assistant', 'tool'] %}"
    "{% set role = 'ipython' if message['role'] == 'tool' else message['role'] %}"
    "{{ '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% else %}" + _RAISE_UNKNOWN + "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

# The embedded tiny model's template (open_sft/embedded/factory.py): tulu's turns after a bos token.
EMBEDDED = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{{ '<|system|>\n' + message['content'] + '\n' }}"
    "{% elif message['role'] == 'user' %}"
    "{{ '<|user|>\n' + message['content'] + '\n' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '<|assistant|>\n' + message['content'] + eos_token + '\n' }}"
    "{% else %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


@dataclass(frozen=True)
class BuiltinTemplate:
    source: str
    special_tokens: tuple[str, ...] = ()  # must be single tokens (added when the tokenizer lacks them)
    # how it writes each message's content: "as_is", "trimmed" (see content_writing), None: not assumed
    contents: Optional[str] = None


# open-instruct's names mean what they mean there (oi_templates.py); chatml and llama3 are open_sft's.
# Of open-instruct's, those that write each content once, in order, as it is: their rows fill shape renders.
_FILLED = {"tulu", "zephyr", "qwen_instruct_user_boxed_math"}
BUILTIN_TEMPLATES = {
    **{name: BuiltinTemplate(source, tokens, "as_is" if name in _FILLED else None)
       for name, (source, tokens) in OPEN_INSTRUCT_TEMPLATES.items()},
    "chatml": BuiltinTemplate(CHATML, CHATML_TOKENS, "as_is"),
    "llama3": BuiltinTemplate(LLAMA3, ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"), "trimmed"),
}
_BUILTIN_SOURCES = {t.source for t in BUILTIN_TEMPLATES.values()} | {EMBEDDED}
_CONTENT_WRITING = {**{t.source: t.contents for t in BUILTIN_TEMPLATES.values() if t.contents}, EMBEDDED: "as_is"}


def is_builtin_template(template: Optional[str]) -> bool:
    """Whether the template is one open_sft ships (open-instruct's names, chatml, llama3, the embedded model's)."""
    return isinstance(template, str) and template in _BUILTIN_SOURCES


def content_writing(template: Optional[str]) -> Optional[str]:
    """For a template open_sft ships, how it writes message contents: "as_is" or "trimmed". Each such
    template writes every message's content exactly once, in message order, and nothing else in its
    text depends on a content (it reads only roles, the special tokens and add_generation_prompt), so
    a row's text is its shape render filled with the contents (render.py skips Jinja; tested equal to
    rendering). None for any other template: nothing is assumed about it."""
    return _CONTENT_WRITING.get(template) if template else None


def _generation_tags() -> type:
    """A Jinja extension that parses transformers' `{% generation %} ... {% endgeneration %}` (the marks of
    what the assistant generates, which apply_chat_template accepts) as a plain block: for the syntax check."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationTags(Extension):
        tags = {"generation"}

        def parse(self, parser):  # type: ignore[no-untyped-def]
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body).set_lineno(lineno)

    return GenerationTags


def has_generation_tags(template: Optional[str]) -> bool:
    return isinstance(template, str) and re.search(r"\{%-?\s*generation\s*-?%\}", template) is not None


def jinja_syntax_problem(source: str) -> Optional[str]:
    """Where a chat template is not valid Jinja ("line N: what"), else None: found once, up front, rather than
    as every row's rendering error. Parsing only: filters and globals that transformers adds at render time
    (tojson, raise_exception, ...) are not resolved here; its `{% generation %}` tags are accepted."""
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols", _generation_tags()]).parse(source)
    except TemplateSyntaxError as exc:
        return f"line {exc.lineno}: {exc.message}"
    return None


_PROBE = [{"role": "user", "content": "probeQuestion7431"}, {"role": "assistant", "content": "probeAnswer2958"}]


def conversation_render_problem(source: str) -> Optional[str]:
    """Why a template that parses is no chat template, else None: it must render a user message and an assistant
    reply (with transformers' filters and globals, as every row is rendered) and write the reply, which is what is
    trained (open-instruct's assistant_message_only writes only that). Any file without Jinja tags parses (a .jsonl
    given by mistake rendered as itself, and the error blamed the first conversation's template as 'not
    prefix-stable')."""
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        (rendered,), _ = render_jinja_template([_PROBE], chat_template=source, bos_token="", eos_token="")
    except Exception as exc:  # noqa: BLE001 (any error of the template's own code: said with the flag)
        return f"cannot render a conversation of a user message and an assistant reply ({type(exc).__name__}: {exc})"
    if _PROBE[-1]["content"] not in rendered:
        begins = " ".join(source.split())[:60]
        return f"not a chat template: it does not write a conversation's assistant reply (the file begins {begins!r})"
    return None


def chat_template_problems(name: Optional[str], path: Optional[str]) -> list[str]:
    """What is wrong with --chat_template_name / --chat_template_path (config.checks reports it up front)."""
    if path:
        if not Path(path).is_file():
            return [f"--chat_template_path {path}: no such file; give a Jinja template file"]
        try:
            source = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            return [f"--chat_template_path {path}: cannot be read as UTF-8 text ({exc})"]
        problem = jinja_syntax_problem(source)
        if problem:
            return [f"--chat_template_path {path} {problem}; fix the template"]
        problem = conversation_render_problem(source)
        return [f"--chat_template_path {path}: {problem}; give a Jinja chat template file"] if problem else []
    if name is not None and name not in BUILTIN_TEMPLATES:
        return [f"--chat_template_name {name!r} is not a built-in template; choose one of "
                f"{', '.join(BUILTIN_TEMPLATES)}, or pass a Jinja file with --chat_template_path, or leave the flag "
                "out for the tokenizer's own template (which open-instruct trains with for a name it does not know, "
                "as its OLMo 3 scripts' olmo123)"]
    return []


def template_kwargs_problems(value: Optional[str]) -> list[str]:
    """What is wrong with --chat_template_kwargs (a JSON object of template variables)."""
    if value is None:
        return []
    import json

    try:
        kwargs = json.loads(value)
    except ValueError as exc:
        return [f"--chat_template_kwargs {value!r} is not JSON ({exc}); give an object such as "
                "'{\"enable_thinking\": false}'"]
    if not isinstance(kwargs, dict):
        return [f"--chat_template_kwargs {value!r}: give a JSON object of template variables, such as "
                "'{\"enable_thinking\": false}'"]
    reserved = sorted(set(kwargs) & RESERVED_KWARGS)
    if reserved:
        return [f"--chat_template_kwargs sets {', '.join(reserved)}: apply_chat_template's own arguments, not "
                "template variables (open_sft passes the row's messages and tools and the generation prompt itself); "
                "remove them"]
    return []


def apply_chat_template_choice(tokenizer, name: Optional[str], path: Optional[str]) -> list[str]:
    """Set the run's chat template on the tokenizer; returns the special tokens that had to be added.

    Precedence: --chat_template_path, then --chat_template_name, then the tokenizer's own template. A
    tokenizer without one (a base model's) is fine for text documents; a chat source is refused with
    a clear message when the build reaches it.
    """
    problems = chat_template_problems(name, path)
    if problems:
        raise UserError("; ".join(problems))
    if path:
        if name is not None:
            logger.warning("--chat_template_path %s overrides --chat_template_name %s (drop one of the two)", path, name)
        tokenizer.chat_template = Path(path).read_text()
        return []
    if name is None:
        _check_own_template(tokenizer)
        return []
    template = BUILTIN_TEMPLATES[name]
    vocab = tokenizer.get_vocab()
    missing = [token for token in template.special_tokens if token not in vocab]
    if missing:
        tokenizer.add_tokens(missing, special_tokens=True)
        remember_new_tokens(tokenizer, tokenizer.convert_tokens_to_ids(missing))
        logger.info("chat template %s: added the special tokens %s to the tokenizer", name, ", ".join(missing))
    tokenizer.chat_template = template.source
    return missing


def _check_own_template(tokenizer) -> None:
    """The tokenizer's own chat template (one, or several by name), parsed before any row is rendered."""
    own = tokenizer.chat_template
    named = own if isinstance(own, dict) else {"": own} if isinstance(own, str) else {}
    for key, source in named.items():
        problem = jinja_syntax_problem(source) if isinstance(source, str) else None
        if problem:
            which = f" {key!r}" if key else ""
            raise UserError(f"the tokenizer's chat template{which} ({getattr(tokenizer, 'name_or_path', '')}) is not "
                            f"valid Jinja: {problem}; fix it in the tokenizer's files, or choose a template with "
                            "--chat_template_name or --chat_template_path")


def remember_new_tokens(tokenizer, ids: list[int]) -> None:
    """Ids the run added to the vocabulary: `open_sft_added_ids` until their embedding rows are initialised
    (open_sft.model.load.fit_embeddings_to_tokenizer), `open_sft_new_ids` for good (LoRA trains their rows)."""
    for attribute in ("open_sft_added_ids", "open_sft_new_ids"):
        setattr(tokenizer, attribute, sorted(set(getattr(tokenizer, attribute, [])) | set(ids)))
