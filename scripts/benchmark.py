#!/usr/bin/env python
"""Training throughput of open_sft, side by side with TRL's SFTTrainer, on one model and dataset.

    python scripts/benchmark.py                                   # the embedded default, 20 steps
    python scripts/benchmark.py --model_name_or_path M --data D.jsonl --packing --steps 30
    python scripts/benchmark.py ... --compare trl --trl_python /path/to/trl-venv/bin/python
    python scripts/benchmark.py ... --variants plain liger --trl_variants plain liger --json_out bench.json  # GPU

Runs open_sft with its default dtype (`--torch_dtype auto`) and with bf16 and fp32 forced (--dtypes),
then, with --compare trl, TRL's fastest configuration (packing + padding-free when --packing, no
gradient checkpointing) in bf16 and fp32. TRL runs in a side environment when --trl_python is given
(TRL pins its own transformers/accelerate; keep it out of open_sft's venv). Each run is a subprocess
launched as a user would, one after the other in this invocation, so the ratios are side by side.

Prints, per run: tokens/s over the steady-state steps (the first --warmup_steps excluded; padding
excluded), MFU against this machine's measured dense matmul peak of the run's dtype, peak RSS, and
each run's ratio to TRL's best; first a line naming the CPU and its bf16-relevant flags (a figure
holds for that CPU kind only). TRL's MFU uses the FLOPs per token of open_sft's run on the same model
and data (the same work per token).

On a GPU the same runs go to CUDA: MFU is given against the datasheet's dense peak (open_sft's metric) and
against the peak a large bf16 matmul measures on this GPU, peak memory is the GPU's (max allocated), and
open_sft's preflight estimate of that peak is printed beside it. `--variants liger compile liger_compile` adds
open_sft with --use_liger_kernel, --torch_compile or both, `--trl_variants liger` TRL with use_liger_kernel;
`--json_out` writes every figure (after each run, so a stopped benchmark keeps what it measured); compiled
variants run last. Tokens/s and MFU are the median step's of the steady-state window. `--deadline_unix` starts
no run after that time, `--run_timeout_s` stops a run that takes longer, `--log_dir` keeps every run's log.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # open_sft from this checkout, installed or not
from open_sft.config.whole_flags import WholeFlagParser  # noqa: E402

OFFLINE = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


LORA = ["--lora_alpha", "32", "--lora_dropout", "0"]  # rank: --lora_rank; every linear layer (all-linear)
VARIANT_FLAGS = {"plain": [], "liger": ["--use_liger_kernel"], "compile": ["--torch_compile"],
                 "liger_compile": ["--use_liger_kernel", "--torch_compile"], "fp8": ["--fp8"],
                 "fp8_compile": ["--fp8", "--torch_compile"], "lora": ["--use_lora", *LORA],
                 "qlora": ["--use_qlora", *LORA], "lora_compile": ["--use_lora", *LORA, "--torch_compile"]}


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def variant_flags(args, variant: str) -> list[str]:
    """open_sft's flags of a variant, with the trained tokens, LoRA rank and checkpointing the benchmark asks for."""
    flags = [*VARIANT_FLAGS[variant], "--train_on", args.train_on]
    if "lora" in variant:
        flags += ["--lora_rank", str(args.lora_rank)]
    return flags + (["--gradient_checkpointing"] if args.gradient_checkpointing else [])


