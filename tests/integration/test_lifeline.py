"""A rank started by a launcher stops when the launcher is killed; one started by hand outlives its shell.

The processes are real: a "launcher" process starts a "rank" that installs open_sft's lifeline and then blocks
(as in a collective); the launcher is SIGKILLed. The rank's exit code comes back through
OPEN_SFT_EXIT_CODE_DIR (it is not our child). Whole launches are in tests/integration/test_checkpoint.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from conftest import ROOT

RANK = """
import os, sys, threading
from open_sft.distributed import lifeline
lifeline.install()
print(os.getpid(), flush=True)
threading.Event().wait()  # blocked, as inside a collective
"""
LAUNCHER = """
import subprocess, sys, time
rank = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, stderr=open(sys.argv[2], "w"),
                        text=True, start_new_session=True)
print(rank.stdout.readline().strip(), flush=True)
time.sleep(600)
"""


def start(tmp_path: Path, follow: str) -> tuple[subprocess.Popen, psutil.Process]:
    env = {**os.environ, "OPEN_SFT_FOLLOW_LAUNCHER": follow, "OPEN_SFT_EXIT_CODE_DIR": str(tmp_path),
           "RANK": "3", "PYTHONPATH": str(ROOT)}
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, RANK, str(tmp_path / "rank.err")], env=env,
                                stdout=subprocess.PIPE, text=True)
    return launcher, psutil.Process(int(launcher.stdout.readline()))


def gone_within(process: psutil.Process, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if process.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_a_rank_stops_within_seconds_of_its_launchers_death(tmp_path) -> None:
    launcher, rank = start(tmp_path, follow="1")
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    assert gone_within(rank, 10)
    assert (tmp_path / "rank3").read_text().strip() == "4"
    err = (tmp_path / "rank.err").read_text()
    assert f"error: rank 3: its launcher (pid {launcher.pid}) is gone; stopping this rank without writing a " \
           "checkpoint (exit 4)" in err


def test_a_process_started_by_hand_outlives_its_shell(tmp_path) -> None:
    """nohup python finetune.py ... & then logging out: the run goes on."""
    launcher, rank = start(tmp_path, follow="0")
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    try:
        assert not gone_within(rank, 2)
    finally:
        rank.kill()
    assert not (tmp_path / "rank3").exists()
