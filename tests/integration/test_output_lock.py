"""One live run per --output_dir: the flock and the lease of open_sft.training.output_lock, with real processes
holding and dying with the lock (the end-to-end launches are in tests/integration/test_checkpoint.py)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from open_sft.errors import UserError
from open_sft.training import output_lock
from open_sft.training.output_lock import LOCK_NAME, OutputDirLock

HOLD = """
import sys, time
from pathlib import Path
from open_sft.training.output_lock import OutputDirLock
lock = OutputDirLock.acquire(Path(sys.argv[1]))
print("held", flush=True)
time.sleep(600)
"""


def hold_in_a_process(output_dir: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(output_dir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_live_holder_refuses_a_second_run_naming_it(tmp_path) -> None:
    holder = hold_in_a_process(tmp_path)
    try:
        with pytest.raises(UserError) as info:
            OutputDirLock.acquire(tmp_path)
        message = str(info.value)
        assert f"--output_dir {tmp_path} is in use by a live run (pid {holder.pid} on " in message
        assert "started at" in message and str(tmp_path / LOCK_NAME) in message
    finally:
        holder.kill()
        holder.wait()


def test_the_lock_of_a_killed_run_is_taken_over_with_a_warning(tmp_path, caplog) -> None:
    holder = hold_in_a_process(tmp_path)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    with caplog.at_level(logging.WARNING, logger="open_sft.training.output_lock"):
        with OutputDirLock.acquire(tmp_path) as lock:
            lease = json.loads((tmp_path / LOCK_NAME).read_text())
            assert lease["pid"] == os.getpid() and lease["state"] == "running"
            assert lock.lease.pid == os.getpid()
    assert f"taking over the lock of a run that is gone (pid {holder.pid} on " in caplog.text
    assert json.loads((tmp_path / LOCK_NAME).read_text())["state"] == "ended"


def test_an_ended_run_leaves_the_lock_free_without_a_warning(tmp_path, caplog) -> None:
    with OutputDirLock.acquire(tmp_path):
        (tmp_path / "metrics.jsonl").write_text("")
    with caplog.at_level(logging.WARNING, logger="open_sft.training.output_lock"):
        OutputDirLock.acquire(tmp_path).release()
    assert caplog.text == ""


def test_a_run_that_wrote_nothing_leaves_nothing(tmp_path) -> None:
    """A run that fails on its data before writing anything: no lock file and no directory are left."""
    with pytest.raises(RuntimeError):
        with OutputDirLock.acquire(tmp_path / "new" / "out"):
            raise RuntimeError("bad data")
    assert not (tmp_path / "new" / "out").exists() and (tmp_path / "new").is_dir()
    (tmp_path / "empty").mkdir()
    with OutputDirLock.acquire(tmp_path / "empty"):  # a directory that was there stays
        pass
    assert (tmp_path / "empty").is_dir() and not (tmp_path / "empty" / LOCK_NAME).exists()


def test_the_heartbeat_renews_the_lease(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(output_lock, "HEARTBEAT_S", 0.05)
    with OutputDirLock.acquire(tmp_path):
        first = json.loads((tmp_path / LOCK_NAME).read_text())["heartbeat"]
        time.sleep(0.3)
        assert json.loads((tmp_path / LOCK_NAME).read_text())["heartbeat"] > first


def test_dry_run_and_cache_only_take_no_lock(tmp_path) -> None:
    from open_sft.config.parse import parse_config

    base = ["--model_name_or_path", "m", "--dataset_mixer_list", "d.jsonl", "1.0", "--output_dir", str(tmp_path / "o")]
    for extra in (["--dry_run"], ["--cache_dataset_only"]):
        with output_lock.lock_output_dir(parse_config(base + extra), main_process=True):
            assert not (tmp_path / "o" / LOCK_NAME).exists()
    with output_lock.lock_output_dir(parse_config(base), main_process=False):
        assert not (tmp_path / "o" / LOCK_NAME).exists()
    with output_lock.lock_output_dir(parse_config(base), main_process=True):
        assert (tmp_path / "o" / LOCK_NAME).exists()
        (tmp_path / "o" / "run.json").write_text("{}")
    assert json.loads((tmp_path / "o" / LOCK_NAME).read_text())["state"] == "ended"
