"""Trackers and the end-of-run report.

One short single-process run with `--with_tracking --report_to all` (W&B offline) is read back with
the real readers: TensorBoard's EventAccumulator and W&B's own record protobufs. Their loss and
learning-rate values must be those of metrics.jsonl, no secret may reach the disk, and report/
must hold valid PNGs and a summary whose numbers are recomputed here from metrics.jsonl.

The tests of this subject that launch real processes are in tests/integration/test_tracking_report.py.
"""

from __future__ import annotations

import math
import sys

import pytest

from conftest import assert_png
from open_sft.errors import UserError
from open_sft.monitor.report import summarize, write_report
from open_sft.monitor.tracking import build_trackers, scalars_of, trackers_for
from open_sft.redaction import REDACTED, redact_secrets


SECRET = "hf_TESTSECRETdoNotLog0123456789"


def test_report_with_eval_lines(tmp_path) -> None:
    records = [{"step": s, "loss": 3.0 - 0.1 * s, "learning_rate": 1e-3 * s, "train_tokens": 100 * s,
                "total_tokens": 150 * s, "mfu": 0.1 * s, "mfu_palm": 0.15 * s, "peak_memory_gib": 1.0 + s / 10,
                "elapsed_s": 2.0 * s}
               for s in range(1, 5)]
    records.insert(2, {"step": 2, "eval_loss": 2.5})
    records.append({"step": 4, "eval_loss": 2.25})
    summary = write_report(records, tmp_path / "report")
    assert summary.final_eval_loss == 2.25 and summary.final_loss == pytest.approx(2.6)
    assert summary.mfu == pytest.approx(0.25)  # equal 2 s windows: plain mean of 0.1..0.4
    assert summary.mfu_palm == pytest.approx(0.375)
    assert summary.tokens_per_second == pytest.approx(600 / 8)
    assert summary.peak_memory_gib == pytest.approx(1.4)
    markdown = (tmp_path / "report" / "summary.md").read_text()
    assert "| Final eval loss | 2.2500 |" in markdown
    assert "| Training time (evaluations and checkpoint saves left out) | 8.0 s |" in markdown  # not "Wall time"
    assert "| MFU, PaLM's count (torchtitan, OLMo-core, nanochat) | 37.50 % |" in markdown
    older = summarize([{k: v for k, v in r.items() if k != "mfu_palm"} for r in records])  # metrics before it
    assert older.mfu_palm is None and older.mfu == pytest.approx(0.25)
    assert_png(tmp_path / "report" / "loss.png")
    with pytest.raises(ValueError, match="no training records"):
        summarize([{"step": 1, "eval_loss": 1.0}])


def test_per_source_plot_only_for_two_or_more_sources(tmp_path) -> None:
    """One source with train and eval losses per source is loss.png's two lines, not a per-source plot; two
    sources get loss_by_source.png and the summary shows it."""
    base = {"learning_rate": 1e-3, "train_tokens": 100, "total_tokens": 150, "mfu": 0.1, "peak_memory_gib": 1.0,
            "elapsed_s": 2.0}
    one = [{"step": 1, "loss": 2.0, "loss/a": 2.0, **base}, {"step": 1, "eval_loss": 2.1, "eval_loss/a": 2.1}]
    two = [{"step": 1, "loss": 2.0, "loss/a": 2.0, "loss/b": 1.5, **base}]
    for records, drawn in ((one, False), (two, True)):
        report = tmp_path / str(drawn)
        write_report(records, report)
        assert (report / "loss_by_source.png").exists() == drawn
        assert ("loss_by_source.png" in (report / "summary.md").read_text()) == drawn


def drawn_points(figure) -> set[tuple[float, float]]:
    """The points a chart shows: a line's with a marker all of its finite ones, a bare line's those joined to a
    finite neighbour (a segment needs two ends)."""
    shown = set()
    for line in figure.axes[0].get_lines():
        xs, ys = line.get_xdata(), line.get_ydata()
        finite = [math.isfinite(y) for y in ys]
        marked = line.get_marker() not in ("None", None, "")
        shown |= {(float(x), float(y)) for i, (x, y) in enumerate(zip(xs, ys)) if finite[i] and (
            marked or (i > 0 and finite[i - 1]) or (i + 1 < len(ys) and finite[i + 1]))}
    return shown


