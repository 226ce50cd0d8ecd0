"""Secrets kept out of everything open_sft writes or prints: run.json, checkpoints, trackers, model cards, logs.

One rule for what a secret is (a key named like a token, password or API key) and one marker in its place.
"""

from __future__ import annotations

import re
from typing import Any, Optional

REDACTED = "<redacted>"
_SECRET_NAME = re.compile(r"(^|_)(token|secret|password|passwd|api_key|apikey|credentials?)$", re.IGNORECASE)


def redact_secrets(value: Any) -> Any:
    """A copy of nested dicts/lists with the values of secret-looking keys replaced (when set)."""
    if isinstance(value, dict):
        return {key: (REDACTED if _SECRET_NAME.search(str(key)) and item else redact_secrets(item))
                for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_secrets(item) for item in value]
    return value


def scrub(text: str, secret: Optional[str]) -> str:
    """`text` (an error message from a library, say) with every occurrence of `secret` replaced."""
    return text.replace(secret, REDACTED) if secret else text
