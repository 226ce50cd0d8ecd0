"""Local data files read as text: UTF-8 (a file that is not says its line and the fix), lines and documents a
block at a time (a corpus need not fit in memory), JSON Lines (each bad line named) and JSON documents, as
`datasets.load_dataset("json")` takes them. Read by hand rather than with `datasets` so that a malformed line is
reported with its file and line number; `datasets`' JSON loader only says that parsing failed somewhere.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator, Sequence
from itertools import chain
from pathlib import Path, PurePath
from typing import Any

from open_sft.data.compressed import PACK, UNPACK, DataReader, compression, data_suffix
from open_sft.data.formats import RowError
from open_sft.data.row_error import bad_row_error
from open_sft.errors import UserError


def json_error(exc: json.JSONDecodeError) -> str:
    """What is wrong and its column, once: json's own text of an unterminated string ends "starting at"."""
    return f"{exc.msg.removesuffix(' at')} at column {exc.colno}"


def json_type(value: Any) -> str:
    """The JSON name of a decoded value's type (a row that is `null` is no 'NoneType' to the user)."""
    names = {type(None): "null", bool: "boolean", int: "number", float: "number", str: "string", list: "list"}
    return names.get(type(value), type(value).__name__)


def parse_json_line(line: str) -> dict[str, Any]:
    """One JSON Lines row; RowError (reason invalid_json) says what is wrong, the caller adds where."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise RowError(f"not valid JSON ({json_error(exc)}); each line must be one JSON object",
                       "invalid_json") from None
    if not isinstance(row, dict):
        raise RowError(f"expected a JSON object, got {json_type(row)}", "invalid_json")
    return row


def read_utf8(path: Path) -> str:
    """The file's text (decompressed); a file that is not UTF-8 is a UserError naming the line and the fix."""
    with DataReader(path) as handle:
        return _decode(path, handle.read(), 0)


def _decode(path: Path, data: bytes, lines_before: int) -> str:
    """`data` (whole lines of `path`, after `lines_before` lines) as text, or a UserError naming the line. A UTF-8
    byte order mark opening the file is not text (Python's utf-8-sig): JSON, JSON Lines and .txt files alike."""
    if not lines_before and data.startswith(codecs.BOM_UTF8):
        data = data[len(codecs.BOM_UTF8):]
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = lines_before + data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        utf16 = not lines_before and data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE))
        what = "it is UTF-16 (its byte order mark says so)" if utf16 else \
            f"byte 0x{data[exc.start]:02x} at column {column}"
        iconv = f"iconv -f {'utf-16' if utf16 else 'latin1'} -t utf-8"
        kind = compression(path)
        fix = f"{iconv} {path} > {path.stem}.utf8{path.suffix}" if not kind else \
            f"{UNPACK[kind]} {path} | {iconv} | {PACK[kind]} > {PurePath(path.stem).stem}.utf8{data_suffix(path)}{kind}"
        raise UserError(f"{path} line {line}: not UTF-8 ({what}); data files must be UTF-8: re-encode it, e.g. {fix}"
                        ) from None


READ_BYTES = 1 << 22  # a JSON Lines file is read this much at a time (whole lines)


def _lines_blockwise(path: Path) -> Iterator[tuple[int, list[str]]]:
    """The file's lines (without their newline; universal newlines, as in read_lines), READ_BYTES of whole lines
    at a time: (the number of the block's first line, from 1; its lines)."""
    number = raw_lines = 0
    carry = b""
    with DataReader(path) as handle:  # decompressed a block at a time
        while True:
            block = handle.read(READ_BYTES)
            data = carry + block
            cut = data.rfind(b"\n") + 1 if block else len(data)  # whole lines only, but for the file's end
            data, carry = data[:cut], data[cut:]
            text = _decode(path, data, raw_lines)
            raw_lines += data.count(b"\n")
            if "\r" in text:  # a block ends after a "\n": no "\r\n" pair is cut
                text = text.replace("\r\n", "\n").replace("\r", "\n")
            lines = text.split("\n")
            if lines[-1] == "":
                lines.pop()
            yield number + 1, lines
            number += len(lines)
            if not block:
                return


