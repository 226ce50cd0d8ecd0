"""Writes that survive a crash or a kill at any instant: a file is complete under its final name or absent.

One way for every marker and record open_sft writes (a checkpoint's COMPLETE manifest, RUN_COMPLETE, the
tokenization spill's state): write a temporary file beside it, flush and fsync it, rename it into place, and
fsync the directory so the rename itself is on disk. And one way to keep an earlier run's directory when a run
starts over (`set_aside`): renamed whole, never mixed with the new run's files; a symlink to a directory (a user's
routing of checkpoints/ or tensorboard/ to another disk) keeps its link and its target, the earlier files moved into
previous-N inside the target (renames on its own disk, needing no write access beside it; a target that is a mount
point cannot be renamed at all).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any, Iterator, Optional

logger = logging.getLogger(__name__)
PREVIOUS = re.compile(r"^previous-\d+$")  # set_aside's folders inside a symlinked directory's target


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Every file and directory under root on disk (each rank calls it after its own writes)."""
    for directory, _, files in os.walk(root):
        for path in [Path(directory) / name for name in files] + [Path(directory)]:
            with contextlib.suppress(FileNotFoundError):  # another rank's temporary file, renamed since listed
                fsync_path(path)


def write_json(path: Path, value: Any, indent: int | None = 1) -> None:
    """`value` as JSON at `path`, atomically and durably (tmp file, fsync, rename, fsync of the directory)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("w") as handle:
            json.dump(value, handle, indent=indent)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk: no half-written NAME.tmp left beside it
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def set_aside(directory: Path) -> Path | None:
    """An earlier run's non-empty `directory` renamed to NAME.previous-N (the first N free), returned; None when
    there is nothing to keep. A symlink to a directory stays, and so does its target (the user's, perhaps a mount
    point or in a directory they cannot write): the target's entries move into its previous-N (first_previous; the
    earlier previous-K stay where they are), so the new run's files follow the link as before. Where that fails,
    the link itself is renamed aside and an empty directory made in its place, with a warning."""
    if not directory.is_dir() or not any(directory.iterdir()):
        return None
    if not directory.is_symlink():
        target = next_previous(directory)
        directory.rename(target)
        return target
    real = directory.resolve()
    entries = [entry for entry in real.iterdir() if not PREVIOUS.match(entry.name)]
    if not entries:
        return None
    target = first_previous(real)
    try:
        target.mkdir()
        for entry in entries:
            entry.rename(target / entry.name)
        return target
    except OSError as exc:
        with contextlib.suppress(OSError):  # left in the target only if something was moved into it
            target.rmdir()
        aside = next_previous(directory)
        directory.rename(aside)
        directory.mkdir()
        logger.warning("%s links to %s, whose earlier files could not be moved into %s there (%s): the link was "
                       "renamed to %s instead, and the new run writes to a new directory %s on the output directory's "
                       "disk; to route it again, replace it with a link to an empty directory before the next launch",
                       directory, real, target.name, exc, aside, directory)
        return aside


def first_previous(real: Path) -> Path:
    """previous-N inside the directory `real`, the first N free: where a symlinked directory's earlier files go."""
    k = 1
    while (real / f"previous-{k}").exists():
        k += 1
    return real / f"previous-{k}"


def remove_tree(path: Path) -> None:
    """The directory `path` deleted; a symlink to one is unlinked and its target, the user's, left whole."""
    if path.is_symlink():
        path.unlink()
    else:
        shutil.rmtree(path)


def next_previous(directory: Path) -> Path:
    """NAME.previous-N beside `directory`, the first N free."""
    k = 1
    while directory.with_name(f"{directory.name}.previous-{k}").exists():
        k += 1
    return directory.with_name(f"{directory.name}.previous-{k}")


