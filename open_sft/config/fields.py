"""The dataclass field of a flag: its --help text (HfArgumentParser reads it from the metadata) and its default."""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any


def help_field(text: str, **kwargs: Any) -> Any:
    return field(metadata={"help": text}, **kwargs)


def field_default(name: str, *classes: type) -> Any:
    """The default of field `name` in the first of `classes` (flag dataclasses) that has it."""
    found = next(f for cls in classes for f in dataclasses.fields(cls) if f.name == name)
    return found.default_factory() if found.default_factory is not dataclasses.MISSING else found.default
