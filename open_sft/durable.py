"""Writes that survive a crash or a kill at any instant: a file is complete under its final name or absent.

One way for every marker and record open_sft writes (a checkpoint's COMPLETE manifest, RUN_COMPLETE, the
tokenization spill's state): write a temporary file beside it, flush and fsync it, rename it into place, and
fsync the directory so the rename itself is on disk. And one way to keep an earlier run's directory when a run
starts over (`set_aside`): renamed whole, never mixed with the new run's files.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any


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
    with tmp.open("w") as handle:
        json.dump(value, handle, indent=indent)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def set_aside(directory: Path) -> Path | None:
    """An earlier run's non-empty `directory` renamed to NAME.previous-N (the first N free), returned; None when
    there is nothing to keep."""
    if not directory.is_dir() or not any(directory.iterdir()):
        return None
    target = next_previous(directory)
    directory.rename(target)
    return target


def next_previous(directory: Path) -> Path:
    """NAME.previous-N beside `directory`, the first N free."""
    k = 1
    while directory.with_name(f"{directory.name}.previous-{k}").exists():
        k += 1
    return directory.with_name(f"{directory.name}.previous-{k}")
