"""Trackers and the end-of-run report.

One short single-process run with `--with_tracking --report_to all` (W&B offline) is read back with
the real readers: TensorBoard's EventAccumulator and W&B's own record protobufs. Their loss and
learning-rate values must be those of metrics.jsonl, no secret may reach the disk, and report/
must hold valid PNGs and a summary whose numbers are recomputed here from metrics.jsonl.

(Its fast in-process tests are in tests/unit/monitor/test_tracking_report.py.)
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, SAMPLE, assert_png, child_env, launch_command, read_metrics


STEPS = 6


SECRET = "hf_TESTSECRETdoNotLog0123456789"


@pytest.fixture(scope="module")
def tracked_run(tiny_model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tracked")
    args = ["--model_name_or_path", str(tiny_model_dir), "--dataset_mixer_list", str(SAMPLE), "1.0",
            "--output_dir", str(out), "--max_train_steps", str(STEPS), "--per_device_train_batch_size", "4",
            "--learning_rate", "3e-3", "--warmup_ratio", "0.2", "--logging_steps", "1", "--seed", "1",
            "--torch_dtype", "float32", "--max_seq_length", "256", "--with_tracking", "--report_to", "all"]
    env = child_env(WANDB_MODE="offline", WANDB_SILENT="true", HF_TOKEN=SECRET, WANDB_API_KEY=SECRET)
    env.pop("WANDB_DIR", None)
    result = subprocess.run(launch_command(1, None) + args, cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (out.parent / f"{out.name}.stdout").write_text(result.stdout)
    return out


def wandb_history(run_file: Path) -> dict[int, dict[str, float]]:
    """step -> logged values, decoded from a .wandb file (LevelDB-log framing of W&B Record protobufs)."""
    from wandb.proto import wandb_internal_pb2

    raw = run_file.read_bytes()
    history, pos, pending = {}, 7, b""  # 7-byte W&B file header
    while pos + 7 <= len(raw):
        room = 32768 - pos % 32768
        if room < 7:  # block trailer
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        pending += raw[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST chunk: one record complete
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
                history[record.history.step.num] = items
    return history


def test_tensorboard_events_equal_metrics(tracked_run) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    metrics = read_metrics(tracked_run)
    events = EventAccumulator(str(tracked_run / "tensorboard"))
    events.Reload()
    for field in ("loss", "learning_rate", "grad_norm", "tokens_per_second", "mfu"):
        scalars = events.Scalars(f"train/{field}")
        assert [s.step for s in scalars] == [m["step"] for m in metrics] == list(range(1, STEPS + 1))
        # event files store float32
        assert [s.value for s in scalars] == pytest.approx([m[field] for m in metrics], rel=1e-6), field


def test_wandb_offline_history_equals_metrics(tracked_run) -> None:
    runs = list((tracked_run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, runs
    history = wandb_history(runs[0])
    metrics = read_metrics(tracked_run)
    assert sorted(history) == [m["step"] for m in metrics]
    for record in metrics:
        assert history[record["step"]]["train/loss"] == record["loss"]
        assert history[record["step"]]["train/learning_rate"] == record["learning_rate"]


def test_no_secret_reaches_the_disk(tracked_run) -> None:
    files = [p for p in tracked_run.rglob("*") if p.is_file()]
    assert len(files) > 10
    leaked = [str(p) for p in files if SECRET.encode() in p.read_bytes()]
    assert not leaked, leaked


def expected_summary(metrics: list[dict]) -> dict:
    """The summary's definitions, recomputed independently from metrics.jsonl."""
    last = metrics[-1]
    windows = [m["elapsed_s"] - p for m, p in zip(metrics, [0.0] + [m["elapsed_s"] for m in metrics[:-1]])]
    return {"steps": last["step"], "elapsed_s": last["elapsed_s"], "train_tokens": last["train_tokens"],
            "total_tokens": last["total_tokens"], "tokens_per_second": last["total_tokens"] / last["elapsed_s"],
            "mfu": sum(m["mfu"] * w for m, w in zip(metrics, windows)) / sum(windows),
            "mfu_palm": sum(m["mfu_palm"] * w for m, w in zip(metrics, windows)) / sum(windows),
            "peak_memory_gib": max(m["peak_memory_gib"] for m in metrics), "final_loss": last["loss"],
            "final_eval_loss": None}


def test_report_written_at_end_of_run(tracked_run) -> None:
    report = tracked_run / "report"
    assert_png(report / "loss.png")
    assert_png(report / "learning_rate.png")
    metrics = read_metrics(tracked_run)
    want = expected_summary(metrics)
    got = json.loads((report / "summary.json").read_text())
    assert got.pop("final_eval_loss") is want.pop("final_eval_loss") is None
    assert got == pytest.approx(want, rel=1e-12)
    assert got["steps"] == STEPS and got["final_loss"] == metrics[-1]["loss"]
    markdown = (report / "summary.md").read_text()
    for text in (f"{want['tokens_per_second']:.1f} tokens/s", f"{want['final_loss']:.4f}",
                 f"{100 * want['mfu']:.2f} %", f"{100 * want['mfu_palm']:.2f} %", f"{want['peak_memory_gib']:.3f} GiB", f"{want['train_tokens']:,}",
                 "](loss.png)", "](learning_rate.png)"):
        assert text in markdown, text


