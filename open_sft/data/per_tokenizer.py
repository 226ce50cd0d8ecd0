"""What is read off a tokenizer once (a byte table of its tokens, a probe of its chat template) and kept while the
tokenizer lives: keyed weakly on the tokenizer object, so a cache never keeps one alive (an lru_cache on a tokenizer
argument did), and read again when the value's `version` changes (tokens added, another template)."""

from __future__ import annotations

import weakref
from typing import Any, Callable, Hashable


class PerTokenizer:
    """One value per tokenizer and version."""

    def __init__(self) -> None:
        self._values: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    def get(self, tokenizer: Any, version: Hashable, make: Callable[[], Any]) -> Any:
        """The value kept for `tokenizer` at `version`, made (by `make()`) when there is none yet or it was kept for
        another version."""
        cached = self._values.get(tokenizer)
        if cached is None or cached[0] != version:
            cached = self._values[tokenizer] = (version, make())
        return cached[1]
