"""Reading the sources named in --dataset_mixer_list into plain row dicts.

Local JSON Lines are read by hand (not with `datasets`) so that a malformed line is reported with
its file and line number; `datasets`' JSON loader only says that parsing failed somewhere. A plain text file
(.txt) is text rows, `{"text": ...}`, one document per block of lines between blank lines: what corpus dumps
one document per paragraph look like, and what can be read a chunk at a time (one document per file could not be).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any, Optional

from open_sft.data.formats import RowError, without_arrow_fill
from open_sft.errors import UserError

logger = logging.getLogger(__name__)

TEXT_SUFFIX = ".txt"  # plain text for continual pretraining: one document per blank-line-separated block
LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet", TEXT_SUFFIX)


@dataclass(frozen=True)
class SourceSpec:
    """One NAME AMOUNT pair of --dataset_mixer_list."""

    name: str
    amount: float
    is_fraction: bool
    split: str
    # --eval_split_ratio: ("train", r) takes the amount from the rows not held out, ("eval", r) the held-out rows
    holdout: Optional[tuple[str, float]] = None
    config_name: Optional[str] = None  # --dataset_config_name: the configuration of a Hub dataset (or its layout)
    # a local source's content identity (source_identity): what its seeded draws follow, so that the same file
    # reached by another path (another node's mount) gives the same rows; None: the name
    seed_key: Optional[str] = None
    # its own chat template variables over --chat_template_kwargs (--dataset_mixer_list_chat_template_kwargs),
    # sorted JSON; None: none
    chat_template_kwargs: Optional[str] = None

    @property
    def is_local(self) -> bool:
        return self.name.endswith(LOCAL_SUFFIXES) or Path(self.name).exists()

    @property
    def draw_key(self) -> str:
        return self.seed_key or self.name


def parse_mixer_list(values: list[str], splits: list[str], flag: str = "--dataset_mixer_list",
                     config_name: Optional[str] = None, template_kwargs: Optional[list[str]] = None
                     ) -> list[SourceSpec]:
    """`["a.jsonl", "0.5", "b.jsonl", "100"]` → specs. An amount with a '.' is a fraction, else a row count."""
    specs = []
    for i in range(0, len(values), 2):
        name, raw = values[i], values[i + 1]
        is_fraction = "." in raw
        try:
            amount = float(raw) if is_fraction else int(raw)
        except ValueError:
            raise UserError(
                f"{flag}: amount {raw!r} for {name} is not a number; use a fraction like 1.0 or a row count like 500"
            ) from None
        if amount <= 0:
            raise UserError(f"{flag}: amount {raw} for {name} must be positive")
        split = splits[0] if len(splits) == 1 else splits[i // 2]
        if split != "train" and name.endswith(LOCAL_SUFFIXES) and Path(name).expanduser().is_file():
            if len(splits) > 1:  # asked for this file by name
                raise UserError(f"{flag}_splits: split {split!r} for {name}: a local file is one split, its rows are "
                                "all read; give train for it (or a dataset directory with split files)")
            logger.warning("%s_splits %s: %s is a local file, one split: all its rows are read", flag, split, name)
        variables = (template_kwargs[0] if len(template_kwargs) == 1 else template_kwargs[i // 2]) \
            if template_kwargs else None
        variables = json.dumps(json.loads(variables), sort_keys=True) if variables else None
        specs.append(SourceSpec(name=name, amount=amount, is_fraction=is_fraction, split=split,
                                config_name=config_name, chat_template_kwargs=None if variables == "{}" else variables))
    return specs


@dataclass
class LoadedSource:
    """The rows of one source and how to name row i in an error message."""

    spec: SourceSpec
    rows: list[dict[str, Any]]
    line_numbers: list[int] | None = None
    unreadable: int = 0  # malformed lines skipped under --on_bad_row drop

    def where(self, index: int) -> str:
        if self.line_numbers is not None:
            return f"{self.spec.name} line {self.line_numbers[index]}"
        return f"{self.spec.name} row {index + 1}"  # 1-based, as a line is: row 1 is the first


def _local_path(spec: SourceSpec) -> Path:
    path = Path(spec.name).expanduser()
    if spec.name.endswith(LOCAL_SUFFIXES) and not path.exists():
        raise UserError(f"--dataset_mixer_list: data file {spec.name} does not exist; check the path")
    return path


def source_identity(spec: SourceSpec, cache_dir: Optional[Path] = None) -> str:
    """What the cache key records for a source: the content hash of a local file or directory (a large file's
    remembered in `cache_dir`, open_sft.data.cache.content_hash), else the dataset id and split (the loaded
    dataset's fingerprint is added by the data preparation)."""
    from open_sft.data.cache import content_hash

    path = _local_path(spec)
    if path.is_file():
        return "file:" + content_hash(path, cache_dir)
    if path.is_dir():
        digest = hashlib.sha256()
        for item in sorted(p for p in path.rglob("*") if p.is_file()):
            digest.update(str(item.relative_to(path)).encode() + b"\0" + content_hash(item, cache_dir).encode())
        return "dir:" + digest.hexdigest()
    return f"hub:{spec.name}:{spec.split}:{_load_hub(spec, spec.name)._fingerprint}"


def parse_json_line(line: str) -> dict[str, Any]:
    """One JSON Lines row; RowError (reason invalid_json) says what is wrong, the caller adds where."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise RowError(f"not valid JSON ({exc.msg} at column {exc.colno}); each line must be one JSON object",
                       "invalid_json") from None
    if not isinstance(row, dict):
        raise RowError(f"expected a JSON object, got {type(row).__name__}", "invalid_json")
    return row


def read_utf8(path: Path) -> str:
    """The file's text; a file that is not UTF-8 is a UserError naming the line and the fix."""
    return _decode(path, path.read_bytes(), 0)


def _decode(path: Path, data: bytes, lines_before: int) -> str:
    """`data` (whole lines of `path`, after `lines_before` lines) as text, or a UserError naming the line."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = lines_before + data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise UserError(
            f"{path} line {line}: not UTF-8 (byte 0x{data[exc.start]:02x} at column {column}); data files must be "
            f"UTF-8: re-encode it, e.g. iconv -f latin1 -t utf-8 {path} > {path.stem}.utf8{path.suffix}"
        ) from None


NO_TEXT = " (a .txt file's documents are its blocks of non-blank lines)"
READ_BYTES = 1 << 22  # a JSON Lines file is read this much at a time (whole lines)


def _lines_blockwise(path: Path) -> Iterator[tuple[int, list[str]]]:
    """The file's lines (without their newline; universal newlines, as in read_lines), READ_BYTES of whole lines
    at a time: (the number of the block's first line, from 1; its lines)."""
    number = raw_lines = 0
    carry = b""
    with path.open("rb") as handle:
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
    if path.suffix == ".jsonl":
        return True
    if path.suffix != ".json":
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


def _read_jsonl(path: Path, drop_bad: bool) -> tuple[list[dict[str, Any]], list[int], int]:
    rows, line_numbers, unreadable = [], [], 0
    for line, lineno in zip(*read_lines(path)):
        try:
            rows.append(parse_json_line(line))
        except RowError as exc:
            if drop_bad:
                unreadable += 1
                continue
            raise UserError(f"{path} line {lineno}: {exc}") from None
        line_numbers.append(lineno)
    return rows, line_numbers, unreadable


# the columns of a row: an object holding one of them is a row, not a mapping of a split name to the rows
ROW_COLUMNS = frozenset({"messages", "conversations", "prompt", "completion", "text", "instruction", "output"})


def _read_json(path: Path) -> list[dict[str, Any]]:
    """A JSON document's rows: a list of objects, one object holding that list ({"train": [...]}), one object that
    is a row, or objects written one after another (pretty-printed JSON Lines), as `datasets.load_dataset("json")`
    reads them."""
    try:
        values = _json_values(read_utf8(path))
    except json.JSONDecodeError as exc:
        raise UserError(f"{path} line {exc.lineno}: not valid JSON ({exc.msg}); expected a list of objects, or JSON "
                        f"Lines (one object per line, the first line a whole object)") from None
    loaded = values[0] if len(values) == 1 else values
    if isinstance(loaded, dict) and len(loaded) == 1 and isinstance(next(iter(loaded.values())), list) \
            and not set(loaded) & ROW_COLUMNS:
        loaded = next(iter(loaded.values()))  # {"train": [...]} / {"data": [...]}
    if isinstance(loaded, dict):
        loaded = [loaded]  # one row
    if not isinstance(loaded, list):
        raise UserError(f"{path}: expected a JSON list of objects (or use .jsonl with one object per line)")
    for index, row in enumerate(loaded):  # item N: 1-based, the Nth element of the list
        if not isinstance(row, dict):
            raise UserError(f"{path} item {index + 1}: expected a JSON object, got {type(row).__name__}")
    return loaded


def _json_values(text: str) -> list[Any]:
    """The JSON values of `text`, one after another (one for a JSON document); json.JSONDecodeError names the line
    of the first that does not parse."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and text[at] in " \t\r\n\ufeff":
            at += 1
        if at == len(text):
            if not values:
                raise json.JSONDecodeError("the file has no JSON value", text, at)
            return values
        value, at = decoder.raw_decode(text, at)
        values.append(value)


def _load_hub(spec: SourceSpec, where: str) -> Any:
    """A Hub dataset id, or a local directory laid out as a Hub dataset repository (data files, or a README
    whose YAML names configs), through `datasets.load_dataset` with --dataset_config_name and the split."""
    import datasets

    try:
        return datasets.load_dataset(where, name=spec.config_name, split=spec.split)
    except Exception as exc:  # datasets raises many types; the user needs the name and the cause
        config = f", config {spec.config_name!r}" if spec.config_name else ""
        hint = ("Check the split (--dataset_mixer_list_splits) and the config (--dataset_config_name); a local "
                "directory's data files must share one set of columns (one format)" if Path(where).is_dir() else
                "If it is meant to be a local file, check the path; if a Hub dataset, check the id, the split "
                "(--dataset_mixer_list_splits), the config (--dataset_config_name) and network access")
        raise UserError(f"dataset {spec.name!r} (split {spec.split!r}{config}) could not be loaded: "
                        f"{_with_causes(exc).rstrip('.')}. {hint}") from exc


def _with_causes(exc: BaseException, limit: int = 600) -> str:
    """An exception's message and those of the exceptions behind it: datasets wraps the one that says what is
    wrong (a CastError naming the columns that differ) in a generic "error occurred while generating"."""
    parts, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = " ".join(str(exc).split())
        if text and not any(text in p for p in parts):
            parts.append(text if not parts else f"{type(exc).__name__}: {text}"[:limit])
        exc = exc.__cause__ or exc.__context__
    return " <- ".join(parts)


def _saved_by_datasets(path: Path) -> bool:
    """A directory `Dataset.save_to_disk` / `DatasetDict.save_to_disk` wrote (else a Hub repository layout)."""
    return (path / "dataset_dict.json").exists() or (path / "state.json").exists()


def open_dataset(spec: SourceSpec) -> Any:
    """The `datasets.Dataset` (memory-mapped Arrow) of a source that is not a local JSON, JSON Lines or plain
    text file: a parquet file, a `save_to_disk` directory, a directory laid out as a Hub dataset, a Hub id. None
    for JSON, JSON Lines and plain text files, which are read as text."""
    import datasets

    path = _local_path(spec)
    if path.is_dir() and not _saved_by_datasets(path):
        return _load_hub(spec, str(path))
    if path.is_dir():
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if spec.split not in loaded:
                raise UserError(f"{path}: no split {spec.split!r} (it has {', '.join(loaded)}); choose one with "
                                "--dataset_mixer_list_splits")
            loaded = loaded[spec.split]
        return loaded
    if path.is_file():
        if path.suffix in (".jsonl", ".json", TEXT_SUFFIX):
            return None
        if path.suffix != ".parquet":
            raise UserError(f"{path}: unsupported file type {path.suffix!r}; use one of {', '.join(LOCAL_SUFFIXES)} "
                            f"({TEXT_SUFFIX}: plain text, one document per blank-line-separated block)")
        loaded = datasets.Dataset.from_parquet(str(path))
        if not len(loaded):
            raise UserError(f"{path}: the file has no rows")
        return loaded
    return _load_hub(spec, spec.name)


def read_source(spec: SourceSpec, drop_bad: bool = False) -> LoadedSource:
    """All rows of one source, in file order."""
    dataset = open_dataset(spec)
    if dataset is not None:
        return LoadedSource(spec, [without_arrow_fill(row) for row in dataset.to_list()])
    path = _local_path(spec)
    line_numbers, unreadable = None, 0
    if holds_json_lines(path):
        rows, line_numbers, unreadable = _read_jsonl(path, drop_bad)
    elif path.suffix == TEXT_SUFFIX:
        rows, line_numbers = [], []
        for texts, numbers in text_blocks(path):
            rows += [{"text": text} for text in texts]
            line_numbers += numbers
    else:
        rows = _read_json(path)
    if not rows:
        raise UserError(f"{path}: the file has no rows" + NO_TEXT * (path.suffix == TEXT_SUFFIX))
    return LoadedSource(spec, rows, line_numbers, unreadable)
