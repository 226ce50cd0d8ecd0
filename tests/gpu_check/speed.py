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

TARGETS = {"mfu": 0.50, "over_trl_best": 1.5, "estimate_within": 0.15, "bf16_1b": 72_000, "fp8_over_bf16": 1.15,
           "lora_8b": 12_500, "qlora_peak_over_trl": 0.6}
# --fp8's loss against bf16's over the fp8 part's steps (the same batches): each step within 3 %, and the last 50
# steps' mean within 1 % (FP8's rounding moves single steps; the trajectory must stay bf16's)
FP8_TOLERANCE = {"step": 0.03, "last_50_mean": 0.01}
TRL_ATTENTION = ["varlen", "flex_attention", "sdpa"]  # TRL's fastest offline first; sdpa's dense mask for reference


def benchmark(ctx: Context, name: str, flags: list[str]) -> dict:
    """scripts/benchmark.py with the part's `flags`, its figures (also written to the part's JSON as runs end)."""
    out = ctx.work / f"{name}.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "benchmark.py"), "--data", ctx.speed_data, "--packing",
           "--json_out", str(out), "--log_dir", str(ctx.work / "logs" / name), "--run_timeout_s", "300",
           "--deadline_unix", str(time.time() + ctx.deadline - time.monotonic()), *flags]
    log = log_path(ctx, name)
    with log.open("w") as handle:
        proc = subprocess.run(cmd, cwd=ROOT, env=ctx.env(), stdout=handle, stderr=subprocess.STDOUT, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark: exit {proc.returncode}: " + "\n".join(log.read_text().splitlines()[-25:]))
    return json.loads(out.read_text())


def _trl_flags(ctx: Context, variants: list[str]) -> list[str]:
    if not (ctx.gpu and importable("trl") and ctx.compare_trl):
        return []
    return ["--compare", "trl", "--trl_dtypes", "bfloat16", "--trl_variants", *variants,
            "--trl_attention", *TRL_ATTENTION]


def speed(ctx: Context) -> dict:
    """The 1B shape packed to 4,096 (every token trained on both sides): open_sft eager, + Liger, + torch.compile
    against TRL's SFTTrainer at its fastest offline attention, eager and compiled; in --smoke the tiny model,
    open_sft only."""
    flags = ["--steps", str(ctx.speed_steps), "--repeats", str(ctx.speed_repeats), "--train_on", "all"]
    if ctx.gpu:
        flags += ["--model_name_or_path", str(ctx.big_model), "--max_seq_length", "4096", "--batch_size", "4",
                  "--warmup_steps", "3", "--dtypes", "auto", "--variants", "plain", "liger", "compile",
                  *_trl_flags(ctx, ["plain"]), *(["--trl_modes", "eager", "compiled"] if ctx.compare_trl else [])]
    else:
        flags += ["--model_name_or_path", str(ctx.small_model), "--max_seq_length", "256", "--batch_size", "2",
                  "--warmup_steps", "1", "--dtypes", "float32"]
    results = benchmark(ctx, "speed", flags)
    ours = [r for r in results["runs"] if r["tool"] == "open_sft"]
    best = max(ours, key=lambda r: r["tokens_per_second"])
    trl = [r for r in results["runs"] if r["tool"] != "open_sft"]
    reached = {"runs_finished": not results.get("failed") and all(r["tokens_per_second"] > 0 for r in results["runs"])}
    if ctx.gpu:
        reached["mfu_datasheet>=0.50"] = best["mfu"] >= TARGETS["mfu"]
        reached["bf16_tokens_per_s>=72000"] = best["tokens_per_second"] >= TARGETS["bf16_1b"]
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


def fp8_against_bf16(bf16: list[float], fp8: list[float]) -> dict:
    """The loss of --fp8 against bf16's, step by step (the same batches), held to FP8_TOLERANCE."""
    steps = [abs(a - b) / b for a, b in zip(fp8, bf16)]
    tail = min(50, len(steps))
    mean_tail = abs(sum(fp8[-tail:]) - sum(bf16[-tail:])) / sum(bf16[-tail:])
    return {"steps": len(steps), "max_step_rel_diff": max(steps), "last_50_mean_rel_diff": mean_tail,
            "tolerance": FP8_TOLERANCE, "within": len(fp8) == len(bf16) > 0 and max(steps) <= FP8_TOLERANCE["step"]
            and mean_tail <= FP8_TOLERANCE["last_50_mean"]}


def plot_losses(path, series: dict[str, list[float]], title: str) -> None:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4), dpi=100)
    axes = figure.add_subplot()
    for label, losses in series.items():
        axes.plot(range(1, len(losses) + 1), losses, label=label)
    axes.set(title=title, xlabel="optimizer step", ylabel="loss")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, format="png")


