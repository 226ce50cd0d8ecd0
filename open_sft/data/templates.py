"""Built-in chat templates, and choosing the one a run uses.

Every template here is prefix-stable (rendering the first k messages is a prefix of rendering all
of them), which the label step relies on, and closes assistant turns with a declared end-of-turn
token. If the tokenizer lacks a template's special tokens (say chatml's `<|im_end|>` on a GPT-NeoX
tokenizer) they are added as special tokens, and the model's embeddings are resized to match.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from open_sft.errors import UserError

_RAISE_UNKNOWN = "{{ raise_exception('unknown role ' + message['role']) }}"


def _tagged(prefix: str, sep: str, bos: bool = False) -> str:
    """Templates of the form `<|role|>` newline content, assistant turns closed by eos (tulu, olmo)."""
    start = "{{ bos_token }}" if bos else ""
    return (
        start + "{% for message in messages %}"
        "{% if message['role'] in ['system', 'user', 'assistant', 'tool'] %}"
        "{{ '" + prefix + "' + message['role'] + '|>" + sep + "' + message['content'] }}"
        "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}"
        "{% else %}" + _RAISE_UNKNOWN + "{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '" + prefix + "assistant|>" + sep + "' }}{% endif %}"
    )


TULU = _tagged("<|", "\\n")
OLMO = _tagged("<|", "\\n", bos=True)

SIMPLE_CHAT = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] + '\\n\\n' }}"
    "{% elif message['role'] == 'user' %}{{ 'User: ' + message['content'] + '\\n\\n' }}"
    "{% elif message['role'] == 'tool' %}{{ 'Tool: ' + message['content'] + '\\n\\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ 'Assistant: ' + message['content'] + eos_token + '\\n\\n' }}"
    "{% else %}" + _RAISE_UNKNOWN + "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant: ' }}{% endif %}"
)

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

ZEPHYR = (
    "{% for message in messages %}"
    "{% if message['role'] in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% else %}" + _RAISE_UNKNOWN + "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
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
    contents: str = "as_is"  # how it writes each message's content: "as_is" or "trimmed" (see content_writing)


BUILTIN_TEMPLATES = {
    "tulu": BuiltinTemplate(TULU),
    "olmo": BuiltinTemplate(OLMO),
    "simple_chat": BuiltinTemplate(SIMPLE_CHAT),
    "chatml": BuiltinTemplate(CHATML, ("<|im_start|>", "<|im_end|>")),
    "llama3": BuiltinTemplate(LLAMA3, ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"), "trimmed"),
    "zephyr": BuiltinTemplate(ZEPHYR),
}
_CONTENT_WRITING = {**{t.source: t.contents for t in BUILTIN_TEMPLATES.values()}, EMBEDDED: "as_is"}


def content_writing(template: Optional[str]) -> Optional[str]:
    """For a template open_sft ships, how it writes message contents: "as_is" or "trimmed". Each such
    template writes every message's content exactly once, in message order, and nothing else in its
    text depends on a content (it reads only roles, the special tokens and add_generation_prompt), so
    a row's text is its shape's layout filled with the contents (render.py skips Jinja; tested equal to
    rendering). None for any other template: nothing is assumed about it."""
    return _CONTENT_WRITING.get(template) if template else None


def apply_chat_template_choice(tokenizer, name: Optional[str], path: Optional[str]) -> list[str]:
    """Set the run's chat template on the tokenizer; returns the special tokens that had to be added.

    Precedence: --chat_template_path, then --chat_template_name, then the tokenizer's own template. A
    tokenizer without one (a base model's) is fine for text documents; a chat source is refused with
    a clear message when the pipeline reaches it.
    """
    if path:
        file = Path(path)
        if not file.is_file():
            raise UserError(f"--chat_template_path {path}: no such file; give a Jinja template file")
        tokenizer.chat_template = file.read_text()
        return []
    if name is None:
        return []
    if name not in BUILTIN_TEMPLATES:
        raise UserError(f"--chat_template_name {name!r} is not a built-in template; choose one of "
                        f"{', '.join(BUILTIN_TEMPLATES)}, or pass a Jinja file with --chat_template_path")
    template = BUILTIN_TEMPLATES[name]
    vocab = tokenizer.get_vocab()
    missing = [token for token in template.special_tokens if token not in vocab]
    if missing:
        tokenizer.add_tokens(missing, special_tokens=True)
    tokenizer.chat_template = template.source
    return missing