def test_every_logged_loss_is_drawn(tmp_path) -> None:
    """A run that logged one step, and a window between two whose every step was skipped (NaN loss), show their
    loss: the train curve is a bare line, which drew no point of its own (loss.png of a one-step run was empty)."""
    from open_sft.monitor.report import figure_of, lone_points

    nan = float("nan")
    assert lone_points([1, 2, 3, 4, 5, 6], [2.0, nan, 1.5, nan, 1.25, 1.0]) == [(1, 2.0), (3, 1.5)]
    assert lone_points([1], [nan]) == [] and lone_points([1, 2], [2.0, 1.0]) == []
    one = figure_of("Loss", "loss", [("train", [1], [2.0], "-"), ("eval", [1], [2.1], "o-")])
    assert drawn_points(one) == {(1.0, 2.0), (1.0, 2.1)}
    gaps = figure_of("Loss", "loss", [("train", [1, 2, 3, 4], [2.0, nan, 1.5, 1.25], "-")])
    assert drawn_points(gaps) == {(1.0, 2.0), (3.0, 1.5), (4.0, 1.25)}
    base = {"learning_rate": 1e-3, "train_tokens": 100, "total_tokens": 150, "mfu": 0.1, "peak_memory_gib": 1.0,
            "elapsed_s": 2.0}
    summary = write_report([{"step": 1, "loss": 2.0, **base}], tmp_path / "report")
    assert summary.steps == 1 and summary.final_loss == 2.0
    assert_png(tmp_path / "report" / "loss.png")


def test_a_fresh_start_moves_the_earlier_runs_events_aside(tmp_path) -> None:
    """Starting over (resume step 0) in a directory with events moves them to tensorboard.previous-N; a resumed
    run (step > 0) writes beside its own earlier events."""
    from open_sft.monitor.tracking import TensorBoardTracker

    log_dir = tmp_path / "tensorboard"
    for resume_step in (0, 0, 3, 0):
        tracker = TensorBoardTracker(log_dir, resume_step)
        tracker.log({"train/loss": 1.0}, step=resume_step + 1)
        tracker.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tensorboard", "tensorboard.previous-1",
                                                          "tensorboard.previous-2"]
    assert len(list((tmp_path / "tensorboard.previous-2").iterdir())) == 2  # the run and its resumed launch
    assert len(list(log_dir.iterdir())) == 1


def test_a_fresh_start_in_a_symlinked_events_dir_keeps_the_link_and_its_target(tmp_path) -> None:
    """A tensorboard/ linked to another disk: the earlier events move into previous-N inside the target (the link
    and the target stay where the user put them), and the new run's events follow the link."""
    from open_sft.monitor.tracking import TensorBoardTracker

    target = tmp_path / "disk" / "events"
    target.mkdir(parents=True)
    (tmp_path / "out").mkdir()
    log_dir = tmp_path / "out" / "tensorboard"
    log_dir.symlink_to(target)
    for _ in range(2):
        tracker = TensorBoardTracker(log_dir, 0)
        tracker.log({"train/loss": 1.0}, step=1)
        tracker.close()
    assert log_dir.is_symlink() and [p.name for p in tmp_path.iterdir() if p.name != "out"] == ["disk"]
    assert sorted(p.name for p in target.iterdir() if not p.name.startswith("events.out")) == ["previous-1"]
    assert len(list(target.glob("events.out*"))) == 1 and len(list((target / "previous-1").iterdir())) == 1
    assert [p.name for p in (tmp_path / "disk").iterdir()] == ["events"]
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["tensorboard"]


def test_tracker_names_and_scalars() -> None:
    assert trackers_for("all") == ("tensorboard", "wandb")
    assert trackers_for("none") == ()
    assert trackers_for("wandb") == ("wandb",)
    assert trackers_for(["wandb", "tensorboard", "wandb"]) == ("wandb", "tensorboard")  # open-instruct's list
    assert trackers_for(["tensorboard", "all"]) == ("tensorboard", "wandb")
    with pytest.raises(UserError, match="--report_to 'mlflow': expected one or more of"):
        trackers_for(["tensorboard", "mlflow"])
    assert scalars_of({"step": 3, "loss": 1.5, "eval_loss": 2.0, "note": "x", "flag": True}) == \
        {"train/loss": 1.5, "eval/loss": 2.0}


