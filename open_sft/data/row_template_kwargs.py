"""A row's own chat template variables: a `chat_template_kwargs` column, as HuggingFaceTB/smoltalk2's SFT subsets
give each conversation the variables SmolLM3's template reads (`enable_thinking`, `xml_tools`, `python_tools`,
`custom_instructions`). They are passed to every render of that row, over --chat_template_kwargs and the source's
own (data/chat/render.row_options)."""

from __future__ import annotations

import json
from typing import Any, Optional

from open_sft.data.row_error import RowError

COLUMN = "chat_template_kwargs"


def _apply_chat_template_arguments() -> frozenset[str]:
    """The installed transformers' apply_chat_template arguments (5.25 added sanitize_control_tokens): a variable of
    such a name would be taken as the argument, not handed to the template, and rendered otherwise by the compiled
    renderer than by apply_chat_template."""
    import inspect

    from transformers import PreTrainedTokenizerBase

    parameters = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters.values()
    return frozenset(p.name for p in parameters
                     if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))


# apply_chat_template's own arguments, and what every render is given: not template variables to set (the names
# written here hold whatever the installed transformers' signature says; `messages` is what templates read)
RESERVED_KWARGS = frozenset({
    "messages", "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message", "tokenize",
    "chat_template", "return_dict", "return_assistant_tokens_mask", "padding", "truncation", "max_length",
    "return_tensors", "tokenizer_kwargs"}) | _apply_chat_template_arguments()


def row_template_kwargs(row: dict[str, Any]) -> Optional[dict]:
    """The row's `chat_template_kwargs` (an object, or that object as a JSON string), its null values left out (a
    column read through Arrow, as smoltalk2's parquet, gives every row every key any row has, null where it has
    none: `enable_thinking: null` would switch SmolLM3's thinking off); None where the row has none."""
    value = row.get(COLUMN)
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else None
        except ValueError as exc:
            raise RowError(f"{COLUMN!r} is a string but not JSON ({exc}); give an object of the chat template's "
                           "variables for this row, such as {\"enable_thinking\": false}",
                           "bad_template_kwargs") from None
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RowError(f"{COLUMN!r} is a {type(value).__name__} ({str(value)[:60]!r}); give an object of the chat "
                       "template's variables for this row, such as {\"enable_thinking\": false}, or null",
                       "bad_template_kwargs")
    reserved = sorted(set(value) & RESERVED_KWARGS)
    if reserved:
        raise RowError(f"{COLUMN!r} sets {', '.join(reserved)}: apply_chat_template's own arguments, not template "
                       "variables (open_sft passes the row's messages and tools and the generation prompt itself); "
                       "give those as the row's columns and remove them here",
                       "bad_template_kwargs")
    kwargs = {key: item for key, item in value.items() if item is not None}
    try:
        json.dumps(kwargs)  # the row's render options are keyed by them as JSON (data/chat/render.row_options)
    except (TypeError, ValueError) as exc:
        raise RowError(f"{COLUMN!r} holds a value that is not JSON ({exc}); give the template's variables as JSON "
                       "values (strings, numbers, booleans, lists, objects)", "bad_template_kwargs") from None
    return kwargs or None