def run_open_sft(args, model: str, out: Path, dtype: str, variant: str = "plain") -> dict:
    cmd = [sys.executable, str(ROOT / "finetune.py"), "--model_name_or_path", model,
           "--dataset_mixer_list", args.data, "1.0", "--output_dir", str(out), "--max_train_steps", str(args.steps),
           "--per_device_train_batch_size", str(args.batch_size), "--gradient_accumulation_steps", "1",
           "--max_seq_length", str(args.max_seq_length), "--logging_steps", "1", "--learning_rate", "1e-4",
           "--torch_dtype", dtype, "--dataset_local_cache_dir", str(out.parent / "cache")]
    if args.chat_template_name:
        cmd += ["--chat_template_name", args.chat_template_name]
    if args.packing:
        cmd += ["--packing"]
    cmd += variant_flags(args, variant)
    started = time.perf_counter()
    log = Path(args.log_dir or out.parent) / f"{out.name}.log"
    # a compiled run logs its recompilations (a shape that changes every step would show there)
    env = {**OFFLINE, "TORCH_LOGS": "recompiles"} if "compile" in variant else OFFLINE
    with log.open("w") as handle:
        try:
            code = subprocess.run(cmd, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT,
                                  timeout=args.run_timeout_s).returncode
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"open_sft {dtype} {variant}: stopped after --run_timeout_s {args.run_timeout_s}")
    if code != 0:
        tail = "\n".join(log.read_text().splitlines()[-20:])
        raise RuntimeError(f"open_sft {dtype} {variant}: exit {code}:\n{tail}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    run = json.loads((out / "run.json").read_text())
    steady = [r for r in records if "loss" in r][args.warmup_steps:]
    # Each record is one step (logging_steps 1): tokens in the window / its seconds.
    step_tokens = [b["total_tokens"] - a["total_tokens"] for a, b in zip(steady, steady[1:])]
    step_seconds = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(steady, steady[1:])]
    trained = [b["train_tokens"] - a["train_tokens"] for a, b in zip(steady, steady[1:])]
    # The median step: a step that recompiles (--torch_compile meeting a new shape, e.g. an epoch's short last
    # batch) or holds a partial batch is an outlier that a sum over the window would fold in.
    rates = [t / s for t, s in zip(step_tokens, step_seconds)]
    typical = _median(rates)
    peak = max(r["peak_memory_gib"] for r in records)
    return {"tool": "open_sft", "label": f"open_sft {dtype}" + "".join(f" + {v}" for v in variant.split("_")
                                                                       if v != "plain"),
            "asked": dtype, "dtype": run["compute_dtype"].replace("torch.", ""), "variant": variant,
            "compiled": "compile" in variant, "flags": variant_flags(args, variant), "losses": [r["loss"] for r in records if "loss" in r],
            "tokens_per_second": typical,
            "trained_tokens_per_second": _median([t / s for t, s in zip(trained, step_seconds)]),
            "mean_tokens_per_second": sum(step_tokens) / sum(step_seconds),
            "mfu": _median([r["mfu"] for r in steady[1:]]),
            "mfu_palm": _median([r.get("mfu_palm", 0.0) for r in steady[1:]]),
            "peak_gib": peak, "peak_of": "GPU memory allocated" if _on_gpu() else "process RSS",
            **({"peak_reserved_gib": max(r["peak_memory_reserved_gib"] for r in records if "loss" in r)}
               if _on_gpu() else {}),
            "estimate_gib": run["preflight"]["memory"]["total_bytes"] / 2**30,
            "wall_s": time.perf_counter() - started}


def _on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def run_trl(args, model: str, dtype: str, variant: str = "plain", attention: str = "sdpa",
            compiled: bool = False) -> dict:
    """TRL's SFTTrainer (scripts/benchmark_trl.py in --trl_python's environment) on the same model and rows."""
    import torch

    settings = {"model": model, "data": args.data, "steps": args.steps, "batch_size": args.batch_size,
                "max_length": args.max_seq_length, "packing": args.packing, "warmup": args.warmup_steps,
                "bf16": dtype == "bfloat16", "threads": torch.get_num_threads(), "liger": variant == "liger",
                "peft": variant if variant in ("lora", "qlora") else None, "lora_rank": args.lora_rank,
                "attention": attention, "compile": compiled, "assistant_only": args.train_on != "all",
                "gradient_checkpointing": args.gradient_checkpointing, "root": str(ROOT)}
    label = (f"trl SFTTrainer {dtype}" + {"liger": " + liger", "lora": " + PEFT LoRA", "qlora": " + PEFT QLoRA"}.get(
        variant, "") + f" {attention}" + (" compiled" if compiled else ""))
    try:
        out = subprocess.run([args.trl_python, str(ROOT / "scripts" / "benchmark_trl.py"), json.dumps(settings)],
                             capture_output=True, text=True, env=OFFLINE, timeout=args.run_timeout_s)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{label}: stopped after --run_timeout_s {args.run_timeout_s}")
    if args.log_dir:
        (Path(args.log_dir) / (label.replace(" ", "_").replace("+", "") + ".log")).write_text(out.stdout + out.stderr)
    if out.returncode != 0:
        raise RuntimeError(f"{label}: exit {out.returncode}: {out.stderr.strip()[-1500:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return {"tool": "trl SFTTrainer", "label": label, "asked": dtype, "dtype": dtype, "variant": variant,
            "attention": attention, "compiled": compiled, **result}


def aggregate(results: list[dict]) -> list[dict]:
    """One row per configuration (its label): with repeats, the median of their median steps, the spread (max - min
    over the median) and each repeat's figure; peak memory the highest of them."""
    rows: dict[str, dict] = {}
    for r in results:
        row = rows.setdefault(r["label"], {**r, "repeats": []})
        row["repeats"].append(r["tokens_per_second"])
        for key in ("peak_gib", "peak_reserved_gib"):
            if key in r:
                row[key] = max(row[key], r[key])
    for row in rows.values():
        rates = row["repeats"]
        row["tokens_per_second"] = _median(rates)
        row["spread"] = (max(rates) - min(rates)) / row["tokens_per_second"] if row["tokens_per_second"] else 0.0
        for key in ("mfu", "mfu_palm", "trained_tokens_per_second", "mean_tokens_per_second"):
            if key in row:  # the typical repeat's, scaled to the median
                row[key] = row[key] * row["tokens_per_second"] / rates[0]
    return list(rows.values())


