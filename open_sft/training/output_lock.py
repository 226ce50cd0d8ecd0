"""One live run per --output_dir.

Two runs on one directory (a relaunch while the first run's workers live on, or a second job with the same
flags) write checkpoints, prune each other's and export into the same files. The main process therefore holds
`OUTPUT_DIR/.open_sft.lock` for the run's lifetime:

- an advisory `flock` on it, which the kernel releases when the process dies however it dies, so a lock whose
  holder is gone is simply free again (the next run takes it over and says so);
- a lease written in it (host, pid, start time, a heartbeat renewed every HEARTBEAT_S seconds), because on some
  shared filesystems a flock taken on one host is not seen on another: a running lease of another host (or any,
  where the filesystem refuses flock) is watched for WATCH_S, and a run there is live when its heartbeat advances.
  The heartbeat's values are compared with each other, never with this host's clock: hosts' clocks differ, and a
  skew would keep a dead run's lease live or make a live one look stale. Where the filesystem refuses flock, a
  lease of this host and this pid namespace is judged at once by its pid (a dead one is taken over without the
  watch); the lease's host names the namespace, because two containers may share a hostname but not their pids.

A second run finds the lock held and stops at once with `error:` naming the live run. `--dry_run` and
`--cache_dataset_only` write nothing there and take no lock. The file stays after the run (its lease says the
run ended; the Hub upload leaves it out), unless the run failed before writing anything else: then neither the
file nor a directory the lock created is left.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ContextManager, Optional

from open_sft.durable import refused_write
from open_sft.errors import UserError

logger = logging.getLogger(__name__)

LOCK_NAME = ".open_sft.lock"
HEARTBEAT_S = 30.0
WATCH_MARGIN_S = 15.0  # WATCH_S = HEARTBEAT_S + this: a renewal delayed by a slow filesystem is still seen


@dataclass
class Lease:
    host: str  # where: the hostname, then the pid namespace where /proc names it ("node-3 pid:[4026531836]")
    pid: int
    started_at: str  # local time, ISO 8601
    heartbeat: float  # time.time() of the last renewal
    state: str = "running"  # "ended" once the run has released the lock

    def describe(self) -> str:
        beat = time.time() - self.heartbeat
        return f"pid {self.pid} on {self.host.split(' ')[0]}, started at {self.started_at}, last heartbeat {beat:.0f} s ago"


def read_lease(path: Path) -> Optional[Lease]:
    try:
        return Lease(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None  # no lease yet, or one being written: the flock decides


class OutputDirLock:
    """Held by the main process from `acquire` to `release` (or its death)."""

    def __init__(self, path: Path, fd: int, lease: Lease, created: tuple[bool, bool] = (False, False)) -> None:
        self.path, self.fd, self.lease = path, fd, lease
        self.created_dir, self.created_file = created
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="open_sft-output-lock", daemon=True)
        self._thread.start()

    @classmethod
    def acquire(cls, output_dir: Path) -> "OutputDirLock":
        """The lock, or a UserError: another run holds it, or the disk refuses its write (full, read-only: the
        lock is the first thing a run writes there)."""
        path = output_dir / LOCK_NAME
        created = (not output_dir.exists(), not path.exists())
        try:
            return cls._acquire(output_dir, path, created)
        except OSError as exc:
            refused = refused_write(exc, output_dir)
            if refused is None:
                raise
            with contextlib.suppress(OSError):  # a failed start leaves nothing behind, as release() does
                if created[1]:
                    path.unlink()
                if created[0]:
                    output_dir.rmdir()
            raise UserError(f"{refused[0]}: --output_dir {output_dir} could not be written (its lock file "
                            f"{LOCK_NAME}, the first thing a run writes there); {refused[1]} and rerun the same "
                            "command") from exc

    @classmethod
    def _acquire(cls, output_dir: Path, path: Path, created: tuple[bool, bool]) -> "OutputDirLock":
        output_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                os.close(fd)
                raise UserError(_busy(output_dir, read_lease(path), path)) from None
            # ENOLCK and the like: a filesystem without flock; the lease alone decides
            flocked = False
            logger.warning("--output_dir %s: this filesystem refused a file lock (%s); relying on the lease in %s",
                           output_dir, exc.strerror, path)
        else:
            flocked = True
        previous = read_lease(path)
        host = where()
        if previous is not None and previous.state == "running":
            why = ""
            if previous.host == host and not flocked and _gone(previous.pid):
                why = "; its process is gone from this host"
            elif previous.host.split(" ")[0] != host.split(" ")[0] or not flocked:  # the heartbeat tells
                live, why = _watch(output_dir, path, previous)
                if live is not None:
                    os.close(fd)
                    raise UserError(_busy(output_dir, live, path, why))
            logger.warning("--output_dir %s: taking over the lock of a run that is gone (%s%s)", output_dir,
                           previous.describe(), why)
        lease = Lease(host, os.getpid(), time.strftime("%Y-%m-%dT%H:%M:%S%z"), time.time())
        try:
            _write(fd, lease)
        except OSError:
            os.close(fd)
            raise
        return cls(path, fd, lease, created)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            self.lease.heartbeat = time.time()
            try:
                _write(self.fd, self.lease)
            except OSError as exc:  # a full disk or a vanished mount must not stop training
                logger.warning("could not renew the output-directory lease %s: %s", self.path, exc)

    def __enter__(self) -> "OutputDirLock":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def release(self) -> None:
        self._stop.set()
        self._thread.join()
        self.lease.state, self.lease.heartbeat = "ended", time.time()
        try:
            if self.created_file and os.listdir(self.path.parent) == [LOCK_NAME]:
                # a run that failed before writing anything leaves nothing behind, not even this file
                self.path.unlink()
                if self.created_dir:
                    self.path.parent.rmdir()
            else:
                _write(self.fd, self.lease)
        finally:
            os.close(self.fd)  # closing releases the flock


def lock_output_dir(config: Any, main_process: bool) -> ContextManager[Any]:
    """The main process's lock for a run (a FinetuneConfig); none for --dry_run and --cache_dataset_only, which
    write nothing there, and none on the other ranks."""
    if config.train.dry_run or config.data.cache_dataset_only or not main_process:
        return contextlib.nullcontext()
    return OutputDirLock.acquire(Path(config.train.output_dir))


def where() -> str:
    """This process's host as its lease records it: the hostname, and its pid namespace where /proc shows it (a
    lease written by an open_sft before this, the hostname alone, is then another host's: its heartbeat is watched)."""
    try:
        return f"{socket.gethostname()} {os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return socket.gethostname()