def test_report_cli_regenerates(tracked_run, tmp_path) -> None:
    copy = tmp_path / "run"
    copy.mkdir()
    (copy / "metrics.jsonl").write_bytes((tracked_run / "metrics.jsonl").read_bytes())
    result = subprocess.run([sys.executable, "-m", "open_sft", "report", str(copy)], cwd=ROOT, env=child_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads((copy / "report" / "summary.json").read_text()) == \
        json.loads((tracked_run / "report" / "summary.json").read_text())
    assert_png(copy / "report" / "loss.png")
    # the path before `open_sft report` still works, errors included
    missing = subprocess.run([sys.executable, "-m", "open_sft.report", str(tmp_path / "nowhere")], cwd=ROOT,
                             env=child_env(), capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "metrics.jsonl not found" in missing.stderr


def _run_on_a_terminal(args: list[str]) -> str:
    """Run with stdout and stderr on a pseudo-terminal (as in an interactive shell); return what it printed."""
    import os
    import pty

    controller, terminal = pty.openpty()
    proc = subprocess.Popen(launch_command(1, None) + args, cwd=ROOT, env=child_env(), stdout=terminal,
                            stderr=terminal, stdin=subprocess.DEVNULL)
    os.close(terminal)
    chunks = []
    while True:
        try:
            chunk = os.read(controller, 65536)
        except OSError:  # the terminal closed: the run ended
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(controller)
    assert proc.wait(timeout=300) == 0, b"".join(chunks)[-3000:]
    return b"".join(chunks).decode("utf-8", "replace")


def test_progress_bar_on_a_terminal_plain_lines_otherwise(tiny_model_dir, tracked_run, tmp_path) -> None:
    args = ["--model_name_or_path", str(tiny_model_dir), "--dataset_mixer_list", str(SAMPLE), "1.0",
            "--output_dir", str(tmp_path / "tty"), "--max_train_steps", "5", "--per_device_train_batch_size", "4",
            "--logging_steps", "1", "--torch_dtype", "float32", "--max_seq_length", "256"]
    shown = _run_on_a_terminal(args)
    assert "training: 100%" in shown and "5/5 [" in shown, shown[-2000:]
    assert "step/s" in shown or "s/step" in shown
    assert "\r" in shown  # redrawn in place
    assert shown.count("step 3/5 | loss") == 1  # log lines still shown, once, above the bar
    plain = (tracked_run.parent / f"{tracked_run.name}.stdout").read_text()
    assert f"step {STEPS}/{STEPS} | loss" in plain
    assert "training:" not in plain and "\r" not in plain  # no bar in a file or pipe


def test_resumed_launch_continues_the_same_tracker_runs(tiny_model_dir, tmp_path) -> None:
    """kill -9 after step 5 (checkpoints every 2 steps), relaunch: W&B continues the run it started (one run
    id, offline), TensorBoard's reader sees each step once, with the values the relaunch logged after the
    checkpoint it resumed from (the killed launch's step 5 is purged), and a launch that starts over
    (--resume_from_checkpoint none) starts a new W&B run."""
    import os
    import signal
    import time

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "out"
    args = ["--model_name_or_path", str(tiny_model_dir), "--dataset_mixer_list", str(SAMPLE), "1.0",
            "--output_dir", str(out), "--max_train_steps", "8", "--per_device_train_batch_size", "4",
            "--learning_rate", "3e-3", "--logging_steps", "1", "--seed", "1", "--torch_dtype", "float32",
            "--max_seq_length", "256", "--with_tracking", "--report_to", "all", "--checkpointing_steps", "2"]
    env = child_env(WANDB_MODE="offline", WANDB_SILENT="true")
    env.pop("WANDB_DIR", None)
    proc = subprocess.Popen(launch_command(1, None) + args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        if (out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= 5:
            os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.05)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    first_id = (out / "wandb_run_id").read_text().strip()
    result = subprocess.run(launch_command(1, None) + args, cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (out / "wandb_run_id").read_text().strip() == first_id
    assert {p.name.rsplit("-", 1)[-1] for p in (out / "wandb").glob("offline-run-*")} == {first_id}
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    losses = events.Scalars("train/loss")
    metrics = read_metrics(out)
    assert [s.step for s in losses] == list(range(1, 9))
    assert [s.value for s in losses] == pytest.approx([m["loss"] for m in metrics], rel=1e-6)
    again = subprocess.run(launch_command(1, None) + args + ["--resume_from_checkpoint", "none"], cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (out / "wandb_run_id").read_text().strip() != first_id