def fp8(ctx: Context) -> dict:
    """The 1B shape in bf16 and with --fp8 (torchao tensorwise, its size rule's layers), 120 steps each on the same
    batches: tokens/s (eager and compiled) and the loss, plotted in OUT_DIR/fp8_loss.png."""
    results = benchmark(ctx, "fp8", ["--model_name_or_path", str(ctx.big_model), "--max_seq_length", "4096",
                                     "--batch_size", "4", "--steps", "120", "--warmup_steps", "3", "--dtypes",
                                     "bfloat16", "--variants", "plain", "fp8", "compile", "fp8_compile",
                                     "--train_on", "all"])
    rows = {r["variant"]: r for r in results["runs"]}
    plain, fp8_row = rows.get("plain"), rows.get("fp8")
    if plain is None or fp8_row is None:
        return {"pass": False, **results}
    loss = fp8_against_bf16(plain["losses"], fp8_row["losses"])
    plot_losses(ctx.out / "fp8_loss.png", {"bf16": plain["losses"], "--fp8": fp8_row["losses"]},
                "Llama-3.2-1B shape: bf16 against --fp8 (same batches)")
    ratio = fp8_row["tokens_per_second"] / plain["tokens_per_second"]
    compiled = rows.get("compile"), rows.get("fp8_compile")
    reached = {"fp8_loss_within_tolerance": loss["within"], "fp8>=1.15x_bf16": ratio >= TARGETS["fp8_over_bf16"]}
    figures = {"fp8_over_bf16": ratio, "loss": loss, "plot": "fp8_loss.png"}
    if all(compiled):  # FP8 under torch.compile, held to the compiled bf16 run (on a CPU it gave NaN gradients)
        figures["fp8_over_bf16_compiled"] = compiled[1]["tokens_per_second"] / compiled[0]["tokens_per_second"]
        figures["loss_compiled"] = fp8_against_bf16(compiled[0]["losses"], compiled[1]["losses"])
        reached["fp8_compiled_loss_within_tolerance"] = figures["loss_compiled"]["within"]
    return {"pass": all(reached.values()), "targets": reached, **figures, **results}


def speed_8b(ctx: Context) -> dict:
    """Llama-3.1-8B's shape, LoRA and QLoRA r 16 on every projection, rows packed to 4,096 (one row a step), against
    TRL + PEFT's LoRA and QLoRA."""
    results = benchmark(ctx, "speed_8b", [
        "--model_name_or_path", str(ctx.huge_model), "--max_seq_length", "4096", "--batch_size", "1",
        "--steps", str(ctx.speed_steps), "--warmup_steps", "3", "--repeats", str(ctx.speed_repeats),
        "--dtypes", "bfloat16", "--variants", "lora", "qlora", "--lora_rank", "16", "--train_on", "all",
        *_trl_flags(ctx, ["lora", "qlora"])])
    ours = {r["variant"]: r for r in results["runs"] if r["tool"] == "open_sft"}
    trl = [r for r in results["runs"] if r["tool"] != "open_sft"]
    reached = {"runs_finished": not results.get("failed") and bool(ours)}
    if "lora" in ours:
        reached["lora_tokens_per_s>=12500"] = ours["lora"]["tokens_per_second"] >= TARGETS["lora_8b"]
    for kind, row in ours.items():
        if row.get("over_trl_best") is not None:
            reached[f"{kind}>=1.5x_trl_peft"] = row["over_trl_best"] >= TARGETS["over_trl_best"]
        # the memory estimate on a shape its GPU constants were not fitted on (they were, on the 1B shape's full
        # training at 4 x 4,096): another width and depth, LoRA/QLoRA, one row a step
        estimate = row.get("estimate_gib")
        reached[f"{kind}_estimate_within_15%"] = bool(
            estimate and abs(estimate - row["peak_gib"]) <= TARGETS["estimate_within"] * row["peak_gib"])
    peft_qlora = [r["peak_gib"] for r in trl if r.get("variant") == "qlora"]
    if "qlora" in ours and peft_qlora:
        reached["qlora_peak<=0.6x_trl_peft"] = ours["qlora"]["peak_gib"] <= TARGETS["qlora_peak_over_trl"] * min(
            peft_qlora)
    return {"pass": all(reached.values()), "targets": reached,
            "target_note": "12,500 tokens/s is NVIDIA NeMo AutoModel's H100 figure; the H200 has the same bf16 "
                           "datasheet peak, so the same figure is asked of it", **results}


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
