#!/usr/bin/env python
"""One command that checks open_sft on one GPU and writes what it found:

    python scripts/gpu_check.py OUT_DIR --data alpaca.json --tokenizer tokenizer.json   # on a GPU node
    python scripts/gpu_check.py OUT_DIR --smoke                                         # CPU: the suite's run

Writes OUT_DIR/gpu_report.json and OUT_DIR/gpu_report.md (one row per part: verdict and figures), and prints
the GPU, driver, library versions and commit first. Each part runs as a user's command would (finetune.py,
`accelerate launch`, scripts/benchmark.py, scripts/gpu_probes.py) in a process of its own with a time limit,
so one failing or hanging part never hides the others; the report is rewritten after every part.

Parts (--parts picks some):
- correctness: batch_layouts (bs 8 vs bs 2 x GA 4, bf16 and fp32), packed (packed = padded with the
  attention this device installs), fused_ce (chunked LM-head loss = cross-entropy), attention (the
  candidates for packed rows, timed and checked for cross-example attention), kill_resume (kill -9 and
  relaunch = the uninterrupted run, held to the run-to-run spread of two uninterrupted runs);
- features: dtype_auto, liger, qlora, zero2, zero3, fsdp2, gradient_checkpointing, auto_micro_batch_size,
  torch_compile (each: finite and falling loss, the export reloads in a fresh process; torch_compile's losses
  also against the same run uncompiled);
- speed: scripts/benchmark.py on a Llama-3.2-1B-shaped model (random init, the tokenizer given), rows packed
  to 4,096: open_sft, + Liger, TRL's SFTTrainer (packing + padding-free) with and without Liger, open_sft +
  torch.compile; then scripts/profile_step.py on open_sft's default run.

On a GPU the runs of one part (batch_layouts' four, kill_resume's three chains, torch_compile's two) run at the
same time, 6 parts at once, then the parts that time kernels (fused_ce, attention, speed) one at a time: an H200
takes ~4 minutes for the correctness and feature parts and ~5 for speed.

--smoke runs the parts a CPU can run on the project's tiny embedded model and data (GPU-only parts are
reported as skipped): the test suite runs it, so the script's logic and report stay checked without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gpu_check_runs as runs  # noqa: E402  (scripts/gpu_check_runs.py)
import gpu_check_speed  # noqa: E402  (scripts/gpu_check_speed.py)
from gpu_check_report import markdown, pack_logs  # noqa: E402  (scripts/gpu_check_report.py)
from gpu_check_runs import Context, falling, finetune, reload_export  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CORRECTNESS = ["batch_layouts", "packed", "fused_ce", "attention", "kill_resume"]
FEATURES = ["dtype_auto", "liger", "qlora", "zero2", "zero3", "fsdp2", "gradient_checkpointing",
            "auto_micro_batch_size", "torch_compile"]
SPEED = ["speed"]
# parts whose figures include kernel timings run one at a time after the others, the GPU otherwise idle: run
# beside 5 other parts on an H200, the attention part timed torch's varlen flash kernel at 9.2 ms against 2.8 ms
# alone, and named the block-mask sdpa fastest
ALONE = ["fused_ce", "attention", *SPEED]
GPU_ONLY = {"liger": "Liger's kernels are Triton (CUDA)", "qlora": "run on a GPU only here (bitsandbytes 4-bit)"}


# ------------------------------------------------------------------------------------------------------------
# correctness
# ------------------------------------------------------------------------------------------------------------
def part_batch_layouts(ctx: Context) -> dict:
    """Per-step losses of one global batch of 8 as bs 8 x GA 1 and as bs 2 x GA 4."""
    figures, ok = {}, True
    layouts = ctx.dtypes_with_tolerance()
    shapes = {"bs8": [], "bs2ga4": ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "4"]}
    jobs = [(dtype, shape) for dtype, _ in layouts for shape in shapes]
    done = dict(zip(jobs, runs.together(ctx, *[
        lambda d=d, s=s: finetune(ctx, f"layout_{d}_{s}", ["--torch_dtype", d, *shapes[s]]) for d, s in jobs])))
    for dtype, tolerance in layouts:
        one, four = done[dtype, "bs8"], done[dtype, "bs2ga4"]
        diff = max(abs(a - b) / abs(a) for a, b in zip(one.losses, four.losses))
        figures[dtype] = {"max_rel_diff": diff, "tolerance": tolerance, "steps": len(one.losses),
                          "losses_bs8": one.losses, "losses_bs2ga4": four.losses}
        ok = ok and len(one.losses) == len(four.losses) == ctx.steps and diff <= tolerance
    return {"pass": ok, **figures}


def part_kill_resume(ctx: Context) -> dict:
    """kill -9 at step 5 of 10 (checkpoints every 2 steps), relaunch; against the uninterrupted run, and two
    uninterrupted runs against each other (the device's run-to-run spread)."""
    extra = ["--max_train_steps", "10", "--checkpointing_steps", "2", "--torch_dtype", ctx.train_dtype]

    def killed_and_resumed() -> tuple[int, runs.RunResult]:
        code = runs.interrupt(ctx, "resume_killed", extra, at_line=5)
        return code, finetune(ctx, "resume_killed", extra, fresh=False)

    chains = [lambda: finetune(ctx, "resume_base", extra), killed_and_resumed]
    if not ctx.smoke:
        chains.append(lambda: finetune(ctx, "resume_repeat", extra))
    base, (killed_code, resumed), *more = runs.together(ctx, *chains)
    repeat = more[0] if more else base
    spread = max(abs(a - b) / abs(a) for a, b in zip(base.losses, repeat.losses))
    diff = max(abs(a - b) / abs(a) for a, b in zip(base.losses, resumed.losses))
    tolerance = max(2 * spread, 1e-6)
    return {"pass": killed_code == -signal.SIGKILL and len(resumed.losses) == 10 and diff <= tolerance,
            "bitwise": base.losses == resumed.losses, "max_rel_diff": diff, "run_to_run_rel_diff": spread,
            "tolerance": tolerance, "killed_exit": killed_code, "resumed_from": resumed.resumed_from}


def part_probe(name: str):
    def part(ctx: Context) -> dict:
        args = ["--model", str(ctx.small_model)] if name == "packed" else (["--smoke"] if ctx.smoke else [])
        return runs.probe(ctx, name, args)

    part.__name__ = f"part_{name}"
    return part


# ------------------------------------------------------------------------------------------------------------
# features
# ------------------------------------------------------------------------------------------------------------
def feature(name: str, extra: list[str], launcher: str = "python", check=None, beside: Optional[list[str]] = None):
    """A feature's run, held to `check(ctx, result, other)`; `other` is the run of the flags `beside` (made at
    the same time on a GPU), or None."""

    def part(ctx: Context) -> dict:
        def run():
            return finetune(ctx, name, extra, launcher=launcher)

        result, other = (run(), None) if beside is None else runs.together(
            ctx, run, lambda: finetune(ctx, f"{name}_eager", beside))
        figures = {"losses": result.losses, "compute_dtype": result.run.get("compute_dtype"),
                   "peak_memory_gib": result.peak_memory_gib, "falling": falling(result.losses)}
        figures["export_reloads"] = reload_export(ctx, result.out)
        ok = figures["falling"] and figures["export_reloads"] is True
        if check is not None:
            more, fine = check(ctx, result, other)
            figures.update(more)
            ok = ok and fine
        return {"pass": bool(ok), **figures}

    part.__name__ = f"part_{name}"
    return part


def _auto_dtype(ctx: Context, result, _other) -> tuple[dict, bool]:
    want = "torch.bfloat16" if ctx.gpu else result.run.get("compute_dtype")
    return {"expected_dtype": want}, result.run.get("compute_dtype") == want


def _micro_batch(ctx: Context, result, _other) -> tuple[dict, bool]:
    schedule = result.run.get("schedule", {})
    chosen = schedule.get("micro_batch_size")
    return {"micro_batch_chosen": f"{chosen} x GA {schedule.get('gradient_accumulation_steps')}"}, \
        isinstance(chosen, int) and chosen >= 1


def _liger_modules(ctx: Context, result, _other) -> tuple[dict, bool]:
    return runs.liger_replacements(ctx, result)


def _same_as_eager(ctx: Context, result, eager) -> tuple[dict, bool]:
    """The compiled layers' losses against the same run uncompiled (inductor's fused kernels round bf16 once
    where eager rounds after every op, so the bf16 tolerance is batch_layouts')."""
    half = "bfloat16" in str(result.run.get("compute_dtype"))  # --torch_dtype auto: bf16 on GPUs and some CPUs
    tolerance = ctx.tolerance("bfloat16" if half else "float32")
    diff = max(abs(a - b) / abs(a) for a, b in zip(eager.losses, result.losses))
    return {"max_rel_diff_to_eager": diff, "tolerance": tolerance, "losses_eager": eager.losses,
            "compiled": runs.log_lines(ctx, "torch_compile", "--torch_compile")}, \
        len(eager.losses) == len(result.losses) and diff <= tolerance


PARTS = {
    "batch_layouts": part_batch_layouts,
    "packed": part_probe("packed"),
    "fused_ce": part_probe("fused_ce"),
    "attention": part_probe("attention"),
    "kill_resume": part_kill_resume,
    "dtype_auto": feature("dtype_auto", [], check=_auto_dtype),
    "liger": feature("liger", ["--use_liger_kernel"], check=_liger_modules),
    "qlora": feature("qlora", ["--use_qlora", "--lora_rank", "16", "--merge_lora_on_save", "--learning_rate",
                               "1e-3"]),
    "zero2": feature("zero2", [], launcher="zero2.json"),
    "zero3": feature("zero3", [], launcher="zero3.json"),
    "fsdp2": feature("fsdp2", [], launcher="fsdp2"),
    "gradient_checkpointing": feature("gradient_checkpointing", ["--gradient_checkpointing"]),
    "auto_micro_batch_size": feature("auto_micro_batch_size", ["--auto_micro_batch_size"], check=_micro_batch),
    "torch_compile": feature("torch_compile", ["--torch_compile"], check=_same_as_eager, beside=[]),
    "speed": gpu_check_speed.speed,
}


def group_of(name: str) -> str:
    return "correctness" if name in CORRECTNESS else "feature" if name in FEATURES else "speed"


# ------------------------------------------------------------------------------------------------------------
# running and reporting
# ------------------------------------------------------------------------------------------------------------
def run_part(ctx: Context, name: str, report: dict) -> None:
    started = time.monotonic()
    if not ctx.gpu and name in GPU_ONLY:
        entry = {"verdict": "skip", "why": GPU_ONLY[name]}
    elif name == "qlora" and not runs.importable("bitsandbytes"):
        entry = {"verdict": "skip", "why": "bitsandbytes is not installed"}
    elif name == "liger" and not runs.importable("liger_kernel"):
        entry = {"verdict": "skip", "why": "liger-kernel is not installed"}
    elif time.monotonic() > ctx.deadline:
        entry = {"verdict": "not run", "why": "the check's time budget (--budget_s) ran out first"}
    else:
        with ctx.lock:
            ctx.running[name] = started
        try:
            figures = PARTS[name](ctx)
            entry = {"verdict": "pass" if figures.pop("pass") else "FAIL", **figures}
        except Exception as exc:  # reported, never hiding the other parts
            entry = {"verdict": "FAIL", "error": f"{type(exc).__name__}: {exc}"[-2000:]}
        with ctx.lock:
            ctx.running.pop(name, None)
    entry.update(group=group_of(name), seconds=round(time.monotonic() - started, 1))
    with ctx.lock:
        report["parts"][name] = entry
        write_report(ctx, report)
        pack_logs(ctx.out, ctx.work)
    print(f"[gpu_check] {name}: {entry['verdict']} ({entry['seconds']} s)", flush=True)


def stop_on_signal(ctx: Context, report: dict, keep_work: bool) -> None:
    """On SIGTERM/SIGINT (a job's time limit, `timeout`, Ctrl-C): the parts in progress are reported as stopped
    (the speed part with the runs it finished), the report and the logs are written, and the check exits 124,
    so a check cut short still says what it found."""

    def handler(signum, _frame) -> None:
        with ctx.lock:
            for name, started in ctx.running.items():
                entry = {"verdict": "FAIL", "error": f"stopped by {signal.Signals(signum).name} while running "
                         f"(the job's time limit?)", "group": group_of(name),
                         "seconds": round(time.monotonic() - started, 1)}
                if name == "speed" and ctx.speed_json.exists():
                    entry.update(json.loads(ctx.speed_json.read_text()))
                report["parts"][name] = entry
            write_report(ctx, report)
            pack_logs(ctx.out, ctx.work)
        print(markdown(report), flush=True)
        for child in psutil.Process().children(recursive=True):  # the runs in flight go with the check
            child.kill()
        if not keep_work:
            shutil.rmtree(ctx.work, ignore_errors=True)
        os._exit(124)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, handler)


