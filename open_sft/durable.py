"""Writes that survive a crash or a kill at any instant: a file is complete under its final name or absent.

One way for every marker and record open_sft writes (a checkpoint's COMPLETE manifest, RUN_COMPLETE, the
tokenization spill's state): write a temporary file beside it, flush and fsync it, rename it into place, and
fsync the directory so the rename itself is on disk.
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