def line_chunks(path: Path, rows: int, chars: int = 1 << 62) -> Iterator[tuple[list[str], list[int]]]:
    """`read_lines` a chunk at a time, reading the file a block at a time: the same lines and line numbers,
    without the whole file in memory. A chunk ends at `rows` lines, or at the line that reaches `chars`
    characters (long documents)."""
    pending: list[str] = []
    numbers: list[int] = []
    size = 0
    for number, lines in _lines_blockwise(path):
        for number, line in enumerate(lines, start=number):
            if line and not line.isspace():
                pending.append(line)
                numbers.append(number)
                size += len(line)
                if len(pending) >= rows or size >= chars:
                    yield pending, numbers
                    pending, numbers, size = [], [], 0
    if pending:
        yield pending, numbers


def text_blocks(path: Path, rows: int = 1 << 62, chars: int = 1 << 62) -> Iterator[tuple[list[str], list[int]]]:
    """The documents of a plain text file (TEXT_SUFFIX) a chunk at a time: (their texts, the line each begins on).
    A document is a block of lines between blank lines (a line of only whitespace is blank), its lines joined
    by "\n" as written. A chunk ends at `rows` documents, or at the one that reaches `chars` characters."""
    pending: list[str] = []
    numbers: list[int] = []
    block: list[str] = []
    size = first = 0
    for number, lines in chain(_lines_blockwise(path), [(0, [""])]):  # a blank line after the last
        for number, line in enumerate(lines, start=number):
            if line and not line.isspace():
                first = first if block else number
                block.append(line)
                continue
            if not block:
                continue
            pending.append("\n".join(block))
            numbers.append(first)
            size += len(pending[-1])
            block = []
            if len(pending) >= rows or size >= chars:
                yield pending, numbers
                pending, numbers, size = [], [], 0
    if pending:
        yield pending, numbers


def read_lines(path: Path) -> tuple[list[str], Sequence[int]]:
    """The non-blank lines of a JSON Lines file (without their newline) and their line numbers (from
    1). Split in one call rather than iterated line by line (a quarter of the time on 100k lines):
    universal newlines, as iterating the file would; blank lines are rare, so looked for first."""
    text = read_utf8(path)
    if "\r" in text:  # universal newlines, as reading in text mode would give
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    lines = text.split("\n")
    if lines[-1] == "":  # the newline that ends the last line
        lines.pop()
    if "" not in lines and not any(map(str.isspace, lines)):
        return lines, range(1, len(lines) + 1)
    numbered = [(number, line) for number, line in enumerate(lines, start=1) if line and not line.isspace()]
    return [line for _, line in numbered], [number for number, _ in numbered]


def holds_json_lines(path: Path) -> bool:
    """Whether a file is JSON Lines: a .jsonl file, or a .json file whose first non-blank line is a whole JSON
    object and which has another non-blank line after it. `datasets.load_dataset("json")` (open-instruct's,
    TRL's and LLaMA-Factory's reader) takes JSON Lines in a .json file, and many datasets are published that way;
    a JSON document (a list, or one object holding it) begins with a line that is not a whole object, or is the
    file's only line. Reads the file only up to its second non-blank line."""
    if data_suffix(path) == ".jsonl":
        return True
    if data_suffix(path) != ".json":
        return False
    first = None
    for _, lines in _lines_blockwise(path):
        for line in lines:
            if not line or line.isspace():
                continue
            if first is not None:
                try:
                    return isinstance(json.loads(first), dict)
                except json.JSONDecodeError:
                    return False
            first = line
    return False


def read_jsonl(path: Path, drop_bad: bool) -> tuple[list[dict[str, Any]], list[int], int]:
    rows, line_numbers, unreadable = [], [], 0
    for line, lineno in zip(*read_lines(path)):
        try:
            rows.append(parse_json_line(line))
        except RowError as exc:
            if drop_bad:
                unreadable += 1
                continue
            raise bad_row_error(f"{path} line {lineno}", exc) from None
        line_numbers.append(lineno)
    return rows, line_numbers, unreadable


# the columns of a row: an object holding one of them is a row, not a mapping of a split name to the rows
ROW_COLUMNS = frozenset({"messages", "conversations", "prompt", "completion", "text", "instruction", "output"})


