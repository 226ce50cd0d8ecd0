#!/usr/bin/env python
"""Scaling out on real ranks (gloo on CPU): the engines side by side, FSDP2 with and without tensor parallelism,
and the longest sequence that trains under a per-rank memory cap with and without sequence parallelism.

    python scripts/benchmark_scale_out.py engines            # ZeRO-2, ZeRO-3 and FSDP2 on the same model and data
    python scripts/benchmark_scale_out.py tensor             # 4 ranks: FSDP2 4 shards vs 2 shards × TP 2
    python scripts/benchmark_scale_out.py longest --cap_gib 1.6 --lengths 2048 4096 8192 16384
    python scripts/benchmark_scale_out.py pipeline --layers 8  # 2 and 4 ranks: pipeline stages vs FSDP2

`engines`: finetune.py under `accelerate launch --num_processes 2` with configs/ds/zero2.json, zero3.json and
configs/accelerate/fsdp2.yaml, one after the other on a generated chat mix; prints tokens/s over the steady
steps (the first --warmup_steps excluded), each rank's peak resident memory (polled), and the final loss (the
engines train the same steps, so the losses agree).

`tensor`: the same on 4 ranks, FSDP2 over all 4 against FSDP2 over 2 × tensor parallel 2
(configs/accelerate/fsdp2_tp.yaml): both train the same global batch, so the losses agree.

`pipeline`: on 2 and then 4 ranks, FSDP2 over all ranks against pipeline parallelism over all ranks (and on 4,
2 stages × 2 replicas), the same global batch (16 examples a step, packed: a pipeline pads a step's
micro-batches to one shape, which packed rows nearly have already): tokens/s, each rank's peak resident memory,
and the pipeline's bubble — each rank's measured idle share of the schedules' time (logged by the run) beside
1F1B's (N - 1) / (M + N - 1) for N stages and M micro-batches.

`longest`: documents spliced into blocks of exactly L tokens (text format: every token trained), one block per
rank and step, under ZeRO-3 with and without `--sequence_parallel_size 2`. Per length: the ranks' peak resident
memory, the activations each rank saved for backward (measured, open_sft.monitor.activations) and tokens/s;
then, per layout, the longest L whose peak stays under --cap_gib. A run that fails (out of
memory) counts as over the cap. First a line names the CPU and its flags: a figure holds for that CPU kind only.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from benchmark import cpu_line  # noqa: E402  (the CPU line every benchmark prints)
from benchmark_balance import WORDS, long_tailed_mix  # noqa: E402
from open_sft.config.whole_flags import WholeFlagParser  # noqa: E402

GIB = 2**30
ENGINES = {"zero2": ["--use_deepspeed", "--deepspeed_config_file", str(ROOT / "configs" / "ds" / "zero2.json")],
           "zero3": ["--use_deepspeed", "--deepspeed_config_file", str(ROOT / "configs" / "ds" / "zero3.json")],
           "fsdp2": ["--config_file", str(ROOT / "configs" / "accelerate" / "fsdp2.yaml")],
           "fsdp2_tp2": ["--config_file", str(ROOT / "configs" / "accelerate" / "fsdp2_tp.yaml"),
                         "--parallelism_config_dp_shard_size", "2", "--parallelism_config_tp_size", "2"],
           "pipeline": ["--multi_gpu"]}  # accelerate's data-parallel launch; the stages are finetune.py's flag


def documents(path: Path, rows: int, words: int, seed: int) -> None:
    rng = random.Random(seed)
    with path.open("w") as handle:
        for _ in range(rows):
            handle.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(words))}) + "\n")


def launch(args, engine: str, finetune: list[str], out: Path, processes: int = 2) -> dict:
    """One run of `processes` ranks; returns its metrics and each worker's peak resident memory (polled every
    50 ms)."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(processes), "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(args.port),
           *ENGINES[engine], str(ROOT / "finetune.py"), "--output_dir", str(out), "--logging_steps", "1",
           "--torch_dtype", args.dtype, "--dataset_local_cache_dir", str(out.parent / "cache"), *finetune]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "DS_ACCELERATOR": "cpu",
           "OPEN_SFT_RECORD_ACTIVATIONS": "1"}  # each rank's saved-for-backward bytes (open_sft.monitor.activations)
    peaks: dict[str, int] = {}  # by RANK
    with (out.parent / f"{out.name}.log").open("w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        launcher = psutil.Process(proc.pid)
        while proc.poll() is None:
            try:
                for child in launcher.children(recursive=True):
                    rank = child.environ().get("RANK")
                    if rank is not None and "finetune.py" in " ".join(child.cmdline()):
                        peaks[rank] = max(peaks.get(rank, 0), child.memory_info().rss)
            except psutil.Error:
                pass
            time.sleep(0.05)
    metrics = out / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    steady = [r for r in records if "loss" in r][args.warmup_steps:]
    idle = [line for line in (out.parent / f"{out.name}.log").read_text().splitlines() if "idle share" in line]
    result = {"ok": proc.returncode == 0 and len(steady) >= 2,
              "peak_rss_gib_per_rank": [round(peaks[rank] / GIB, 3) for rank in sorted(peaks)]}
    if result["ok"]:
        result["saved_activations_gib_per_rank"] = [
            round(json.loads(path.read_text())["peak_saved_bytes"] / GIB, 3)
            for path in sorted(out.glob("activations.rank*.json"))]
        result["tokens_per_second"] = round((steady[-1]["total_tokens"] - steady[0]["total_tokens"])
                                            / (steady[-1]["elapsed_s"] - steady[0]["elapsed_s"]), 1)
        result["final_loss"] = round(steady[-1]["loss"], 5)
        if idle:
            result["idle_share_per_rank"] = json.loads(idle[-1].rsplit(": ", 1)[1])
    return result


def engines(args, model: str, tmp: Path) -> None:
    data = tmp / "mix.jsonl"
    long_tailed_mix(data, args.rows, seed=0)
    tensor = args.what == "tensor"  # 4 ranks: the micro-batch halves, the global batch stays
    for engine in ("fsdp2", "fsdp2_tp2") if tensor else ("zero2", "zero3", "fsdp2"):
        result = launch(args, engine, ["--model_name_or_path", model, "--dataset_mixer_list", str(data), "1.0",
                                       "--max_train_steps", str(args.steps), "--per_device_train_batch_size",
                                       "2" if tensor else "4", "--gradient_accumulation_steps", "2",
                                       "--max_seq_length", "1024", "--learning_rate", "1e-4"], tmp / engine,
                        processes=4 if tensor else 2)
        print(json.dumps({"engine": engine, "processes": 4 if tensor else 2, **result}), flush=True)


def pipeline(args, model: str, tmp: Path) -> None:
    data = tmp / "mix.jsonl"
    long_tailed_mix(data, args.rows, seed=0)
    for processes in (2, 4):
        batch = ["--per_device_train_batch_size", str(8 // processes), "--gradient_accumulation_steps", "2"]
        layouts = [("fsdp2", [])] + [("pipeline", ["--pipeline_parallel_size", str(n)])
                                     for n in sorted({processes, 2}, reverse=True)]
        for engine, extra in layouts:
            stages = int(extra[1]) if extra else 1
            name = f"{engine}_{processes}" + (f"_pp{stages}" if extra else "")
            result = launch(args, engine, ["--model_name_or_path", model, "--dataset_mixer_list", str(data), "1.0",
                                           "--max_train_steps", str(args.steps), *batch, "--max_seq_length", "1024",
                                           "--learning_rate", "1e-4", "--packing", *extra], tmp / name,
                            processes=processes)
            if extra:  # 1F1B's share of idle time: N - 1 of the M + N - 1 slots a stage goes through
                result.pop("saved_activations_gib_per_rank", None)  # measured around the unsplit forward only
                micro_batches = stages * 2
                result["bubble_1f1b_theory"] = round((stages - 1) / (micro_batches + stages - 1), 3)
            print(json.dumps({"layout": name, "processes": processes, **result}), flush=True)


def longest(args, model: str, tmp: Path) -> None:
    data = tmp / "documents.jsonl"
    documents(data, rows=4 * args.steps, words=max(args.lengths) + 64, seed=0)
    fits: dict[int, int] = {1: 0, 2: 0}
    for length in args.lengths:
        for sp in (1, 2):
            flags = ["--model_name_or_path", model, "--dataset_mixer_list", str(data), "1.0",
                     "--dataset_format", "text", "--max_seq_length", str(length), "--max_train_steps",
                     str(args.steps), "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "1",
                     "--learning_rate", "1e-4", "--sequence_parallel_size", str(sp)]
            result = launch(args, "zero3", flags, tmp / f"len{length}_sp{sp}")
            peak = max(result["peak_rss_gib_per_rank"], default=0.0)
            if result["ok"] and peak <= args.cap_gib:
                fits[sp] = max(fits[sp], length)
            print(json.dumps({"length": length, "sequence_parallel": sp, **result}), flush=True)
    print(json.dumps({"cap_gib_per_rank": args.cap_gib, "longest_without_sp": fits[1], "longest_with_sp2": fits[2]}))


def main() -> int:
    parser = WholeFlagParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("engines", "tensor", "longest", "pipeline"))
    parser.add_argument("--model_name_or_path", default=None, help="default: the embedded default at --hidden")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", type=int, default=400)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup_steps", type=int, default=2)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--cap_gib", type=float, default=1.6, help="per-rank peak resident memory cap (longest)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--port", type=int, default=29741)
    args = parser.parse_args()
    print(json.dumps(cpu_line()))
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model_name_or_path
        if model is None:
            from open_sft.embedded.factory import build_embedded_default

            model = str(build_embedded_default(Path(tmp) / "model", hidden_size=args.hidden, num_layers=args.layers,
                                               num_heads=4))
        {"longest": longest, "pipeline": pipeline}.get(args.what, engines)(args, model, Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
