"""Local data files compressed with gzip (.gz), bzip2 (.bz2), xz (.xz) or Zstandard (.zst), as corpus shards are
published (Dolma's .json.gz, newer mixes' .jsonl.zst). The format is the inner suffix (`x.jsonl.gz` is JSON Lines);
the text is decompressed as a stream, a block at a time, never the whole file in memory where the file is read a
block at a time. A damaged or cut-short archive is a UserError naming the file, never a traceback.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import zlib
from pathlib import Path, PurePath
from typing import Any, BinaryIO

from open_sft.errors import UserError

COMPRESSIONS = {".gz": "gzip", ".bz2": "bzip2", ".xz": "xz", ".zst": "Zstandard"}
UNPACK = {".gz": "zcat", ".bz2": "bzcat", ".xz": "xzcat", ".zst": "zstdcat"}  # the commands a fix names
PACK = {".gz": "gzip", ".bz2": "bzip2", ".xz": "xz", ".zst": "zstd"}
PIECE = 1 << 13  # decompressed bytes taken at a time: a cut-short archive's error counts the lines before, to 8 kB
ZSTD_IN = 1 << 12  # compressed bytes fed at a time: what one feed decompresses to stays small (text: ~20 kB)
CUT_SHORT = "Compressed file ended before the end-of-stream marker was reached"  # the stdlib's own EOFError text


def compression(path: PurePath | str) -> str | None:
    """The compression suffix of `path` (".gz", ...), None for a plain file."""
    suffix = PurePath(path).suffix
    return suffix if suffix in COMPRESSIONS else None


def data_suffix(path: PurePath | str) -> str:
    """The suffix that says a file's format, under any compression suffix: `x.jsonl.gz` → ".jsonl"."""
    path = PurePath(path)
    return PurePath(path.stem).suffix if compression(path) else path.suffix


def data_stem(path: PurePath | str) -> str:
    """The name less its format and compression suffixes: `data/web.jsonl.gz` → "web"."""
    path = PurePath(path)
    return PurePath(path.stem).stem if compression(path) else path.stem


class DataReader:
    """The bytes of a data file, decompressed where it is compressed, read `read(size)` at a time. A damaged or
    cut-short archive raises UserError naming the file and how many lines of its text came before."""

    def __init__(self, path: Path):
        self.path, self.kind = path, compression(path)
        self.lines = 0  # the newlines read so far: where a damaged archive goes wrong
        self._raw = path.open("rb")
        opener = {".gz": gzip.GzipFile, ".bz2": bz2.BZ2File, ".xz": lzma.LZMAFile, ".zst": _ZstdStream}.get(self.kind)
        self._handle: Any = opener(fileobj=self._raw) if self.kind == ".gz" else opener(self._raw) \
            if opener else self._raw

    def __enter__(self) -> "DataReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self._raw.close()

    def read(self, size: int = -1) -> bytes:
        """Up to `size` bytes (all, for -1), fewer only at the end. Taken from the decompressor a piece at a time, so
        that a damaged archive's error counts the lines before the damage."""
        if not self.kind:
            return self._raw.read(size)  # a plain file: no decompressor to fail, read as it always was
        pieces = []
        while size < 0 or size > 0:
            piece = self._piece(PIECE if size < 0 else min(size, PIECE))
            if not piece:
                break
            pieces.append(piece)
            size -= len(piece) if size > 0 else 0
        return b"".join(pieces)

    def _piece(self, size: int) -> bytes:
        try:  # read1: what one read of the archive decompressed, handed back before a cut-short end raises
            data = self._handle.read1(size)
        except (EOFError, OSError, zlib.error, lzma.LZMAError) as exc:
            if isinstance(exc, OSError) and exc.errno is not None:
                raise  # the system's own failure (no permission, a failing disk): not the file's content
            raise UserError(self._problem(exc)) from None
        except Exception as exc:  # zstandard.ZstdError, whose module is imported only for a .zst file
            if type(exc).__name__ != "ZstdError":
                raise
            raise UserError(self._problem(exc)) from None
        self.lines += data.count(b"\n")
        return data

    def _problem(self, exc: BaseException) -> str:
        name = COMPRESSIONS[self.kind or ""]
        where = f"after line {self.lines} of its text" if self.lines else "at its start"
        if isinstance(exc, EOFError):
            return (f"{self.path}: the {name} stream ends before its end ({where}): the file is cut short (an "
                    "interrupted download or copy); fetch it again")
        detail = " ".join(str(exc).split())
        return (f"{self.path}: not a readable {name} file ({detail}; {where}); check the file: a damaged copy, or "
                f"another format named {self.kind} (an uncompressed file is named without it)")


class _ZstdStream:
    """A Zstandard file's decompressed bytes; frames one after another are read as one stream (as `zstd -d`
    does). zstandard's stream_reader takes a cut-short file for a whole one, so frames are decompressed here and
    a file that ends inside one raises EOFError."""

    def __init__(self, raw: BinaryIO):
        try:
            import zstandard
        except ImportError:
            raise UserError(f"{getattr(raw, 'name', 'a .zst file')}: reading .zst files needs the zstandard "
                            "package: pip install zstandard") from None
        self._raw, self._zstd = raw, zstandard
        self._frame: Any = None  # the frame being decompressed; None between frames
        self._buffer, self._at = bytearray(), 0  # decompressed bytes not yet read: self._buffer[self._at:]

    def read1(self, size: int = -1) -> bytes:
        """Up to `size` bytes (all, for -1), fewer only at the end. A file that ends inside a frame hands back what
        it decompressed first and raises EOFError on the next read."""
        while size < 0 or len(self._buffer) - self._at < size:
            data = self._raw.read(ZSTD_IN)
            if not data:
                if self._frame is not None and self._at == len(self._buffer):
                    raise EOFError(CUT_SHORT)
                break
            self._feed(data)
        end = len(self._buffer) if size < 0 else min(len(self._buffer), self._at + size)
        data, self._at = bytes(self._buffer[self._at:end]), end
        if self._at > len(self._buffer) // 2:  # what was read goes, copying no more than what is left
            del self._buffer[:self._at]
            self._at = 0
        return data

    def _feed(self, data: bytes) -> None:
        while data:
            if self._frame is None:
                self._frame = self._zstd.ZstdDecompressor().decompressobj()
            self._buffer += self._frame.decompress(data)
            data = b""
            if self._frame.eof:
                data, self._frame = self._frame.unused_data, None
