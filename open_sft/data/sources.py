"""Reading the sources named in --dataset_mixer_list into plain row dicts.

Local JSON Lines, JSON and text files are read by open_sft.data.local_files (each bad line named); the other kinds
through `datasets`. A plain text file
(.txt) is text rows, `{"text": ...}`, one document per block of lines between blank lines: what corpus dumps
one document per paragraph look like, and what can be read a chunk at a time (one document per file could not be).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from open_sft.data.compressed import COMPRESSIONS, compression, data_suffix
from open_sft.data.damaged_files import cut_short_zstd, damaged_file, failed_reading
from open_sft.data.formats import without_arrow_fill
from open_sft.data.local_files import holds_json_lines, read_json, read_jsonl, text_blocks
from open_sft.errors import UserError

logger = logging.getLogger(__name__)

TEXT_SUFFIX = ".txt"  # plain text for continual pretraining: one document per blank-line-separated block
PLAIN_SUFFIXES = (".jsonl", ".json", ".parquet", TEXT_SUFFIX)
# JSON Lines, JSON and text files may be compressed (x.jsonl.gz): read as the inner suffix says, decompressed
LOCAL_SUFFIXES = PLAIN_SUFFIXES + tuple(f"{name}{kind}" for name in (".jsonl", ".json", TEXT_SUFFIX)
                                        for kind in COMPRESSIONS)


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


_said_whole_file: set[tuple[str, str, str]] = set()  # (flag, split, file) said read whole


def parse_mixer_list(values: list[str], splits: list[str], flag: str = "--dataset_mixer_list",
                     config_name: Optional[str] = None, template_kwargs: Optional[list[str]] = None
                     ) -> list[SourceSpec]:
    """`["a.jsonl", "0.5", "b.jsonl", "100"]` → specs. An amount with a '.' is a fraction, else a row count."""
    specs = []
    for i in range(0, len(values), 2):
        name, raw = values[i], values[i + 1]
        problem = amount_problem(flag, name, raw)
        if problem:
            raise UserError(problem)
        is_fraction = "." in raw
        amount = float(raw) if is_fraction else int(raw)
        split = splits[0] if len(splits) == 1 else splits[i // 2]
        if split != "train" and name.endswith(LOCAL_SUFFIXES) and Path(name).expanduser().is_file():
            if len(splits) > 1:  # asked for this file by name
                raise UserError(f"{flag}_splits: split {split!r} for {name}: a local file is one split, its rows are "
                                "all read; give train for it (or a dataset directory with split files)")
            if (flag, split, name) not in _said_whole_file:  # parsed again by each phase: said once a process
                _said_whole_file.add((flag, split, name))
                logger.warning("%s_splits %s: %s is a local file, one split: all its rows are read", flag, split, name)
        variables = (template_kwargs[0] if len(template_kwargs) == 1 else template_kwargs[i // 2]) \
            if template_kwargs else None
        variables = json.dumps(json.loads(variables), sort_keys=True) if variables else None
        specs.append(SourceSpec(name=name, amount=amount, is_fraction=is_fraction, split=split,
                                config_name=config_name, chat_template_kwargs=None if variables == "{}" else variables))
    return specs


def amount_problem(flag: str, name: str, raw: str, positive: bool = True) -> Optional[str]:
    """What is wrong with the AMOUNT `raw` given to `flag` for source `name` (None when nothing): a fraction (with a
    '.') or a whole row count, finite and, with `positive`, above 0; checked with the flags, and again when read."""
    try:
        amount = float(raw) if "." in raw else int(raw)
    except ValueError:
        return f"{flag}: amount {raw!r} for {name} is not a number; {_amount_hint(raw)}"
    if not math.isfinite(amount) or (positive and amount <= 0):
        return (f"{flag}: amount {raw} for {name} must be a finite number above 0 (a fraction like 1.0 or a row count "
                "like 500); leave out a source you want none of")
    return None


def _amount_hint(raw: str) -> str:
    """The fix for an AMOUNT that is not a number: the same amount written as one, where it was one in another form."""
    number = raw.strip().removesuffix("%")
    try:
        value = float(number)
    except ValueError:
        return "use a fraction like 1.0 or a row count like 500"
    if raw.strip().endswith("%"):
        return f"a percentage is written as a fraction: {value / 100:g}" + ("" if value % 100 else ".0")
    if value.is_integer():
        return f"a row count is a whole number written out, {int(value)} (an amount with a '.' is a fraction)"
    return "use a fraction like 1.0 or a row count like 500"


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


def missing_file_problem(flag: str, name: str) -> Optional[str]:
    """Why the local data file `name` (by its suffix) or directory (a path: ./, /, ~) given to `flag` cannot be read
    because it is not there, with the fix (a glob pattern that reached us unexpanded: the directory instead); None
    when it is there or names no local path (a Hub id)."""
    path_like = name.startswith((".", "/", "~"))  # no Hub id: a local directory meant
    if not (name.endswith(LOCAL_SUFFIXES) or path_like) or Path(name).expanduser().exists():
        return None
    what = "data file" if name.endswith(LOCAL_SUFFIXES) else "data directory"
    if any(char in name for char in "*?["):
        return (f"{flag}: {what} {name} does not exist: a glob pattern is not expanded; give the directory that "
                "holds the files (all of them are read, one format), or each file with its own amount")
    return f"{flag}: {what} {name} does not exist; check the path"


def _local_path(spec: SourceSpec) -> Path:
    problem = missing_file_problem("--dataset_mixer_list", spec.name)
    if problem:
        raise UserError(problem)
    return Path(spec.name).expanduser()


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


NO_TEXT = " (a .txt file's documents are its blocks of non-blank lines)"


def _load_hub(spec: SourceSpec, where: str) -> Any:
    """A Hub dataset id, or a local directory laid out as a Hub dataset repository (data files, or a README
    whose YAML names configs), through `datasets.load_dataset` with --dataset_config_name and the split."""
    import datasets

    try:
        return datasets.load_dataset(where, name=spec.config_name, split=spec.split)
    except Exception as exc:  # datasets raises many types; the user needs the name and the cause
        config = f", config {spec.config_name!r}" if spec.config_name else ""
        if _offline_and_not_cached(exc, where):
            raise UserError(f"dataset {spec.name!r} (split {spec.split!r}{config}): HF_HUB_OFFLINE is set and the "
                            "local Hugging Face caches do not hold it, so it cannot be loaded. Give a local copy "
                            "instead: a .jsonl, .json or .parquet file, or a directory of them (on a machine with "
                            f"network: `hf download {spec.name} --repo-type dataset --local-dir DIR`, then "
                            "--dataset_mixer_list DIR AMOUNT); or unset HF_HUB_OFFLINE where the Hub can be "
                            "reached. If it is meant to be a local path, check it") from exc
        damaged = damaged_file(Path(where)) if Path(where).is_dir() and failed_reading(exc) else None
        if damaged:
            raise UserError(in_directory(damaged, spec)) from exc
        hint = ("Check the split (--dataset_mixer_list_splits) and the config (--dataset_config_name); a local "
                "directory's data files must share one set of columns (one format)" if Path(where).is_dir() else
                "If it is meant to be a local file, check the path; if a Hub dataset, check the id, the split "
                "(--dataset_mixer_list_splits), the config (--dataset_config_name) and network access")
        raise UserError(f"dataset {spec.name!r} (split {spec.split!r}{config}) could not be loaded: "
                        f"{_with_causes(exc).rstrip('.')}. {hint}") from exc


def in_directory(problem: str, spec: SourceSpec) -> str:
    """The problem of a file of the directory `spec` names, with the way on without it."""
    return f"{problem}; or move that file out of the directory {spec.name} to train on its other files"


def _offline_and_not_cached(exc: BaseException, where: str) -> bool:
    """Whether `where`, no local path, failed to load because HF_HUB_OFFLINE is set and no cache holds it (datasets
    says "Couldn't reach ... (OfflineModeIsEnabled)" and "is not cached in None")."""
    from open_sft.model.source import hub_offline

    if Path(where).expanduser().exists() or where.startswith((".", "/", "~")) or not hub_offline():
        return False
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, (ConnectionError, FileNotFoundError)):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


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


def saved_by_datasets(path: Path) -> bool:
    """A directory `Dataset.save_to_disk` / `DatasetDict.save_to_disk` wrote (else a Hub repository layout)."""
    return (path / "dataset_dict.json").exists() or (path / "state.json").exists()


def open_dataset(spec: SourceSpec) -> Any:
    """The `datasets.Dataset` (memory-mapped Arrow) of a source that is not a local JSON, JSON Lines or plain
    text file: a parquet file, a `save_to_disk` directory, a directory laid out as a Hub dataset, a Hub id. None
    for JSON, JSON Lines and plain text files, which are read as text."""
    import datasets

    path = _local_path(spec)
    if path.is_dir() and not saved_by_datasets(path):
        cut = cut_short_zstd(path)  # which datasets would read without a word, short of the rows after the cut
        if cut:
            raise UserError(in_directory(cut, spec))
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
        if data_suffix(path) in (".jsonl", ".json", TEXT_SUFFIX):
            return None
        if path.suffix != ".parquet":
            raise UserError(_unsupported(path))
        loaded = _read_parquet(path)
        if not len(loaded):
            raise UserError(f"{path}: the file has no rows")
        return loaded
    return _load_hub(spec, spec.name)


def decoded_rows(spec: SourceSpec, dataset: Any, start: int = 0) -> list[dict[str, Any]]:
    """`dataset.to_list()`, rows `start` on of the source. datasets' JSON loader takes text that is not UTF-8 into
    its Arrow strings without a word, and reading such a row raised UnicodeDecodeError: the file and line are named
    (a directory's files read again to find them), else the rows."""
    try:
        return dataset.to_list()
    except UnicodeDecodeError:
        path = Path(spec.name).expanduser()
        damaged = damaged_file(path) if path.is_dir() else None
        if damaged:
            raise UserError(in_directory(damaged, spec)) from None
        raise UserError(f"{spec.name} rows {start + 1} to {start + len(dataset)}: a string that is not UTF-8; data "
                        "must be UTF-8: re-encode the source") from None


def _unsupported(path: Path) -> str:
    """Why a local file is not read, by its suffixes (a compressed parquet file: parquet compresses inside)."""
    kinds = "/".join(COMPRESSIONS)
    what = "".join(path.suffixes[-2:]) if compression(path) else path.suffix
    fix = " (parquet compresses its columns itself: decompress the file)" if data_suffix(path) == ".parquet" else ""
    return (f"{path}: unsupported file type {what!r}{fix}; use one of {', '.join(PLAIN_SUFFIXES)} ({TEXT_SUFFIX}: "
            f"plain text, one document per blank-line-separated block), a .jsonl, .json or {TEXT_SUFFIX} file may "
            f"be compressed ({kinds})")


def _read_parquet(path: Path) -> Any:
    """A .parquet file as a Dataset; one that is not parquet (damaged, cut short, another format renamed) is named."""
    import datasets
    import pyarrow

    try:
        return datasets.Dataset.from_parquet(str(path))
    except (pyarrow.ArrowException, OSError) as exc:  # ArrowInvalid: "Parquet magic bytes not found in footer"
        if isinstance(exc, OSError) and not isinstance(exc, pyarrow.ArrowException) and exc.errno is not None:
            raise  # the system's own failure (a full disk, no permission): not the file's content
        raise UserError(f"{path}: not a readable parquet file ({' '.join(str(exc).split())}); check the file (a "
                        "damaged or cut-short copy, or another format named .parquet: JSON Lines is read as "
                        ".jsonl)") from exc


def read_source(spec: SourceSpec, drop_bad: bool = False) -> LoadedSource:
    """All rows of one source, in file order."""
    dataset = open_dataset(spec)
    if dataset is not None:
        return LoadedSource(spec, [without_arrow_fill(row) for row in decoded_rows(spec, dataset)])
    path = _local_path(spec)
    line_numbers, unreadable = None, 0
    if holds_json_lines(path):
        rows, line_numbers, unreadable = read_jsonl(path, drop_bad)
    elif data_suffix(path) == TEXT_SUFFIX:
        rows, line_numbers = [], []
        for texts, numbers in text_blocks(path):
            rows += [{"text": text} for text in texts]
            line_numbers += numbers
    else:
        rows, line_numbers = read_json(path)
    if not rows:
        raise UserError(f"{path}: the file has no rows" + NO_TEXT * (data_suffix(path) == TEXT_SUFFIX))
    return LoadedSource(spec, rows, line_numbers, unreadable)