def _gone(pid: int) -> bool:
    """Whether no process `pid` lives in this pid namespace (one of another user's is alive: PermissionError)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _write(fd: int, lease: Lease) -> None:
    data = json.dumps(asdict(lease)).encode() + b"\n"
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)


def _watch(output_dir: Path, path: Path, previous: Lease) -> tuple[Optional[Lease], str]:
    """(the lease, or None when its run is gone; what the watch saw) of a running lease this host's flock cannot
    judge: read again each second for WATCH_S, a heartbeat (or holder) other than `previous`'s is a live run's."""
    watch = HEARTBEAT_S + WATCH_MARGIN_S
    logger.warning("--output_dir %s: its lock names a run that may be live (%s); watching its heartbeat for %.0f s "
                   "(it is renewed every %.0f s)", output_dir, previous.describe(), watch, HEARTBEAT_S)
    deadline = time.monotonic() + watch
    while time.monotonic() < deadline:
        time.sleep(min(1.0, watch))
        now = read_lease(path)
        if now is not None and now.state != "running":
            return None, "; it ended while watched"
        if now is not None and (now.host, now.pid, now.heartbeat) != (previous.host, previous.pid, previous.heartbeat):
            return now, "; its heartbeat advanced while watched"
    return None, f"; its heartbeat did not advance in {watch:.0f} s"


def _busy(output_dir: Path, lease: Optional[Lease], path: Path, why: str = "") -> str:
    who = lease.describe() if lease is not None else "its lease is not written yet"
    return (f"--output_dir {output_dir} is in use by a live run ({who}{why}; lock file {path}). Two runs would "
            "write and prune each other's checkpoints: wait for that run to finish, stop it, or pick another "
            "--output_dir")
