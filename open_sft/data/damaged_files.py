"""The damaged file of a data directory that `datasets` failed to read. A directory of JSON Lines shards (Dolma's
`.json.gz`) goes to datasets' JSON loader, whose error for a cut-short archive or a line that is not JSON names
neither the file nor the line ("Compressed file ended before the end-of-stream marker was reached", "JSON parse
error ... in row 50"). After such a failure the directory's files are read here, in the order datasets reads them,
a block at a time, until one fails: its error names the file, the line and the fix. Nothing is read while the load
succeeds. A Zstandard shard cut short is not even an error there (zstandard's stream reader, which datasets reads
.zst files with, takes the text before the cut for the whole file: a shard cut inside its one frame gave no row):
a directory's .zst files are walked frame by frame and block by block from their headers before it is loaded.
"""

from __future__ import annotations

import logging
import lzma
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

from open_sft.data.compressed import compression, data_suffix
from open_sft.data.local_files import holds_json_lines, line_chunks, parse_json_line, read_json, text_blocks
from open_sft.data.row_error import RowError
from open_sft.errors import UserError

logger = logging.getLogger(__name__)
READ_ERRORS = (EOFError, OSError, zlib.error, lzma.LZMAError, UnicodeDecodeError)
# by name: zstandard's, pyarrow's "JSON parse error" and json's (not datasets' CastError, files of other columns: no
# file is damaged, and reading them all again would only delay its message)
READ_ERROR_NAMES = frozenset({"ZstdError", "ArrowInvalid", "JSONDecodeError"})


def failed_reading(exc: BaseException) -> bool:
    """Whether `exc` (datasets' error) or one behind it is a file that could not be read: a damaged or cut-short
    archive, text that is not UTF-8, a line that is not JSON (not a split or config asked for that is not there)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, READ_ERRORS) or type(exc).__name__ in READ_ERROR_NAMES:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def damaged_file(directory: Path) -> Optional[str]:
    """What is wrong with the first data file under `directory` that cannot be read, None when each reads: a cut-short
    or damaged archive (with the lines of its text before the damage), text that is not UTF-8, a JSON Lines line
    that is not a JSON object, a JSON document that does not parse."""
    files = list(data_files(directory))
    logger.info("%s: datasets could not read one of its %d data files and does not say which: reading them again, in "
                "its order, to name it", directory, len(files))
    for path in files:
        try:
            _read_through(path)
        except UserError as exc:
            return str(exc)
    return None


def cut_short_zstd(directory: Path) -> Optional[str]:
    """What is wrong with the first Zstandard file under `directory` that ends inside a frame (with the lines of its
    text before the cut), None when none does. Only the headers are read (RFC 8878), not the compressed data."""
    for path in data_files(directory):
        if compression(path) == ".zst" and ends_inside_a_frame(path):
            try:
                _read_through(path)
            except UserError as exc:
                return str(exc)
            return f"{path}: the Zstandard stream ends inside a frame: the file is cut short; fetch it again"
    return None


ZSTD_MAGIC, SKIPPABLE_MAGIC = 0xFD2FB528, 0x184D2A50  # a skippable frame's magic is 0x184D2A5? (any last digit)


def ends_inside_a_frame(path: Path) -> bool:
    """Whether a Zstandard file ends inside a frame: each frame's header, then its blocks' 3-byte headers (the last
    block flagged), then its checksum where it has one, end to end; False for a file that is no Zstandard stream
    (its decompressor says what it is)."""
    size, at = path.stat().st_size, 0
    with path.open("rb") as handle:
        while at < size:
            handle.seek(at)
            head = handle.read(8)
            magic = int.from_bytes(head[:4], "little")
            if len(head) >= 4 and magic & 0xFFFFFFF0 == SKIPPABLE_MAGIC:
                at += 8 + int.from_bytes(head[4:8], "little")
                continue
            if len(head) >= 4 and magic != ZSTD_MAGIC:
                return False
            if len(head) < 5:
                return True
            flags = head[4]  # Frame_Header_Descriptor: content size, single segment, checksum, dictionary id
            single = flags >> 5 & 1
            at += 5 + (1 - single) + (0, 1, 2, 4)[flags & 3] + (single, 2, 4, 8)[flags >> 6]
            last = 0
            while not last:
                handle.seek(at)
                header = handle.read(3)
                if len(header) < 3:
                    return True
                block = int.from_bytes(header, "little")
                last, kind, length = block & 1, block >> 1 & 3, block >> 3
                at += 3 + (1 if kind == 1 else length)  # an RLE block holds its one byte
                if at > size:
                    return True
            at += 4 * (flags >> 2 & 1)
    return at > size


def data_files(directory: Path) -> Iterator[Path]:
    """The JSON, JSON Lines and text files under `directory` (compressed or not), sorted, as datasets lists them:
    without hidden files and those under a hidden or `__` directory, which it leaves out."""
    for path in sorted(directory.rglob("*")):
        parts = path.relative_to(directory).parts
        if path.is_file() and not any(part.startswith((".", "__")) for part in parts) and (
                data_suffix(path) in (".jsonl", ".json", ".txt") or compression(path)):
            yield path


def _read_through(path: Path) -> None:
    """Read `path` to its end as its format says, raising UserError at the first thing that cannot be read."""
    if data_suffix(path) not in (".jsonl", ".json"):
        for _ in text_blocks(path, rows=1 << 14):  # decompressed and decoded, a block at a time
            pass
    elif holds_json_lines(path):
        for lines, numbers in line_chunks(path, rows=1 << 14):
            for line, number in zip(lines, numbers):
                try:
                    parse_json_line(line)
                except RowError as exc:
                    raise UserError(f"{path} line {number}: {exc}; datasets' JSON loader, which reads a directory's "
                                    "files, stops there (--on_bad_row drop cannot skip it): fix or remove that line"
                                    ) from None
    else:
        read_json(path)
