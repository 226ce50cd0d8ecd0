"""A finished run stays finished: relaunching a 2-rank run whose export is complete says `already complete` once,
exits 0 on every rank without training and touches nothing (every file's bytes and times compared); one with
other settings is refused naming them; a resume with changed settings is refused (every line of the refusal
last in the launcher's summary) unless --allow_changed_settings, whose step ranges the record and the model card
keep, and after which the original command is answered `already complete`;
--overwrite_output_dir trains it again from step 0 (the same losses, the earlier checkpoints moved aside);
--dry_run and --cache_dataset_only run as ever on a finished directory.

The run's mixture holds multi-turn reasoning conversations under a template that drops earlier reasoning (each
makes two examples): on 2 ranks they are examples like any other, counted in the data report, dealt to the
ranks disjointly."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from conftest import SAMPLE, TESTS, read_metrics, run_finetune

EXACT = ("step", "epoch", "loss", "learning_rate", "grad_norm", "train_tokens", "total_tokens")
TEMPLATE = TESTS / "data" / "chat_templates" / "tiny_drops_earlier_reasoning.jinja"
CONVERSATIONS = 16


def reasoning_rows(model_dir: Path) -> Path:
    """Two-question conversations with reasoning (written once beside the model)."""
    path = model_dir.parent / "reasoning_conversations.jsonl"
    if not path.is_file():
        rows = [{"messages": [
            {"role": "user", "content": f"What is {n} plus {n}?"},
            {"role": "assistant", "content": str(2 * n), "reasoning_content": f"{n} and {n} make {2 * n}."},
            {"role": "user", "content": "And times two?"},
            {"role": "assistant", "content": str(4 * n), "reasoning_content": f"Twice {2 * n} is {4 * n}."}]}
            for n in range(CONVERSATIONS)]
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def args_for(model_dir: Path, output_dir: Path, *extra: str) -> list[str]:
    return ["--model_name_or_path", str(model_dir), "--dataset_mixer_list", str(SAMPLE), "48",
            str(reasoning_rows(model_dir)), "1.0", "--chat_template_path", str(TEMPLATE),
            "--output_dir", str(output_dir), "--max_train_steps", "4", "--checkpointing_steps", "2",
            "--per_device_train_batch_size", "2", "--learning_rate", "3e-3", "--logging_steps", "1", "--seed", "1",
            "--torch_dtype", "float32", "--max_seq_length", "128", *extra]


def snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under root (the directories too) with its bytes and modification time."""
    found = {".": (b"", root.stat().st_mtime_ns)}
    for path in sorted(root.rglob("*")):
        found[str(path.relative_to(root))] = (path.read_bytes() if path.is_file() else b"", path.stat().st_mtime_ns)
    return found


