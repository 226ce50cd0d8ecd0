"""--max_shard_size, judged before anything is trained or exported: the exporter (huggingface_hub's sharding, behind
save_pretrained) reads it only when the model is written, after all the training, and raised a ValueError there."""

from __future__ import annotations

from typing import Optional

FORMS = "a number and a unit, KB, MB, GB or TB (1000-based): 5GB, 500MB, 0.5GB"


def shard_size_problem(value: object) -> Optional[str]:
    """Why `value` is no --max_shard_size the exporter accepts (what is wrong and the forms it takes), or None."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        text = str(value).strip()
        unit = text[-2:].upper()
        if unit not in UNITS:
            return f"{value!r} is not a size; give {FORMS}"
        try:
            size = float(text[:-2]) * UNITS[unit]
        except ValueError:
            return f"{value!r} is not a size; give {FORMS}"
    if not size >= 1:  # also NaN
        return f"{value!r} must be a positive size; give {FORMS}"
    return None


UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
