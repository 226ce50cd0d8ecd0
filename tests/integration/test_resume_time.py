"""Time is counted across launches: a run stopped by SIGTERM and relaunched after a pause reports the training time
of both launches (elapsed_s, tokens/s, the ETA right after the resume, report/summary.md), never the pause.

Every micro-batch of these runs sleeps SLEEP_S (a wrapper around the forward, nothing numeric), so each optimizer
step takes at least 2 × SLEEP_S: that floor, and the relaunch's own wall time as a ceiling, bound the numbers
without assuming how fast the machine is.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time

from conftest import ROOT, child_env, launch_command, read_metrics
from integration.test_checkpoint import STEPS, finetune_args, interrupt

SLEEP_S = 0.25
STEP_FLOOR_S = 2 * SLEEP_S  # the "single" layout: 2 micro-batches per optimizer step
PAUSE_S = 6.0  # downtime between the launches; must not be counted

SLOWED = f"""
import sys, time
from open_sft.model import loss
from open_sft import run
forward = loss.TokenLossModel.forward
def slowed(self, **batch):
    time.sleep({SLEEP_S})
    return forward(self, **batch)
loss.TokenLossModel.forward = slowed
sys.exit(run.main())
"""


def summary_numbers(output_dir) -> tuple[float, float]:
    """(training time s, throughput tokens/s) as report/summary.md prints them."""
    text = (output_dir / "report" / "summary.md").read_text()
    wall = float(re.search(r"\| Training time \(evaluations and checkpoint saves left out\) \| ([\d.]+) s \|",
                           text).group(1))
    throughput = float(re.search(r"\| Throughput \| ([\d.]+) tokens/s \|", text).group(1))
    return wall, throughput


def test_elapsed_time_tokens_per_second_and_eta_continue_across_a_resume(tiny_model_dir, tmp_path) -> None:
    script = tmp_path / "slow_finetune.py"
    script.write_text(SLOWED)
    command = [*launch_command(1, None)[:-1], str(script)]
    base, out = tmp_path / "base", tmp_path / "resumed"
    subprocess.run(command + finetune_args(tiny_model_dir, base, "single"), cwd=ROOT, env=child_env(), check=True,
                   capture_output=True, timeout=600)
    code = interrupt("single", finetune_args(tiny_model_dir, out, "single"), out, 3, signal.SIGTERM,
                     tmp_path / "term.log", command=command)
    assert code == 75, (tmp_path / "term.log").read_text()[-3000:]
    stop = read_metrics(out)[-1]["step"]
    saved = json.loads((out / "checkpoints" / f"step_{stop}" / "trainer_state.json").read_text())
    assert saved["elapsed_s"] >= stop * STEP_FLOOR_S  # the checkpoint holds the training time so far
    time.sleep(PAUSE_S)
    started = time.monotonic()
    relaunch = subprocess.run(command + finetune_args(tiny_model_dir, out, "single"), cwd=ROOT, env=child_env(),
                              capture_output=True, text=True, timeout=600)
    relaunch_wall = time.monotonic() - started
    assert relaunch.returncode == 0, relaunch.stderr[-3000:]

    records = read_metrics(out)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    elapsed = [r["elapsed_s"] for r in records]
    assert elapsed == sorted(elapsed) and len(set(elapsed)) == STEPS  # one clock, not one per launch
    for record in records[stop:]:  # after the resume: the checkpoint's time plus this launch's, no more
        assert saved["elapsed_s"] + (record["step"] - stop) * STEP_FLOOR_S <= record["elapsed_s"], record
        assert record["elapsed_s"] <= saved["elapsed_s"] + relaunch_wall, record  # the pause is not in it
    assert elapsed[-1] >= STEPS * STEP_FLOOR_S

    # the ETA of the first step after the resume: the steps left at the run's own pace (≥ the floor per step)
    first = re.search(rf"step {stop + 1}/{STEPS} \|.*\| eta (\d+)s", relaunch.stdout)
    assert first is not None, relaunch.stdout[-3000:]
    assert int(first.group(1)) >= (STEPS - stop - 1) * STEP_FLOOR_S - 0.5  # printed rounded to the second

    # the report: wall time is the last elapsed_s, throughput within a factor of the uninterrupted run's
    wall, throughput = summary_numbers(out)
    base_wall, base_throughput = summary_numbers(base)
    assert wall == round(elapsed[-1], 1) and wall >= STEPS * STEP_FLOOR_S
    assert throughput == round(records[-1]["total_tokens"] / elapsed[-1], 1)
    assert records[-1]["total_tokens"] == read_metrics(base)[-1]["total_tokens"]
    assert base_throughput / 2 < throughput < base_throughput * 2, (throughput, base_throughput)
    assert base_wall / 2 < wall < base_wall * 2, (wall, base_wall)