def kind(r: dict) -> str:
    """What a run trains: the full model, LoRA or QLoRA adapters (the rows compared with each other)."""
    variant = r.get("variant", "")
    return "qlora" if "qlora" in variant else "lora" if "lora" in variant else "full"


def compare_with_trl(results: list[dict]) -> None:
    """Each open_sft row's tokens/s over TRL's fastest row of the same kind (`over_trl_best`) and of the same kind
    and mode, eager or compiled (`over_trl_same_mode`)."""
    trl = [r for r in results if r["tool"] != "open_sft"]
    for r in results:
        same = [t["tokens_per_second"] for t in trl if kind(t) == kind(r)]
        mode = [t["tokens_per_second"] for t in trl if kind(t) == kind(r) and t["compiled"] == r["compiled"]]
        if same:
            r["over_trl_best"] = r["tokens_per_second"] / max(same)
        if mode:
            r["over_trl_same_mode"] = r["tokens_per_second"] / max(mode)


def gpu_line(measured_bf16_peak: float) -> dict:
    import torch

    from open_sft.monitor.metrics import device_peak_flops

    return {"gpu": torch.cuda.get_device_name(), "bf16_peak_datasheet": device_peak_flops(torch.bfloat16),
            "bf16_peak_measured": measured_bf16_peak}


def cpu_line() -> dict:
    from open_sft.model.precision import cpu_flags, kernel_limits

    name, flags = cpu_flags()
    line = {"cpu": name, "flags": sorted(flags & {"amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2", "bf16"})}
    # Kernels held below what the CPU has (a stand-in for an older CPU kind): the figures are for that kind.
    limits = kernel_limits()
    return {**line, "kernels_limited_by": limits} if limits else line


