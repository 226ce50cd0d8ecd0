"""Embedded default: bundled sample data plus an offline-built tiny tokenizer and Llama model.

Public names are re-exported lazily on first access, so importing this package stays
cheap (``factory`` pulls in torch/transformers) and ``python -m`` of a submodule does not
pre-import it.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "TASK_KINDS": "sample_data",
    "generate_examples": "sample_data",
    "normalize_answer": "sample_data",
    "read_jsonl": "sample_data",
    "score_answer": "sample_data",
    "write_jsonl": "sample_data",
    "CHAT_TEMPLATE": "factory",
    "DEFAULT_DATA_PATH": "factory",
    "SPECIAL_TOKENS": "factory",
    "build_embedded_default": "factory",
    "build_model": "factory",
    "build_tokenizer": "factory",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
