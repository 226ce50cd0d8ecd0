"""Tool-call arguments written as tagged pairs after the call's name (the `pairs` layout of open_sft.export.tool_calls:
GLM-4.5's `<arg_key>k</arg_key><arg_value>v</arg_value>`, Seed-OSS's `<parameter=k>v</parameter>`, MiniMax-M2's
`<parameter name="k">v</parameter>`, DeepSeek-V3.2's DSML `<｜DSML｜parameter name="k" string="true">v</｜DSML｜
parameter>`, which marks a value that is no string otherwise, `string="false"`, and writes it as JSON), and the text
helpers the layouts share."""

from __future__ import annotations

import json
import os
import re
from typing import Any, Optional

from open_sft.data.tool_schemas import function_of
from open_sft.export.template_text import common_suffix

PROBE_ARGUMENTS = {"probe_key_1": "probe value 9e4b", "probe_key_2": 7}


def as_arguments(value: Any) -> Any:
    """A JSON string as its value; anything else as it is."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def literal(text: str) -> str:
    """A regex matching `text` with any run of whitespace where it has one (a model's spacing may differ)."""
    return r"\s*".join(re.escape(part) for part in text.split()) if text.strip() else ""


def pair_layout(text: str) -> Optional[tuple[str, ...]]:
    """(key opening, key-to-value text, value closing) of arguments written as tagged pairs after the name, and the
    key-to-value text before a value that is no string where the template writes another one there (DSML's)."""
    (key_1, value_1), (key_2, value_2) = ((key, str(value)) for key, value in PROBE_ARGUMENTS.items())
    k1 = text.find(key_1)
    v1 = text.find(value_1, k1 + len(key_1))
    k2 = text.find(key_2, v1 + len(value_1))
    v2 = text.find(value_2, k2 + len(key_2))
    if min(k1, v1, k2, v2) < 0:
        return None
    after_first = text[v1 + len(value_1):k2]
    opening = common_suffix(text[:k1], after_first).strip()
    closing = os.path.commonprefix([after_first, text[v2 + len(value_2):]])
    closing = closing[:max(len(after_first) - len(opening), 0)].strip()
    between, typed = text[k1 + len(key_1):v1].strip(), text[k2 + len(key_2):v2].strip()
    return (opening, between, closing, *([typed] if typed != between else [])) if opening and between and closing \
        else None


def schema_types(tools: Optional[list], name: str) -> dict:
    """Each argument's JSON type in the schema of tool `name` (none where the tools do not have it)."""
    for tool in tools or ():
        function = function_of(tool)
        if function.get("name") == name:
            properties = (function.get("parameters") or {}).get("properties") or {}
            return {key: spec.get("type") for key, spec in properties.items() if isinstance(spec, dict)}
    return {}


def pair_arguments(pair: tuple[str, ...], text: str, types: dict) -> Optional[dict]:
    """The arguments written as tagged pairs; None where a pair is cut off (an opening without its closing), or where
    a value the template marks as no string (pair_layout's fourth part) is not JSON."""
    opening, between, closing, typed = (literal(part) for part in (*pair, "")[:4])
    arguments = {}
    pairs = list(re.finditer(f"{opening}(.*?)({between}{'|' + typed if typed else ''})(.*?){closing}", text, re.DOTALL))
    if len(pairs) != len(re.findall(opening, text)):
        return None
    for match in pairs:
        key, value = match.group(1).strip(), match.group(3).strip()
        if typed and re.fullmatch(typed, match.group(2)):
            try:
                arguments[key] = json.loads(value)
            except ValueError:
                return None
        else:
            arguments[key] = value if typed or types.get(key) == "string" else as_arguments(value)
    return arguments
