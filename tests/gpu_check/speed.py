"""The GPU check's speed part: scripts/benchmark.py side by side in one invocation, then scripts/profile_step.py on
open_sft's run (where the step's time goes), held to the issue's targets."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Optional

from tests.gpu_check.context import ROOT, Context, importable
from tests.gpu_check.runs import log_path

TARGETS = {"mfu": 0.50, "over_trl_best": 1.5, "estimate_within": 0.15}


def speed(ctx: Context) -> dict:
    """scripts/benchmark.py, side by side in one invocation: on a GPU the 1B shape packed to 4,096 with and
    without Liger, against TRL's SFTTrainer when it is installed; in --smoke the tiny model, open_sft only."""
    out = ctx.speed_json
    cmd = [sys.executable, str(ROOT / "scripts" / "benchmark.py"), "--data", ctx.speed_data, "--packing",
           "--steps", str(ctx.speed_steps), "--json_out", str(out), "--log_dir", str(ctx.work / "logs" / "speed"),
           "--deadline_unix", str(time.time() + ctx.deadline - time.monotonic()), "--run_timeout_s", "240"]
    if ctx.gpu:
        cmd += ["--model_name_or_path", str(ctx.big_model), "--max_seq_length", "4096", "--batch_size", "4",
                "--warmup_steps", "3", "--dtypes", "auto", "--variants", "plain", "liger", "compile"]
        if importable("trl") and ctx.compare_trl:
            cmd += ["--compare", "trl", "--trl_dtypes", "bfloat16", "--trl_variants", "plain", "liger"]
    else:
        cmd += ["--model_name_or_path", str(ctx.small_model), "--max_seq_length", "256", "--batch_size", "2",
                "--warmup_steps", "1", "--dtypes", "float32"]
    log = log_path(ctx, "speed")
    with log.open("w") as handle:
        proc = subprocess.run(cmd, cwd=ROOT, env=ctx.env(), stdout=handle, stderr=subprocess.STDOUT, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark: exit {proc.returncode}: " + "\n".join(log.read_text().splitlines()[-25:]))
    results = json.loads(out.read_text())
    ours = [r for r in results["runs"] if r["tool"] == "open_sft"]
    best = max(ours, key=lambda r: r["tokens_per_second"])
    trl = [r for r in results["runs"] if r["tool"] != "open_sft"]
    reached = {"runs_finished": not results.get("failed") and all(r["tokens_per_second"] > 0 for r in results["runs"])}
    if ctx.gpu:
        reached["mfu_datasheet>=0.50"] = best["mfu"] >= TARGETS["mfu"]
        estimate = best.get("estimate_gib")
        reached["estimate_within_15%"] = bool(estimate and abs(estimate - best["peak_gib"]) <= 0.15 * best["peak_gib"])
        if trl:
            fastest = max(trl, key=lambda r: r["tokens_per_second"])
            reached[">=1.5x_trl_best"] = best["tokens_per_second"] >= TARGETS["over_trl_best"] * fastest[
                "tokens_per_second"]
            reached["peak_memory<=trl"] = best["peak_gib"] <= min(r["peak_gib"] for r in trl)
    if results.get("skipped"):
        reached["every_run_started_within_budget_s"] = False
    late = {"not run": "the check's time budget (--budget_s) ran out first"}
    profiled = profile(ctx) if time.monotonic() < ctx.deadline else late
    figures = {"pass": all(reached.values()), "targets": reached, **results, "profile": profiled}
    if best.get("flags"):  # where a variant is the fastest, where its step's time goes as well
        figures["profile_fastest"] = {"run": best["label"], **(profile(ctx, best["flags"], "profile_fastest")
                                                                if time.monotonic() < ctx.deadline else late)}
    return figures


def profile(ctx: Context, flags: Optional[list[str]] = None, name: str = "profile") -> dict:
    """scripts/profile_step.py on open_sft's run of the speed model (default flags, or `flags`): where step 4's
    time goes."""
    model, width, batch = (ctx.big_model, "4096", "4") if ctx.gpu else (ctx.small_model, "256", "2")
    cmd = [sys.executable, str(ROOT / "scripts" / "profile_step.py"), "--step", "4", "--top", "8", "--",
           "--model_name_or_path", str(model), "--dataset_mixer_list", ctx.speed_data, "1.0",
           "--output_dir", str(ctx.work / "runs" / name), "--max_train_steps", "6",
           "--per_device_train_batch_size", batch, "--max_seq_length", width, "--packing", "--logging_steps", "1",
           "--learning_rate", "1e-4", "--dataset_local_cache_dir", str(ctx.work / "cache"), *(flags or [])]
    proc = subprocess.run(cmd, cwd=ROOT, env=ctx.env(), capture_output=True, text=True, timeout=600)
    log_path(ctx, name).write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip()[-800:]}
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    kinds = {r["kind"]: r["share"] for r in lines if "kind" in r and "share" in r}
    summary = next((r for r in lines if "mfu_ceiling_kernels" in r), {})
    waits = {r["device_waited_before"]: r["seconds"] for r in lines if "device_waited_before" in r}
    return {"shares": kinds, **{k: v for k, v in summary.items() if k != "step"},
            **({"device_waited_before": waits} if waits else {})}
