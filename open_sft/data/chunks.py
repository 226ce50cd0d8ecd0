"""A source read a chunk at a time for the streaming build (open_sft.data.stream), and the building rank's
progress lines.

A chunk is CHUNK_ROWS rows (JSON Lines: a block of whole lines, at most CHUNK_BYTES; a .txt file: as many of its
documents, blocks of lines between blank lines; every other kind but a JSON list file: slices of its memory-mapped
`datasets.Dataset`); a build killed part way is resumed after the chunks
its spill already holds, when they were cut the same way.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional

from open_sft.data.formats import RowError, without_arrow_fill
from open_sft.data.compressed import data_suffix
from open_sft.data.local_files import holds_json_lines, line_chunks, parse_json_line, text_blocks
from open_sft.data.sources import TEXT_SUFFIX, decoded_rows, open_dataset

if TYPE_CHECKING:
    from open_sft.data.spill import Spill

logger = logging.getLogger(__name__)
# Progress lines come from whichever rank builds (the first to take the cache's lock), and open_sft logs INFO on
# rank 0 only: this logger says INFO on every rank
progress_logger = logging.getLogger("open_sft.data.build_progress")
progress_logger.setLevel(logging.INFO)

CHUNK_ROWS = int(os.environ.get("OPEN_SFT_BUILD_CHUNK_ROWS", "100000"))
CHUNK_BYTES = int(os.environ.get("OPEN_SFT_BUILD_CHUNK_MB", "64")) << 20  # long documents make shorter chunks
PROGRESS_EVERY_S = 10.0


class Reader:
    """A source a chunk at a time: (first row index, raw rows, their line numbers or None)."""

    def __init__(self, spec: Any, dataset: Any = None):
        self.spec, self.dataset = spec, dataset
        self.path = Path(spec.name).expanduser()
        self.blocks = dataset is None and data_suffix(self.path) == TEXT_SUFFIX  # a .txt file: {"text": block} rows

    @classmethod
    def open(cls, spec: Any) -> Optional["Reader"]:
        """None for a JSON document file (a list of objects: read whole, by the in-memory build)."""
        path = Path(spec.name).expanduser()
        if data_suffix(path) in (".json", ".jsonl", TEXT_SUFFIX) and path.is_file():
            return cls(spec) if data_suffix(path) == TEXT_SUFFIX or holds_json_lines(path) else None
        return cls(spec, open_dataset(spec))

    @property
    def lines(self) -> bool:
        """Whether the chunks are JSON Lines to parse (else rows: a dataset's, or a .txt file's documents)."""
        return self.dataset is None and not self.blocks

    def chunks(self, rows: int = 0, skip: int = 0) -> Iterator[tuple[int, list[Any], Optional[list[int]]]]:
        """The chunks after the first `skip` (those of a build resumed from: JSON Lines are still read past)."""
        start = 0
        if self.blocks:
            for number, (texts, numbers) in enumerate(text_blocks(self.path, rows or CHUNK_ROWS, CHUNK_BYTES)):
                if number >= skip:
                    yield start, [{"text": text} for text in texts], numbers
                start += len(texts)
            return
        if self.lines:
            for number, (lines, numbers) in enumerate(line_chunks(self.path, rows or CHUNK_ROWS, CHUNK_BYTES)):
                if number >= skip:
                    yield start, lines, numbers
                start += len(lines)
            return
        row_bytes = self.dataset.data.nbytes / max(1, len(self.dataset))
        rows = rows or max(1, min(CHUNK_ROWS, int(CHUNK_BYTES / max(row_bytes, 1.0))))
        for start in range(skip * rows, len(self.dataset), rows):
            chunk = decoded_rows(self.spec, self.dataset.select(range(start, min(len(self.dataset), start + rows))),
                                 start)
            yield start, [without_arrow_fill(row) for row in chunk], None

    def chunking(self) -> list[Any]:
        """What decides where chunks end: a build is resumed only from a spill chunked the same way."""
        return ["blocks" if self.blocks else "lines" if self.lines else "rows", CHUNK_ROWS, CHUNK_BYTES]

    def resuming(self, spill: Spill) -> int:
        """The chunks already in `spill` (of a killed build of this entry), said in the log when there are any."""
        if spill.chunks:
            logger.info("resuming the build of %s: %d rows already tokenized (%d chunks), by the build that was "
                        "interrupted", self.spec.name, spill.rows, spill.chunks)
        return spill.chunks

    def count(self) -> int:
        return len(self.dataset) if self.dataset is not None else sum(len(items) for _, items, _ in self.chunks())

    def first(self) -> tuple[Optional[dict], str]:
        """The first row (None when it is not a JSON object) and where it is."""
        for _, items, numbers in self.chunks(1):
            if self.blocks:
                return items[0], f"{self.spec.name} line {numbers[0]}"
            if not self.lines:
                return items[0], f"{self.spec.name} row 0"
            try:
                return parse_json_line(items[0]), f"{self.spec.name} line {numbers[0]}"
            except RowError:
                return None, ""
        return None, ""

    def where(self, index: int, numbers: Optional[list[int]], start: int) -> str:
        # rows of a parquet or Arrow source are numbered from 1, as lines are
        return f"{self.spec.name} line {numbers[index - start]}" if numbers else f"{self.spec.name} row {index + 1}"


class Progress:
    """A log line every PROGRESS_EVERY_S seconds on the building rank (rows/s, tokens/s, ETA), and one at the end."""

    def __init__(self, name: str, total: int, done: int = 0):
        self.name, self.total, self.started, self.said = name, total, time.monotonic(), time.monotonic()
        self.rows, self.resumed, self.tokens = done, done, 0  # `done`: rows of a resumed build, not timed here

    def update(self, rows: int, tokens: int) -> None:
        self.rows, self.tokens = self.rows + rows, self.tokens + tokens
        now = time.monotonic()
        if now - self.said >= PROGRESS_EVERY_S:
            self.said = now
            self._say(f", eta {(self.total - self.rows) * self._seconds() / max(self.rows - self.resumed, 1):.0f}s")

    def done(self) -> None:
        self._say(f" in {self._seconds():.1f}s")

    def _seconds(self) -> float:
        return max(time.monotonic() - self.started, 1e-9)

    def _say(self, tail: str) -> None:
        seconds = self._seconds()
        progress_logger.info("building %s: %d/%d rows, %.0f rows/s, %.0f tokens/s%s", self.name, self.rows,
                             self.total, (self.rows - self.resumed) / seconds, self.tokens / seconds, tail)
