#!/usr/bin/env python
"""One command that checks open_sft on one GPU and writes what it found:

    python scripts/gpu_check.py OUT_DIR --data alpaca.json --tokenizer tokenizer.json   # on a GPU node
    python scripts/gpu_check.py OUT_DIR --smoke                                         # CPU: the suite's run

Writes OUT_DIR/gpu_report.json and OUT_DIR/gpu_report.md (one row per part: verdict and figures), and prints
the GPU, driver, library versions and commit first. Each part runs as a user's command would (finetune.py,
`accelerate launch`, scripts/benchmark.py, the probes' pytest files) in a process of its own with a time limit,
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
  to 4,096, every token trained on both sides: open_sft eager, + Liger, + torch.compile, against TRL's
  SFTTrainer (packing + padding-free) with torch's varlen flash attention (open_sft's kernel, registered with
  transformers' AttentionInterface), flex_attention and the dense-mask sdpa, eager and compiled, each
  --speed_repeats times alternating; then scripts/profile_step.py on open_sft's default run;
- fp8: the 1B shape in bf16 and with --fp8, 120 steps each: tokens/s and the loss step by step (plotted in
  OUT_DIR/fp8_loss.png), held to FP8_TOLERANCE;
- speed_8b: a Llama-3.1-8B-shaped model, LoRA and QLoRA r 16 on every projection, rows packed to 4,096, against
  TRL + PEFT's LoRA and QLoRA (varlen and flex attention): tokens/s, both MFU counts, peak memory allocated and
  reserved.

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
import time
from concurrent.futures import ThreadPoolExecutor

import psutil

from open_sft.config.whole_flags import WholeFlagParser
from tests.gpu_check.context import Context, header, importable
from tests.gpu_check.models import prepare
from tests.gpu_check.parts import PARTS, SPEED, group_of
from tests.gpu_check.report import markdown, pack_logs, write_report

# parts whose figures include kernel timings run one at a time after the others, the GPU otherwise idle: run
# beside 5 other parts on an H200, the attention part timed torch's varlen flash kernel at 9.2 ms against 2.8 ms
# alone, and named the block-mask sdpa fastest
ALONE = ["fused_ce", "attention", *SPEED]
GPU_ONLY = {"liger": "Liger's kernels are Triton (CUDA)", "qlora": "run on a GPU only here (bitsandbytes 4-bit)",
            "fp8": "FP8 matmuls need a GPU of compute capability 8.9+ (the suite trains --fp8 on CPU: test_fp8.py)",
            "speed_8b": "an 8B model's LoRA and QLoRA speed is a GPU's figure"}


# ------------------------------------------------------------------------------------------------------------
# running and reporting
# ------------------------------------------------------------------------------------------------------------
def run_part(ctx: Context, name: str, report: dict) -> None:
    started = time.monotonic()
    if not ctx.gpu and name in GPU_ONLY:
        entry = {"verdict": "skip", "why": GPU_ONLY[name]}
    elif name == "qlora" and not importable("bitsandbytes"):
        entry = {"verdict": "skip", "why": "bitsandbytes is not installed"}
    elif name == "liger" and not importable("liger_kernel"):
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
                finished = ctx.work / f"{name}.json"  # a speed part's runs so far (scripts/benchmark.py's)
                if name in SPEED and finished.exists():
                    entry.update(json.loads(finished.read_text()))
                report["parts"][name] = entry
            write_report(ctx, report)
            pack_logs(ctx.out, ctx.work)
            # still holding the lock: a part whose run dies below must not write its own verdict over "stopped"
            print(markdown(report), flush=True)
            for child in psutil.Process().children(recursive=True):  # the runs in flight go with the check
                child.kill()
            if not keep_work:
                shutil.rmtree(ctx.work, ignore_errors=True)
            os._exit(124)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, handler)


def parse_args(argv=None) -> argparse.Namespace:
    parser = WholeFlagParser(prog="gpu_check.py", description=__doc__,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--data", help="alpaca-style rows (.json/.jsonl); default: the embedded sample")
    parser.add_argument("--tokenizer", help="a tokenizers JSON file (real tokenizer); default: the embedded one")
    parser.add_argument("--parts", default="all", help="comma-separated part names, or all")
    parser.add_argument("--smoke", action="store_true", help="CPU: tiny model, the parts a CPU can run")
    parser.add_argument("--workers", type=int, default=None, help="parts run at once (fused_ce, attention and speed, which time kernels, run alone)")
    parser.add_argument("--budget_s", type=float, default=600.0,
                        help="start no part, and no run of the speed part, after this many seconds")
    parser.add_argument("--speed_steps", type=int, default=12)
    parser.add_argument("--speed_repeats", type=int, default=1,
                        help="runs of each speed configuration, alternating (median and spread; the issue asks 3)")
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
    report = {"header": header(ctx), "parts": {}}
    stop_on_signal(ctx, report, args.keep_work)
    print(json.dumps(report["header"]), flush=True)
    prepare(ctx, need_big={"speed", "fp8"} & set(args.names) and not args.smoke,
            need_huge="speed_8b" in args.names and ctx.gpu)
    report["header"]["models"] = ctx.describe_models()
    # the longest parts first (three runs each), so that no long part is left running alone at the end
    pooled = sorted((n for n in args.names if n not in ALONE), key=lambda n: n not in ("kill_resume", "torch_compile"))
    if not ctx.gpu and ctx.workers > 1:
        # on CPU the parts that run side by side share the cores: each process takes its share of threads. With
        # every run using all cores, 2 runs' OpenMP threads spun against each other on 2 cores, and the smoke's
        # training steps ran 10-100x slower than alone (the whole smoke: 197 s, against 141 s with a share each)
        from open_sft.distributed.env import usable_cpus

        ctx.threads = max(1, usable_cpus() // ctx.workers)
    with ThreadPoolExecutor(max_workers=ctx.workers) as pool:
        list(pool.map(lambda n: run_part(ctx, n, report), pooled))
    ctx.threads = None  # the parts that time kernels run alone, on every core
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

