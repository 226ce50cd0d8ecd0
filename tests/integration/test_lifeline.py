"""A rank started by a launcher stops when the launcher is killed; one started by hand outlives its shell.

The processes are real: a "launcher" process starts a "rank" that installs open_sft's lifeline and then blocks
(as in a collective); the launcher is SIGKILLed. The rank's exit code comes back through
OPEN_SFT_EXIT_CODE_DIR (it is not our child). The last test kills a whole `accelerate launch` during its start-up;
launches killed mid-run are in tests/integration/test_checkpoint.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import ROOT, SAMPLE, child_env, launch_command

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


def run_processes(marker: str) -> list[psutil.Process]:
    """The live processes (not zombies) whose command line names `marker` (the run's output directory)."""
    found = []
    for process in psutil.process_iter(["cmdline", "status"]):
        try:
            if process.info["status"] != psutil.STATUS_ZOMBIE and marker in " ".join(process.info["cmdline"] or ()):
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def wait_for(moment: str, launcher: subprocess.Popen, output_dir: Path) -> None:
    """Until `moment` of the launch: 1 s in (the launcher itself still importing), its workers just started (their
    imports take seconds), or the first optimizer step logged."""
    deadline = time.monotonic() + 300
    if moment == "launcher_starting":
        time.sleep(1.0)
        return
    while time.monotonic() < deadline and launcher.poll() is None:
        if moment == "workers_importing" and len(psutil.Process(launcher.pid).children()) >= 2:
            return
        if moment == "training" and (output_dir / "metrics.jsonl").exists():
            return
        time.sleep(0.02)
    raise AssertionError(f"the launch never reached {moment} (exit {launcher.poll()})")


@pytest.mark.parametrize("moment", ["launcher_starting", "workers_importing", "training"])
def test_a_launcher_killed_at_any_moment_of_start_up_leaves_no_process(moment, tiny_model_dir, tmp_path) -> None:
    """`accelerate launch` SIGKILLed 1 s in, as its 2 workers start (before their imports finish: they are adopted
    before open_sft.run loads) and once training runs: 10 s later no process of the run is left."""
    output_dir = tmp_path / f"lifeline_{moment}"
    args = ["--model_name_or_path", str(tiny_model_dir), "--dataset_mixer_list", str(SAMPLE), "1.0",
            "--output_dir", str(output_dir), "--max_train_steps", "200", "--per_device_train_batch_size", "2",
            "--max_seq_length", "128", "--logging_steps", "1", "--torch_dtype", "float32"]
    log = tmp_path / "launch.log"
    with log.open("w") as handle:
        launcher = subprocess.Popen(launch_command(2, None) + args, cwd=ROOT, env=child_env(), stdout=handle,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_for(moment, launcher, output_dir)
        finally:
            launcher.send_signal(signal.SIGKILL)
            launcher.wait()
    deadline = time.monotonic() + 10
    while run_processes(str(output_dir)) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = run_processes(str(output_dir))
    for process in left:
        process.kill()
    assert not left, f"alive 10 s after the launcher's SIGKILL: {[p.pid for p in left]}\n{log.read_text()[-3000:]}"
