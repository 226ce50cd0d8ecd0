"""What is read off a tokenizer once (a byte table of its tokens, a probe of its chat template) and kept while the
tokenizer lives: keyed weakly on the tokenizer object, so a cache never keeps one alive (an lru_cache on a tokenizer
argument did), and read again when the value's `version` changes (tokens added, another template) or what the
tokenizer renders with does (renders_changed: chat template variables bound to it)."""

from __future__ import annotations

import weakref
from typing import Any, Callable, Hashable

_RENDERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # tokenizer → how often its renders changed


def renders_changed(tokenizer: Any) -> None:
    """Says that `tokenizer` renders otherwise from now on (variables bound to its apply_chat_template): every value
    kept for it is made again."""
    _RENDERS[tokenizer] = _RENDERS.get(tokenizer, 0) + 1


class PerTokenizer:
    """One value per tokenizer and version."""

    def __init__(self) -> None:
        self._values: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    def get(self, tokenizer: Any, version: Hashable, make: Callable[[], Any]) -> Any:
        """The value kept for `tokenizer` at `version`, made (by `make()`) when there is none yet or it was kept for
        another version."""
        version, cached = (version, _RENDERS.get(tokenizer, 0)), self._values.get(tokenizer)
        if cached is None or cached[0] != version:
            cached = self._values[tokenizer] = (version, make())
        return cached[1]
