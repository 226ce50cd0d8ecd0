"""A build's resumable rows (`<cache_dir>/<key>.partial/`) and the abandoned ones of other keys.

A build spills its tokenized rows to `<key>.partial` (open_sft.data.spill) so that, killed, the next build of the
same key resumes from them. When the data or a setting changes the key changes, and the old partial would stay
for ever: each build (on a miss, holding its own key's lock) removes the partials of other keys that are
abandoned, logging one line for each with its size.

A partial of another key is abandoned when
- no process is building it: its key's lock can be taken without waiting (a builder holds its key's lock from
  before it reads its partial until it removes it, so a live build, even one of another run sharing the cache
  directory, is never touched; we remove it holding that lock, so a build of that key that starts meanwhile
  waits and then starts afresh), and
- it is of no use to a relaunch: a local data file it was built from has changed since (another size or
  modification time: that key will not be computed again), or nothing was written to it for ABANDONED_AFTER
  seconds (a killed build is relaunched within that, and so resumes, even while other datasets are built).
A data file that is gone does not count as changed: it may be mounted elsewhere on another node.

A staging directory of another key (`<key>.tmp-<pid>`, left by a build killed while writing the entry) is never
resumed from, so it goes as soon as its lock is free.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Iterable, Iterator

from open_sft.data.cache import is_key, lock_path, open_lock

logger = logging.getLogger(__name__)

SUFFIX = ".partial"
SOURCES = "sources.json"  # in a partial: the local data files it is built from, with their size and mtime
ABANDONED_AFTER = 6 * 3600.0


def partial_dir(cache_dir: Path, key: str) -> Path:
    return cache_dir / f"{key}{SUFFIX}"


def record_sources(partial: Path, files: Iterable[Path]) -> None:
    """Writes which local data files the build of `partial` reads, as they are now (a resumed build rewrites it)."""
    partial.mkdir(parents=True, exist_ok=True)
    stats = [{"path": str(path.resolve()), "size": path.stat().st_size, "mtime_ns": path.stat().st_mtime_ns}
             for path in files if path.is_file()]
    (partial / SOURCES).write_text(json.dumps(stats, indent=1) + "\n")


@contextlib.contextmanager
def _lock_if_free(path: Path) -> Iterator[bool]:
    """Holds the lock at `path` while the block runs when it can be taken without waiting; yields whether it was."""
    handle = open_lock(path, wait=False)
    if handle is None:
        yield False
        return
    with handle:
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _size(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def _changed_source(partial: Path) -> str | None:
    """A recorded data file that now has another size or modification time, or None."""
    try:
        recorded = json.loads((partial / SOURCES).read_text())
    except (OSError, ValueError):
        return None
    for source in recorded:
        path = Path(source["path"])
        if path.is_file() and (path.stat().st_size, path.stat().st_mtime_ns) != (source["size"], source["mtime_ns"]):
            return source["path"]
    return None


def _idle_seconds(partial: Path) -> float:
    """Seconds since anything in the partial (or the directory itself) was last written."""
    newest = max([partial.stat().st_mtime] + [p.stat().st_mtime for p in partial.rglob("*")])
    return time.time() - newest


def _why_abandoned(partial: Path) -> str | None:
    changed = _changed_source(partial)
    if changed is not None:
        return f"{changed} has changed since it was built from"
    idle = _idle_seconds(partial)
    if idle >= ABANDONED_AFTER:
        return f"not written to for {idle / 3600:.1f} h"
    return None


def _gib(size: int) -> str:
    return f"{size / (1 << 30):.2f} GiB" if size >= 1 << 30 else f"{size / (1 << 20):.1f} MiB"


def remove_abandoned(cache_dir: Path, building: str) -> None:
    """Removes the abandoned partials and staging directories of keys other than `building` (see above)."""
    for path in sorted(cache_dir.glob("*")):
        key, _, rest = path.name.partition(".")
        if key == building or not path.is_dir() or not (f".{rest}" == SUFFIX or rest.startswith("tmp-")):
            continue
        with contextlib.suppress(OSError), _lock_if_free(lock_path(cache_dir, key)) as free:
            if not free or not path.exists():
                continue
            why = "an interrupted build's staging" if rest.startswith("tmp-") else _why_abandoned(path)
            if why is None:
                continue
            size = _size(path)
            shutil.rmtree(path, ignore_errors=True)
            logger.info("removed the abandoned partial build %s (%s; %s): no process was building it", path,
                        _gib(size), why)
    _remove_idle_locks(cache_dir, building)


def _remove_idle_locks(cache_dir: Path, building: str) -> None:
    """Removes the lock files of other keys that have no entry, partial or staging directory and that no process
    holds (taken without waiting, and removed holding them: open_sft.data.cache.open_lock): a failed build's, a
    killed one's, an abandoned partial's."""
    for lock in sorted(cache_dir.glob("*.lock")):
        key = lock.name[: -len(".lock")]
        if key == building or not is_key(key) or \
                any(path.name != lock.name for path in cache_dir.glob(f"{key}*")):
            continue
        with contextlib.suppress(OSError), _lock_if_free(lock) as free:
            if free:
                lock.unlink(missing_ok=True)