def test_secrets_redacted_from_tracker_config() -> None:
    config = {"train": {"hub_token": SECRET, "output_dir": "o", "add_special_tokens": True},
              "model": {"tokenizer_name_or_path": "t", "api_key": SECRET, "hub_password": None}}
    clean = redact_secrets(config)
    assert clean["train"] == {"hub_token": REDACTED, "output_dir": "o", "add_special_tokens": True}
    assert clean["model"] == {"tokenizer_name_or_path": "t", "api_key": REDACTED, "hub_password": None}
    assert config["train"]["hub_token"] == SECRET  # the input is not modified


def test_wandb_missing_names_the_extra(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    with pytest.raises(UserError, match=r"pip install -e '\.\[wandb\]' in the open_sft checkout"):
        build_trackers("wandb", tmp_path)


def test_a_wandb_start_that_fails_leaves_nothing_in_the_output_dir(tmp_path, monkeypatch) -> None:
    """W&B without network (a key set) failed after its timeout with a clear error, but left OUTPUT_DIR/wandb/run-*/
    (and so the output directory and its lock) behind; a wandb/ that was there before is kept."""
    import wandb

    def init_that_fails(**kwargs):
        (tmp_path / "out" / "wandb" / "run-1" / "logs").mkdir(parents=True)  # what wandb writes before giving up
        raise wandb.errors.CommError("Timed out while retrying: dial tcp: lookup api.wandb.ai: no such host")

    monkeypatch.setattr(wandb, "init", init_that_fails)
    monkeypatch.delenv("WANDB_DIR", raising=False)
    (tmp_path / "out").mkdir()
    with pytest.raises(UserError, match=r"^--report_to wandb: W&B did not start \(CommError: Timed out while "):
        build_trackers("wandb", tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []
    with pytest.raises(UserError):  # the second start finds the first one's directory: not ours to remove
        (tmp_path / "out" / "wandb").mkdir()
        build_trackers("wandb", tmp_path / "out")
    assert (tmp_path / "out" / "wandb" / "run-1" / "logs").is_dir()


def test_a_warm_start_begins_its_trackers_anew(tiny_model_dir, tmp_path) -> None:
    """A run warm-started in an output dir with a run of its own, from a checkpoint outside its checkpoints/ (another
    run's; here a copy of its own step 2): its checkpoints go to checkpoints.previous-1 and metrics.jsonl begins
    anew, and so do the trackers: the earlier events go to tensorboard.previous-1. TensorBoard drew steps 1-2 of
    the earlier run before steps 3-4 of this one, which metrics.jsonl did not have."""
    import json
    import shutil

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from conftest import SAMPLE
    from open_sft.run import main

    out = tmp_path / "out"
    argv = ["--model_name_or_path", str(tiny_model_dir), "--dataset_mixer_list", str(SAMPLE), "16",
            "--checkpointing_steps", "2", "--max_train_steps", "4", "--per_device_train_batch_size", "4",
            "--logging_steps", "1", "--max_seq_length", "128", "--torch_dtype", "float32", "--with_tracking",
            "--report_to", "tensorboard", "--output_dir", str(out), "--dataset_local_cache_dir", str(tmp_path / "c")]
    assert main(argv) == 0
    shutil.copytree(out / "checkpoints" / "step_2", tmp_path / "elsewhere" / "step_2")
    (out / "RUN_COMPLETE").unlink()  # a run there in progress
    assert main([*argv, "--resume_from_checkpoint", str(tmp_path / "elsewhere" / "step_2")]) == 0
    lines = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]

    def logged(events) -> list[int]:
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        return [event.step for event in accumulator.Scalars("train/loss")]

    assert lines == logged(out / "tensorboard") == [3, 4]
    assert logged(out / "tensorboard.previous-1") == [1, 2, 3, 4]