def measure_gpu_peak(size: int = 8192, repeat: int = 10) -> float:
    """FLOP/s of a large bf16 matmul on this GPU (random data; the mean of `repeat` after warm-ups)."""
    import torch

    a, b = (torch.randn(size, size, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * size**3 * repeat / (start.elapsed_time(end) / 1e3)


def add_mfu(results: list[dict], measured_bf16_peak: float | None = None) -> None:
    """MFU of the TRL runs from the FLOPs per token open_sft counted (the same model and data), in both counts
    (open_sft's strict `mfu`, PaLM's `mfu_palm`); on a GPU, every run's strict MFU against the measured bf16 peak
    as well."""
    import torch

    from open_sft.monitor.metrics import device_peak_flops

    ours = [r for r in results if r["tool"] == "open_sft" and r["mfu"] > 0]
    if not ours:
        return
    peaks = {name: device_peak_flops(getattr(torch, name)) for name in ("float32", "bfloat16")}
    flops_per_token = ours[0]["mfu"] * peaks[ours[0]["dtype"]] / ours[0]["tokens_per_second"]
    palm_per_token = ours[0].get("mfu_palm", 0.0) * peaks[ours[0]["dtype"]] / ours[0]["tokens_per_second"]
    for r in results:
        if r["tool"] != "open_sft":
            r["mfu"] = r["tokens_per_second"] * flops_per_token / peaks[r["dtype"]]
            r["mfu_palm"] = r["tokens_per_second"] * palm_per_token / peaks[r["dtype"]]
        if measured_bf16_peak and r["dtype"] == "bfloat16":
            r["mfu_measured_peak"] = r["tokens_per_second"] * flops_per_token / measured_bf16_peak


def main() -> int:
    parser = WholeFlagParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_name_or_path", default=None, help="default: build the embedded default")
    parser.add_argument("--data", default=str(ROOT / "open_sft" / "embedded" / "data" / "sample.jsonl"))
    parser.add_argument("--chat_template_name", default=None)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup_steps", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--max_seq_length", type=int, default=1024)
    parser.add_argument("--dtypes", nargs="+", default=["auto", "bfloat16", "float32"],
                        help="open_sft's --torch_dtype values to run (auto: its default)")
    parser.add_argument("--packing", action="store_true")
    parser.add_argument("--variants", nargs="+", default=["plain"], choices=list(VARIANT_FLAGS),
                        help="open_sft's runs per dtype: plain, --use_liger_kernel, --torch_compile, or both")
    parser.add_argument("--trl_variants", nargs="+", default=["plain"], choices=["plain", "liger", "lora", "qlora"],
                        help="TRL's runs: plain, use_liger_kernel, TRL + PEFT LoRA or QLoRA")
    parser.add_argument("--trl_attention", nargs="+", default=["sdpa"], choices=["sdpa", "flex_attention", "varlen"],
                        help="TRL's attention of padding-free rows: sdpa (a dense block-diagonal mask), "
                             "flex_attention, varlen (torch's variable-length flash attention, open_sft's kernel)")
    parser.add_argument("--trl_modes", nargs="+", default=["eager"], choices=["eager", "compiled"],
                        help="TRL eager and/or with torch_compile (rows of their own)")
    parser.add_argument("--train_on", default="all", choices=["all", "all_assistant"],
                        help="the tokens with a loss on both sides: all (TRL's default) or the assistant turns "
                             "(TRL's assistant_only_loss)")
    parser.add_argument("--lora_rank", type=int, default=16, help="LoRA rank of the lora/qlora variants")
    parser.add_argument("--gradient_checkpointing", action="store_true", help="on both sides")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run every configuration this many times, alternating; median and spread reported")
    parser.add_argument("--json_out", default=None, help="write every run's figures to this JSON file")
    parser.add_argument("--compare", choices=["trl"], default=None)
    parser.add_argument("--trl_dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"],
                        help="TRL's runs (where a dtype is emulated and far slower, its run can be left out)")
    parser.add_argument("--trl_python", default=sys.executable,
                        help="python of an environment with trl installed (default: this one)")
    parser.add_argument("--log_dir", default=None, help="keep each run's log here (default: dropped at the end)")
    parser.add_argument("--run_timeout_s", type=float, default=None, help="stop a run that takes longer")
    parser.add_argument("--deadline_unix", type=float, default=None,
                        help="start no run after this time (seconds since the epoch); the runs left are listed")
    args = parser.parse_args()
    if args.log_dir:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    gpu_peak = measure_gpu_peak() if _on_gpu() else None
    print(json.dumps(cpu_line()) if gpu_peak is None else json.dumps(gpu_line(gpu_peak)))
    failed: list[dict] = []
    skipped: list[str] = []
    results: list[dict] = []

    def save() -> None:  # after every run: a benchmark stopped from outside keeps what it measured
        if args.json_out:
            Path(args.json_out).write_text(json.dumps({"runs": results, "failed": failed, "skipped": skipped,
                                                       "measured_bf16_peak": gpu_peak}, indent=1))

    def attempt(label: str, run) -> None:
        if args.deadline_unix is not None and time.time() > args.deadline_unix and results:
            skipped.append(label)  # past the deadline (the first run always runs: something is measured)
        else:
            try:
                results.append(run())
            except RuntimeError as exc:  # one configuration that fails is reported beside the others
                if not results and label.startswith("open_sft"):
                    raise
                failed.append({"label": label, "error": str(exc)})
        save()

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model_name_or_path
        if model is None:
            from open_sft.embedded.factory import build_embedded_default

            model = str(build_embedded_default(Path(tmp) / "model", hidden_size=256, num_layers=4, num_heads=4))
        # each job takes the repeat's number (a repeat of open_sft trains in an output directory of its own: the
        # first's would be a finished run)
        ours = [(f"open_sft {d} {v}", lambda k, d=d, v=v: run_open_sft(
                    args, model, Path(tmp) / (f"open_sft_{d}_{v}" + (f"_repeat{k + 1}" if k else "")), d, v))
                for d in args.dtypes for v in args.variants]
        trl = [(f"trl {d} {v} {a} {m}", lambda k, d=d, v=v, a=a, m=m: run_trl(args, model, d, v, a, m == "compiled"))
               for d in args.trl_dtypes for v in args.trl_variants for a in args.trl_attention
               for m in args.trl_modes] if args.compare == "trl" else []
        # compiled variants last: they spend a compilation first, and a deadline should cut them rather than the
        # side-by-side comparison; repeats alternate (every configuration once, then again), so a drift of the
        # machine's speed spreads over all of them
        order = [j for j in ours if "compile" not in j[0]] + [j for j in trl if "compiled" not in j[0]] + [
            j for j in ours + trl if "compile" in j[0]]
        for repeat in range(args.repeats):
            for label, run in order:
                attempt(label if args.repeats == 1 else f"{label} (repeat {repeat + 1})",
                        lambda run=run, repeat=repeat: run(repeat))
    results[:] = aggregate(results)
    add_mfu(results, gpu_peak)
    compare_with_trl(results)
    for r in results:
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}))
    for r in failed:
        print(json.dumps(r))
    if skipped:
        print(json.dumps({"not run (past --deadline_unix)": skipped}))
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
