"""What is wrong with one row (open_sft.data.formats re-exports it; a module of its own so that the converters of
datasets' own row shapes, open_sft.data.dataset_shapes, can raise it without importing formats)."""

from __future__ import annotations

from open_sft.errors import UserError


class RowError(ValueError):
    """What is wrong with one row; the caller adds the file and line. `reason` is the short code
    counted in the data report when --on_bad_row drop skips the row."""

    def __init__(self, message: str, reason: str = "invalid_row"):
        super().__init__(message)
        self.reason = reason

    def __reduce__(self):  # keep the reason when sent back from a render worker process
        return (RowError, (str(self), self.reason))


SKIP = "--on_bad_row drop"
# problems of the template, not of the row: every row fails alike, and skipping such rows would drop them all
WHOLE_TEMPLATE = frozenset({"template_not_jinja2"})


def bad_row_error(where: str, error: Exception) -> UserError:
    """--on_bad_row error: the error that stops the build at a bad row, naming its place, the problem and the way on
    without the row (unless the problem names it already, or is the template's, not the row's). Data that trains
    elsewhere can hold rows open_sft refuses: open-instruct's default sft_tulu_filter_v1 drops a conversation with no
    assistant turn unsaid."""
    problem = str(error)
    if SKIP not in problem and getattr(error, "reason", None) not in WHOLE_TEMPLATE:
        problem += f"; {SKIP} skips such rows (each counted in the data report)"
    return UserError(f"{where}: {problem}")
