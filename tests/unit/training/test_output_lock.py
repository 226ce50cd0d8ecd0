"""The output dir's lease where this host's flock cannot judge it (another host's run on a shared filesystem; a
filesystem without flock): its heartbeat watched, its values compared with each other, never with this host's
clock. The flock itself, with real processes holding and dying with it: tests/integration/test_output_lock.py."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest

from open_sft.errors import UserError
from open_sft.training import output_lock
from open_sft.training.output_lock import LOCK_NAME, OutputDirLock


def plant_lease(output_dir: Path, host: str, heartbeat: float) -> None:
    output_dir.mkdir(exist_ok=True)
    lease = {"host": host, "pid": 12345, "started_at": "2026-01-01T00:00:00+0000", "heartbeat": heartbeat,
             "state": "running"}
    (output_dir / LOCK_NAME).write_text(json.dumps(lease))


@pytest.fixture
def short_watch(monkeypatch) -> None:
    monkeypatch.setattr(output_lock, "HEARTBEAT_S", 0.2)
    monkeypatch.setattr(output_lock, "WATCH_MARGIN_S", 0.1)


@pytest.fixture
def slept(monkeypatch) -> list[float]:
    """The watch's sleeps, on a clock they advance: no real waiting, and no wall time judged."""
    clock, sleeps = [0.0], []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        clock[0] += seconds

    monkeypatch.setattr(output_lock.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(output_lock.time, "sleep", sleep)
    return sleeps


@pytest.mark.parametrize("age_s", [20.0, -600.0])  # a requeue 20 s after a hard kill there; a clock 10 min ahead
def test_a_dead_runs_lease_of_another_host_is_taken_over_once_its_heartbeat_stands_still(tmp_path, short_watch,
                                                                                          slept, caplog, age_s) -> None:
    """review ckpt 5: a hard-killed run's lease stays 'running': a requeue on another host within 120 s was refused
    'in use by a live run' (exit 2, so the scheduler did not retry), and a lease from a host whose clock is ahead
    stayed live for as long. Its heartbeat is watched for a renewal period instead."""
    plant_lease(tmp_path, "node-17", time.time() - age_s)
    with caplog.at_level(logging.WARNING, logger="open_sft.training.output_lock"):
        OutputDirLock.acquire(tmp_path).release()
    assert sum(slept) >= 0.3  # watched one renewal period and its margin
    assert "its lock names a run that may be live (pid 12345 on node-17" in caplog.text
    assert "watching its heartbeat for 0 s (it is renewed every 0 s)" in caplog.text
    assert "taking over the lock of a run that is gone (pid 12345 on node-17" in caplog.text
    assert "its heartbeat did not advance in 0 s)" in caplog.text


def test_a_live_run_of_another_host_is_refused_whatever_its_clock_says(tmp_path, short_watch, monkeypatch) -> None:
    """A live run there renews its heartbeat: refused (naming it), even when this host's clock makes the lease look
    long stale (a skew of 10 minutes took a live run's directory before)."""
    plant_lease(tmp_path, "node-17", time.time() - 600)
    sleep = time.sleep

    def renewed_there(seconds: float) -> None:  # the other host's heartbeat thread, renewing during the watch
        lease = json.loads((tmp_path / LOCK_NAME).read_text())
        plant_lease(tmp_path, "node-17", lease["heartbeat"] + 0.2)
        sleep(seconds)

    monkeypatch.setattr(output_lock.time, "sleep", renewed_there)
    with pytest.raises(UserError, match=r"in use by a live run \(pid 12345 on node-17, .*; its heartbeat advanced "
                                        r"while watched; lock file"):
        OutputDirLock.acquire(tmp_path)
    assert json.loads((tmp_path / LOCK_NAME).read_text())["host"] == "node-17"  # left as it was


@pytest.fixture
def no_flock(monkeypatch) -> None:
    """A filesystem that refuses flock (ENOLCK): the lease alone decides."""
    import errno

    def refuse(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(output_lock.fcntl, "flock", refuse)


def test_without_flock_a_dead_pid_of_this_host_is_taken_over_at_once(tmp_path, no_flock, monkeypatch, slept,
                                                                     caplog) -> None:
    """Without flock a requeue on the same host watched the dead run's heartbeat for 45 s, though its pid can be
    checked on the spot: gone (ProcessLookupError) is taken over at once; a live pid (this process, another
    user's: PermissionError) and a lease of another pid namespace are watched as before."""
    monkeypatch.setattr(output_lock, "HEARTBEAT_S", 30.0)  # a watch would take 45 s: the test would time out
    plant_lease(tmp_path, output_lock.where(), time.time())
    killed = []

    def kill(pid: int, signal: int) -> None:
        killed.append((pid, signal))
        raise ProcessLookupError(pid)

    monkeypatch.setattr(output_lock.os, "kill", kill)
    with caplog.at_level(logging.WARNING, logger="open_sft.training.output_lock"):
        OutputDirLock.acquire(tmp_path).release()
    assert slept == [] and killed == [(12345, 0)]  # taken over without a watch
    assert "taking over the lock of a run that is gone (pid 12345 on " in caplog.text
    assert "; its process is gone from this host)" in caplog.text and "watching its heartbeat" not in caplog.text


@pytest.mark.parametrize("case", ["alive", "another user's", "another pid namespace"])
def test_without_flock_a_live_pid_or_another_namespace_is_still_watched(tmp_path, no_flock, short_watch,
                                                                        monkeypatch, caplog, case) -> None:
    host = output_lock.where()
    plant_lease(tmp_path, host.split(" ")[0] + " pid:[1]" if case == "another pid namespace" else host, time.time())

    def kill(pid: int, signal: int) -> None:
        if case == "another user's":
            raise PermissionError(pid)
        if case == "another pid namespace":
            raise ProcessLookupError(pid)  # not there, in this namespace: no reason to think it dead

    monkeypatch.setattr(output_lock.os, "kill", kill)
    with caplog.at_level(logging.WARNING, logger="open_sft.training.output_lock"):
        OutputDirLock.acquire(tmp_path).release()
    assert "watching its heartbeat" in caplog.text and "its heartbeat did not advance in 0 s)" in caplog.text
    assert "its process is gone" not in caplog.text
