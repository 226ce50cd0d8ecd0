#!/usr/bin/env python
"""Training throughput of open_sft (and optionally TRL's SFTTrainer) on one model and dataset.

    python scripts/benchmark.py                                   # the embedded default, 20 steps
    python scripts/benchmark.py --model_name_or_path M --data D.jsonl --packing --steps 30
    python scripts/benchmark.py ... --compare trl                 # TRL SFTTrainer, same data/seq/global batch

Prints trained tokens/s (padding excluded), MFU against this machine's measured matmul peak, and
peak RSS, from the steady-state steps (the first --warmup_steps are excluded). Runs are subprocesses
launched the way a user would, one after the other in this invocation, so the ratio is side by side.
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


def run_open_sft(args, model: str, out: Path) -> dict:
    cmd = [sys.executable, str(ROOT / "finetune.py"), "--model_name_or_path", model,
           "--dataset_mixer_list", args.data, "1.0", "--output_dir", str(out), "--max_train_steps", str(args.steps),
           "--per_device_train_batch_size", str(args.batch_size), "--gradient_accumulation_steps", "1",
           "--max_seq_length", str(args.max_seq_length), "--logging_steps", "1", "--learning_rate", "1e-4",
           "--torch_dtype", args.dtype, "--dataset_local_cache_dir", str(out.parent / "cache")]
    if args.chat_template_name:
        cmd += ["--chat_template_name", args.chat_template_name]
    if args.packing:
        cmd += ["--packing"]
    started = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in records if "loss" in r][args.warmup_steps:]
    # Each record is one step (logging_steps 1): tokens in the window / its seconds.
    step_tokens = [b["total_tokens"] - a["total_tokens"] for a, b in zip(steady, steady[1:])]
    step_seconds = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(steady, steady[1:])]
    trained = [b["train_tokens"] - a["train_tokens"] for a, b in zip(steady, steady[1:])]
    seconds = sum(step_seconds)
    return {"tool": "open_sft" + (" (packing)" if args.packing else ""),
            "tokens_per_second": sum(step_tokens) / seconds, "trained_tokens_per_second": sum(trained) / seconds,
            "mfu": sum(r["mfu"] for r in steady[1:]) / max(len(steady) - 1, 1),
            "peak_rss_gib": max(r["peak_memory_gib"] for r in records),
            "wall_s": time.perf_counter() - started}


TRL_SCRIPT = r"""
import json, sys, time, resource, torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import SFTConfig, SFTTrainer
model_dir, data, steps, bs, seq, packing, warm = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6] == "1", int(sys.argv[7])
tok = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
ds = load_dataset("json", data_files=data, split="train").select_columns(["messages"])
class Clock(TrainerCallback):
    def __init__(self): self.times = []
    def on_step_end(self, args, state, control, **kw): self.times.append(time.perf_counter())
clock = Clock()
cfg = SFTConfig(output_dir="/tmp/trl_bench", max_steps=steps, per_device_train_batch_size=bs, max_length=seq,
                packing=packing, padding_free=packing, bf16=True, logging_steps=1, save_strategy="no", report_to=[],
                assistant_only_loss=False, dataloader_num_workers=0, use_cpu=True)
trainer = SFTTrainer(model=model, args=cfg, train_dataset=ds, processing_class=tok, callbacks=[clock])
tokens = []
orig = trainer.compute_loss
def counting(model, inputs, *a, **k):
    mask = inputs.get("attention_mask")
    tokens.append(int(mask.sum()) if mask is not None else int(inputs["input_ids"].numel()))
    return orig(model, inputs, *a, **k)
trainer.compute_loss = counting
trainer.train()
t = clock.times
print(json.dumps({"tokens_per_second": sum(tokens[warm + 1:]) / (t[-1] - t[warm]),
                  "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))
"""


def run_trl(args, model: str) -> dict:
    out = subprocess.run([sys.executable, "-c", TRL_SCRIPT, model, args.data, str(args.steps), str(args.batch_size),
                          str(args.max_seq_length), "1" if args.packing else "0", str(args.warmup_steps)],
                         check=True, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return {"tool": "trl SFTTrainer" + (" (packing)" if args.packing else ""), **result}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_name_or_path", default=None, help="default: build the embedded default")
    parser.add_argument("--data", default=str(ROOT / "open_sft" / "embedded" / "data" / "sample.jsonl"))
    parser.add_argument("--chat_template_name", default=None)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup_steps", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--max_seq_length", type=int, default=1024)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--packing", action="store_true")
    parser.add_argument("--compare", choices=["trl"], default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model_name_or_path
        if model is None:
            from open_sft.embedded.factory import build_embedded_default

            model = str(build_embedded_default(Path(tmp) / "model", hidden_size=256, num_layers=4, num_heads=4))
        results = [run_open_sft(args, model, Path(tmp) / "open_sft")]
        if args.compare == "trl":
            results.append(run_trl(args, model))
    for r in results:
        print(json.dumps(r))
    if len(results) == 2:
        print(json.dumps({"open_sft_over_trl": results[0]["tokens_per_second"] / results[1]["tokens_per_second"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