def write_report(ctx: Context, report: dict) -> None:
    verdicts = [p["verdict"] for p in report["parts"].values()]
    report["verdict"] = "FAIL" if "FAIL" in verdicts else "pass" if verdicts else "nothing run"
    (ctx.out / "gpu_report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (ctx.out / "gpu_report.md").write_text(markdown(report))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--data", help="alpaca-style rows (.json/.jsonl); default: the embedded sample")
    parser.add_argument("--tokenizer", help="a tokenizers JSON file (real tokenizer); default: the embedded one")
    parser.add_argument("--parts", default="all", help="comma-separated part names, or all")
    parser.add_argument("--smoke", action="store_true", help="CPU: tiny model, the parts a CPU can run")
    parser.add_argument("--workers", type=int, default=None, help="parts run at once (fused_ce, attention and speed, which time kernels, run alone)")
    parser.add_argument("--budget_s", type=float, default=600.0,
                        help="start no part, and no run of the speed part, after this many seconds")
    parser.add_argument("--speed_steps", type=int, default=12)
    parser.add_argument("--speed_compare", choices=["trl", "none"], default="trl",
                        help="run TRL's SFTTrainer beside open_sft in the speed part (when trl is installed)")
    parser.add_argument("--commit", default=None, help="default: $OPEN_SFT_COMMIT, else git rev-parse HEAD")
    parser.add_argument("--keep_work", action="store_true",
                        help="keep the models, runs and caches the check made (a temporary directory) for a look")
    args = parser.parse_args(argv)
    names = list(PARTS) if args.parts == "all" else args.parts.split(",")
    unknown = [n for n in names if n not in PARTS]
    if unknown:
        parser.error(f"--parts: unknown {unknown}; choose from {', '.join(PARTS)}")
    args.names = names
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    ctx = Context.create(args)
    report = {"header": runs.header(ctx), "parts": {}}
    stop_on_signal(ctx, report, args.keep_work)
    print(json.dumps(report["header"]), flush=True)
    runs.prepare(ctx, need_big="speed" in args.names and not args.smoke)
    report["header"]["models"] = ctx.describe_models()
    pooled = [n for n in args.names if n not in ALONE]
    with ThreadPoolExecutor(max_workers=ctx.workers) as pool:
        list(pool.map(lambda n: run_part(ctx, n, report), pooled))
    for name in [n for n in ALONE if n in args.names]:
        run_part(ctx, name, report)
    write_report(ctx, report)
    pack_logs(ctx.out, ctx.work)
    print(markdown(report), flush=True)
    if args.keep_work:
        print(f"[gpu_check] models, runs and caches kept in {ctx.work}", flush=True)
    else:
        shutil.rmtree(ctx.work, ignore_errors=True)
    return 0 if report["verdict"] == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