@pytest.fixture(scope="module")
def finished(tiny_model_dir, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("finished")
    first = run_finetune(args_for(tiny_model_dir, out), processes=2)
    before = snapshot(out)
    again = run_finetune(args_for(tiny_model_dir, out), processes=2, check=False)
    after = snapshot(out)
    other = run_finetune(args_for(tiny_model_dir, out, "--warmup_ratio", "0.5"), processes=1, check=False)
    return {"out": out, "first": first, "before": before, "again": again, "after": after,
            "metrics": read_metrics(out), "other": other, "after_other": snapshot(out)}


def test_the_run_writes_its_completion_record_last(finished) -> None:
    out = finished["out"]
    record = json.loads((out / "RUN_COMPLETE").read_text())
    assert record["step"] == 4 and record["elapsed_s"] >= finished["metrics"][-1]["elapsed_s"]
    assert {"config.json", "model.safetensors", "metrics.jsonl", "README.md", "report/summary.md"} <= set(record["files"])
    assert not any(name.startswith(("checkpoints", ".open_sft.lock")) for name in record["files"])
    newest = max(p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file() and p.name != ".open_sft.lock")
    assert (out / "RUN_COMPLETE").stat().st_mtime_ns == newest  # written after everything else


def test_a_relaunch_of_a_finished_run_exits_0_touching_nothing(finished) -> None:
    again, out = finished["again"], finished["out"]
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count(f"already complete: {out} (trained to step 4, finished at ") == 1  # the main process
    assert "--overwrite_output_dir" in again.stdout
    for quiet in ("step 1/4", "resuming from", "loading", "world size", "Traceback"):
        assert quiet not in again.stdout + again.stderr, quiet
    assert finished["after"] == finished["before"]  # every byte and time, metrics.jsonl and the export included


def test_a_relaunch_with_other_settings_is_refused_touching_nothing(finished) -> None:
    other = finished["other"]
    assert other.returncode == 2, other.stderr[-3000:]
    assert "holds a completed run launched with other settings" in other.stderr
    assert "--warmup_ratio: 0.03 then, 0.5 now" in other.stderr and "Traceback" not in other.stderr
    assert finished["after_other"] == finished["before"]


def test_a_resume_with_changed_settings_is_refused_unless_allowed_and_then_recorded(finished, tiny_model_dir,
                                                                                    tmp_path) -> None:
    """Resumed at step 2 with another --learning_rate, a run warned one line and trained on; relaunched, its
    original command was then refused as a completed run 'launched with other settings', though steps 1-2 used
    it. A copy of the finished run, resumed from its step-2 checkpoint by name."""
    out = tmp_path / "copy"
    shutil.copytree(finished["out"], out)
    step_2 = ["--resume_from_checkpoint", str(out / "checkpoints" / "step_2")]
    refused = run_finetune(args_for(tiny_model_dir, out, "--learning_rate", "1e-3", *step_2), processes=2,
                           check=False)
    assert refused.returncode != 0 and "Traceback" not in refused.stderr.split("ChildFailedError")[-1]
    summary = refused.stderr[refused.stderr.rindex("Root Cause (first observed failure):"):]
    assert "exitcode  : 2" in summary and "with settings other than it was trained with:" in summary
    assert "- --learning_rate: 0.003 in the checkpoint, 0.001 now" in summary  # every line, in the last words
    assert "--allow_changed_settings" in summary
    allowed = run_finetune(args_for(tiny_model_dir, out, "--learning_rate", "1e-3", "--allow_changed_settings",
                                    *step_2), processes=2)
    assert "resuming at step 2 with changed settings (--allow_changed_settings)" in allowed.stdout + allowed.stderr
    # the rewind's abandoned step_4 moved aside: pruning and a later auto resume see only the new timeline
    assert f"the checkpoints of another timeline (step_4) were moved to {out / 'checkpoints.previous-1'}" in (
        allowed.stdout + allowed.stderr)
    ranges = [{"steps": [1, 2], "changed": {"learning_rate": 0.003}},
              {"steps": [3, 4], "changed": {"learning_rate": 0.001}}]
    assert json.loads((out / "RUN_COMPLETE").read_text())["settings_by_steps"] == ranges
    assert json.loads((out / "run.json").read_text())["settings_by_steps"] == ranges
    assert "| 1-2 | 0.003 |\n| 3-4 | 0.001 |" in (out / "README.md").read_text()
    original = run_finetune(args_for(tiny_model_dir, out))
    assert f"already complete: {out} (trained to step 4" in original.stdout


def test_overwrite_output_dir_trains_again_from_step_0(finished, tiny_model_dir) -> None:
    out = finished["out"]
    result = run_finetune(args_for(tiny_model_dir, out, "--overwrite_output_dir"), processes=2)
    log = result.stdout + result.stderr
    assert "resuming from" not in log and "already complete" not in log
    assert f"the earlier checkpoints were moved to {out / 'checkpoints.previous-1'}" in log
    assert sorted(p.name for p in (out / "checkpoints.previous-1").iterdir()) == ["step_2", "step_4"]
    again = read_metrics(out)
    assert [r["step"] for r in again] == [1, 2, 3, 4]
    assert [{k: r[k] for k in EXACT} for r in again] == [{k: r[k] for k in EXACT} for r in finished["metrics"]]
    assert json.loads((out / "RUN_COMPLETE").read_text())["step"] == 4


def test_dry_run_and_cache_only_are_unaffected_by_a_finished_run(finished, tiny_model_dir) -> None:
    out = finished["out"]
    before = snapshot(out)
    dry = run_finetune(args_for(tiny_model_dir, out, "--dry_run"))
    assert "time estimate:" in dry.stdout and "already complete" not in dry.stdout
    cache = run_finetune(args_for(tiny_model_dir, out, "--cache_dataset_only"))
    assert "already complete" not in cache.stdout
    assert os.path.isdir(cache.stdout.strip().splitlines()[-1])  # the cache path, on the last line
    assert snapshot(out) == before


def test_split_conversations_are_examples_like_any_other_on_2_ranks(finished) -> None:
    out = finished["out"]
    sample, reasoning = json.loads((out / "data_report.json").read_text())["sources"]
    assert (reasoning["rows_kept"], reasoning["rows_split"], reasoning["examples"]) == (16, 16, 32)
    assert reasoning["split_extra_tokens"] > 0 and sample["rows_split"] == 0 and sample["examples"] == 48
    ranks = [json.loads((out / f"data_order.rank{r}.json").read_text())["example_indices"] for r in (0, 1)]
    assert not set(ranks[0]) & set(ranks[1]) and len(ranks[0]) == len(ranks[1]) == 4 * 2
    assert all(0 <= i < 48 + 32 for rank in ranks for i in rank)
    assert any(i >= 48 for rank in ranks for i in rank)  # split examples were trained beside the others
