"""The terminal view of a run: a progress bar on rank 0 when stdout is a terminal, plain log lines otherwise
(CI, files, `tee`). tqdm draws the bar and, while it is up, routes log lines above it so they stay readable."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Iterator

class ProgressBar:
    def __init__(self, total: int, initial: int, enabled: bool):
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm

            # a terminal that reports no size (a bare pty) gets a fixed one: tqdm hides a bar below row 0
            sized = _terminal_columns() > 0
            self.bar = tqdm(total=total, initial=initial, unit="step", file=sys.stdout, desc="training",
                            dynamic_ncols=sized, ncols=None if sized else 100, nrows=None if sized else 24)

    @classmethod
    def for_rank(cls, total: int, initial: int, is_main: bool) -> "ProgressBar":
        return cls(total, initial, enabled=is_main and sys.stdout.isatty())

    def __call__(self, done: int, seconds: float) -> bool:
        if self.bar is not None:
            self.bar.update(done - self.bar.n)
        return False

    @contextlib.contextmanager
    def around_training(self) -> Iterator[None]:
        if self.bar is None:
            yield
            return
        from tqdm.contrib.logging import logging_redirect_tqdm

        with logging_redirect_tqdm(loggers=[logging.root]):
            try:
                yield
            finally:
                self.bar.close()


def _terminal_columns() -> int:
    try:
        return os.get_terminal_size(sys.stdout.fileno()).columns
    except (OSError, ValueError):
        return 0
