"""xLAM's tool parameters typed by Python names, as JSON Schema's types.

Salesforce/xlam-function-calling-60k writes a parameter's type as Python does (`"str"`, `"int"`, `"List[int]"`,
`"str, optional"`) and lists no `required`: templates that write a parameter's JSON Schema type (gpt-oss's TypeScript
form) know none of them and write every parameter `any`, optional. The unambiguous names are mapped: str → string,
int → integer, float → number, bool → boolean, list / List[...] → array (its `items` where the inner name is one of
these), dict / Dict[...] → object, Optional[X], `X | None` and `None | X` as X; `, optional` (any case and spacing:
`str,optional`, also followed by `, default=...`), Optional[X], `X | None`, `None | X` or a `default` make a parameter
not required, every other parameter of a schema whose types are all strings is required. Anything else (`Any`,
`Union[...]`, `Callable`) is left as written.
"""

from __future__ import annotations

import re

_SCALARS = {"str": "string", "int": "integer", "float": "number", "bool": "boolean"}
_GENERIC = re.compile(r"(list|List|dict|Dict)(?:\[(.*)\])?")
# "int, optional", "str,optional", "int, Optional", "str, optional, default='us'"
_OPTIONAL = re.compile(r",\s*optional\s*(,\s*default\b.*)?$", re.IGNORECASE | re.DOTALL)
_OPTIONAL_OF = re.compile(r"Optional\[(.*)\]|(.*?)\s*\|\s*None|None\s*\|\s*(.*)", re.DOTALL)  # X | None, None | X


def _json_type(name: str) -> dict:
    """{"type": ...} (and `items`) for a Python type name, {} where it is not one of the unambiguous names."""
    if name in _SCALARS:
        return {"type": _SCALARS[name]}
    generic = _GENERIC.fullmatch(name)
    if generic is None:
        return {}
    if generic.group(1).lower() == "dict":
        return {"type": "object"}
    inner = (generic.group(2) or "").strip()
    return {"type": "array", **({"items": {"type": _SCALARS[inner]}} if inner in _SCALARS else {})}


def _written_type(written: str) -> tuple[str, bool]:
    """The type name a parameter's `type` writes (`int` of `int, optional` and of `Optional[int]`), and whether it
    says the parameter is optional."""
    bare = _OPTIONAL.sub("", written).strip()
    optional_of = _OPTIONAL_OF.fullmatch(bare)
    if optional_of:
        return next(group for group in optional_of.groups() if group is not None).strip(), True
    return bare, bare != written


def json_schema_types(properties: dict) -> tuple[dict, list[str], bool]:
    """xLAM's `properties` ({name: {type, description, default}}) with their Python type names as JSON Schema's, the
    names of the required ones (those neither optional nor with a `default`), and whether any type was mapped; the
    properties as they are, no required list and False where some type is not a string (not xLAM's form)."""
    if not all(isinstance(spec, dict) and isinstance(spec.get("type"), str) for spec in properties.values()):
        return properties, [], False
    mapped, required, changed = {}, [], False
    for name, spec in properties.items():
        written, optional = _written_type(spec["type"].strip())
        json_type = _json_type(written)
        mapped[name] = {**spec, **json_type} if json_type else spec
        changed |= bool(json_type)
        if not optional and "default" not in spec:
            required.append(name)
    return mapped, required, changed
