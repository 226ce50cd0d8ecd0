"""What is wrong with one row (open_sft.data.formats re-exports it; a module of its own so that the converters of
datasets' own row shapes, open_sft.data.dataset_shapes, can raise it without importing formats)."""

from __future__ import annotations


class RowError(ValueError):
    """What is wrong with one row; the caller adds the file and line. `reason` is the short code
    counted in the data report when --on_bad_row drop skips the row."""

    def __init__(self, message: str, reason: str = "invalid_row"):
        super().__init__(message)
        self.reason = reason

    def __reduce__(self):  # keep the reason when sent back from a render worker process
        return (RowError, (str(self), self.reason))