#: torch.save's zip writer reports a write the disk refused as a RuntimeError without the errno ("[enforce fail at
#: inline_container.cc:672] . unexpected pos ...", "PytorchStreamWriter failed writing file ..."): read as a full
#: disk when the disk has (next to) nothing free then.
TORCH_WRITE_FAILED = ("inline_container.cc", "PytorchStreamWriter failed")
NEARLY_FULL = 64 << 20
#: The Rust writers (safetensors' SafetensorError, the tokenizers library's bare Exception) carry the errno only in
#: their message, as Rust's io::Error prints it: "No space left on device (os error 28)".
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def out_of_space(exc: BaseException, path: Path) -> Optional[str]:
    """'the disk holding PATH is full (N free)' when `exc`, or an exception behind it, is a write the disk refused
    for want of space (ENOSPC, a quota: EDQUOT, torch's zip writer's failure on a full disk, a Rust writer's
    'os error 28'/'122', any rank's failure inside torch.distributed.checkpoint's CheckpointException), else None."""
    free = getattr(exc, FREE_BEFORE_CLEANUP, None)
    free = free_bytes(path) if free is None else free
    for each in _behind(exc):
        code = each.errno if isinstance(each, OSError) else None
        found = _RUST_OS_ERROR.search(str(each)) if code is None else None
        code = int(found.group(1)) if found else code
        if code in (errno.ENOSPC, errno.EDQUOT):
            what = "your disk quota there is used up" if code == errno.EDQUOT else "the disk is full"
            return f"{path}: {what} ({human_size(free)} free)"
        if (isinstance(each, RuntimeError) and any(mark in str(each) for mark in TORCH_WRITE_FAILED)
                and free is not None and free < NEARLY_FULL):
            return f"{path}: the disk is full ({human_size(free)} free)"
    return None


FREE_SPACE = "free space there"  # refused_write's fix for a full disk (a caller tells it from the others by it)


def refused_write(exc: BaseException, path: Path) -> Optional[tuple[str, str]]:
    """(what, fix) when `exc` is a write the system refused: out_of_space's 'PATH: the disk is full (N free)' with
    FREE_SPACE, or a read-only file system or a permission (the file named) with the way to make it
    writable; else None (another failure: its traceback stays)."""
    full = out_of_space(exc, path)
    if full is not None:
        return full, FREE_SPACE
    for each in _behind(exc):
        if isinstance(each, OSError) and each.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            where = each.filename or path
            if each.errno == errno.EROFS:
                return f"{where}: the file system is read-only", "remount it read-write (or move the run's files)"
            return f"{where}: this user may not write there", "give this user write permission there"
    return None


#: what free_before_cleanup notes on an exception: the space a failed write found, before its partial files went
FREE_BEFORE_CLEANUP = "open_sft_free_before_cleanup"


def free_before_cleanup(exc: BaseException, path: Path) -> None:
    """Note on `exc` the space free at `path` now, before the failed write's partial files are removed: a message
    that measured after the cleanup would call a full disk a roomy one (the export's staged megabytes freed)."""
    if getattr(exc, FREE_BEFORE_CLEANUP, None) is None:
        try:
            setattr(exc, FREE_BEFORE_CLEANUP, free_bytes(path))
        except AttributeError:  # an exception type without attributes: measured later, after the cleanup
            pass


def _behind(exc: Optional[BaseException]) -> Iterator[BaseException]:
    """`exc` and every exception behind it: its causes and contexts, and the per-rank failures a
    torch.distributed.checkpoint CheckpointException holds (rank -> (exception, traceback))."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        each = todo.pop()
        if not isinstance(each, BaseException) or id(each) in seen:
            continue
        seen.add(id(each))
        yield each
        failures = getattr(each, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) and f else f for f in failures.values()]
        todo += [each.__context__, each.__cause__]


def free_bytes(path: Path) -> Optional[int]:
    """Bytes free to this user on the filesystem of `path` (its nearest existing parent), None if unknown."""
    path = Path(path).absolute()
    try:
        return shutil.disk_usage(next(p for p in (path, *path.parents) if p.exists())).free
    except OSError:
        return None


def human_size(size: Optional[int]) -> str:  # type: ignore[return]
    if size is None:
        return "unknown"
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size} {unit}" if unit == "bytes" else f"{size:.1f} {unit}"
        size /= 1024
