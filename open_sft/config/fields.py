"""The dataclass field of a flag: its --help text (HfArgumentParser reads it from the metadata) and its default."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def help_field(text: str, **kwargs: Any) -> Any:
    return field(metadata={"help": text}, **kwargs)