def read_json(path: Path) -> tuple[list[dict[str, Any]], list[int]]:
    """A JSON document's rows and the line each begins on: a list of objects, one object holding that list
    ({"train": [...]}), one object that is a row, or objects written one after another (pretty-printed JSON Lines),
    as `datasets.load_dataset("json")` reads them."""
    text = read_utf8(path)
    try:
        values, starts = _json_values(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{path} line {exc.lineno}: not valid JSON ({json_error(exc)}); expected a list of objects, "
                        "or JSON Lines (one object per line, the first line a whole object)") from None
    if len(values) == 1:
        (begin, elements), = starts
        loaded, starts = values[0], [begin] if elements is None else elements
    else:
        loaded, starts = values, [begin for begin, _ in starts]
    if isinstance(loaded, dict) and len(loaded) == 1 and isinstance(next(iter(loaded.values())), list) \
            and not set(loaded) & ROW_COLUMNS:
        loaded, starts = next(iter(loaded.values())), _wrapped_list_starts(text, starts[0])  # {"train": [...]}
    elif isinstance(loaded, dict):
        loaded = [loaded]  # one row
    if not isinstance(loaded, list):
        raise UserError(f"{path}: expected a JSON list of objects (or use .jsonl with one object per line)")
    lines = _line_numbers(text, starts)
    for row, line in zip(loaded, lines):
        if not isinstance(row, dict):
            raise UserError(f"{path} line {line}: expected a JSON object, got {json_type(row)}")
    return loaded, lines


# json decodes a document whole and keeps no positions, so a list is decoded an element at a time (each by json's
# own C decoder) to know the line each row begins on: a bad row's error names that line, as a JSON Lines file's does.
_BLANK = " \t\r\n\ufeff"


def _skip_blank(text: str, at: int) -> int:
    while at < len(text) and text[at] in _BLANK:
        at += 1
    return at


def _decode_list(text: str, at: int) -> tuple[list[Any], list[int], int]:
    """The JSON list that begins at text[at] ("["): its elements, the offset each begins at, and the offset after
    it. Raises json.JSONDecodeError, at its place in `text`, as json.loads would."""
    decoder, items, starts = json.JSONDecoder(), [], []
    at = _skip_blank(text, at + 1)
    if at < len(text) and text[at] == "]":
        return items, starts, at + 1
    while True:
        starts.append(at)
        item, at = decoder.raw_decode(text, at)
        items.append(item)
        at = _skip_blank(text, at)
        if at < len(text) and text[at] == "]":
            return items, starts, at + 1
        if at >= len(text) or text[at] != ",":
            raise json.JSONDecodeError("Expecting ',' delimiter", text, at)
        at = _skip_blank(text, at + 1)


def _wrapped_list_starts(text: str, at: int) -> list[int]:
    """Where the elements of {"name": [...]} begin, the object at text[at] (already decoded whole)."""
    _, at = json.JSONDecoder().raw_decode(text, _skip_blank(text, at + 1))  # the one key
    at = _skip_blank(text, _skip_blank(text, at) + 1)  # past the colon
    return _decode_list(text, at)[1]


def _line_numbers(text: str, starts: Sequence[int]) -> list[int]:
    """The 1-based line of each offset in `starts` (ascending)."""
    lines, line, previous = [], 1, 0
    for start in starts:
        line += text.count("\n", previous, start)
        lines.append(line)
        previous = start
    return lines


def _json_values(text: str) -> tuple[list[Any], list[tuple[int, list[int] | None]]]:
    """The JSON values of `text`, one after another (one for a JSON document), and where each begins: its offset,
    with a list's the offsets of its elements. json.JSONDecodeError names the line of the first that does not
    parse."""
    decoder, values, starts, at = json.JSONDecoder(), [], [], 0
    while True:
        at = _skip_blank(text, at)
        if at == len(text):
            if not values:
                raise json.JSONDecodeError("the file has no JSON value", text, at)
            return values, starts
        begin, elements = at, None
        if text[at] == "[":
            value, elements, at = _decode_list(text, at)
        else:
            value, at = decoder.raw_decode(text, at)
        values.append(value)
        starts.append((begin, elements))
