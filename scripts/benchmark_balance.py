#!/usr/bin/env python
"""Token-balanced ranks against shuffled ones: tokens/s of 2 real ranks (ZeRO-2 over gloo on CPU) on data
of very different lengths, side by side in one invocation.

    python scripts/benchmark_balance.py                        # generated long-tailed chat mix, 10-2,000 tokens
    python scripts/benchmark_balance.py --data D.jsonl --model_name_or_path M --steps 20

Runs finetune.py under `accelerate launch --num_processes 2` four times, padded and --packing, each with
token balancing (the default) and with `--balance_micro_batches false`, one after the other. Prints per
run: tokens/s over the steady-state steps (the first --warmup_steps excluded; padding excluded), the mean
logged `rank_tokens_max_over_mean` (1.0: no rank waits for another), the padding ratio, and the balanced
run's speed-up over the shuffled one; first a line naming the CPU and its bf16-relevant flags (a figure
holds for that CPU kind only). Both layouts train the same examples at each step, so the losses match.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from benchmark import cpu_line  # noqa: E402  (the CPU line every benchmark prints)
from open_sft.config.whole_flags import WholeFlagParser  # noqa: E402

WORDS = ("the of and to in is was for on that with as by at from his her an were which this are be had first "
         "one their not also after new two its has but other been when there all during into school time may "
         "years more most only over city some world would where later up such used many can state about "
         "national out known university united then made").split()


def long_tailed_mix(path: Path, rows: int, seed: int) -> None:
    """Chat rows whose answers run from a few words to ~1,500 (log-normal, as real SFT data: most short,
    a few very long), so a fixed number of examples per rank means very different work per rank."""
    rng = random.Random(seed)
    with path.open("w") as handle:
        for i in range(rows):
            words = min(1500, max(5, int(rng.lognormvariate(4.6, 1.1))))
            answer = " ".join(rng.choice(WORDS) for _ in range(words))
            handle.write(json.dumps({"messages": [{"role": "user", "content": f"Write about topic {i}."},
                                                  {"role": "assistant", "content": answer}]}) + "\n")


def run(args, model: str, data: str, out: Path, packing: bool, balance: bool) -> dict:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(args.port),
           "--use_deepspeed", "--deepspeed_config_file", str(ROOT / "configs" / "ds" / "zero2.json"),
           str(ROOT / "finetune.py"), "--model_name_or_path", model, "--dataset_mixer_list", data, "1.0",
           "--output_dir", str(out), "--max_train_steps", str(args.steps), "--logging_steps", "1",
           "--per_device_train_batch_size", str(args.batch_size), "--gradient_accumulation_steps", "2",
           "--max_seq_length", str(args.max_seq_length), "--learning_rate", "1e-4", "--torch_dtype", args.dtype,
           "--dataset_local_cache_dir", str(out.parent / "cache"), "--balance_micro_batches", str(balance).lower()]
    if packing:
        cmd += ["--packing", "--max_tokens_per_batch", str(args.batch_size * args.max_seq_length // 2)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "DS_ACCELERATOR": "cpu"}
    subprocess.run(cmd, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in records if "loss" in r][args.warmup_steps:]
    tokens = steady[-1]["total_tokens"] - steady[0]["total_tokens"]
    seconds = steady[-1]["elapsed_s"] - steady[0]["elapsed_s"]
    return {"layout": "packed" if packing else "padded", "balanced": balance,
            "tokens_per_second": tokens / seconds,
            "rank_tokens_max_over_mean": sum(r["rank_tokens_max_over_mean"] for r in steady) / len(steady),
            "padding_ratio": sum(r["padding_ratio"] for r in steady) / len(steady),
            "final_loss": steady[-1]["loss"]}


def main() -> int:
    parser = WholeFlagParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_name_or_path", default=None, help="default: build the embedded default")
    parser.add_argument("--data", default=None, help="default: a generated long-tailed mix (--rows rows)")
    parser.add_argument("--rows", type=int, default=400)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup_steps", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--max_seq_length", type=int, default=2048)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--port", type=int, default=29731)
    args = parser.parse_args()
    print(json.dumps(cpu_line()))
    with tempfile.TemporaryDirectory() as tmp:
        model, data = args.model_name_or_path, args.data
        if model is None:
            from open_sft.embedded.factory import build_embedded_default

            model = str(build_embedded_default(Path(tmp) / "model", hidden_size=256, num_layers=4, num_heads=4))
        if data is None:
            data = str(Path(tmp) / "long_tailed.jsonl")
            long_tailed_mix(Path(data), args.rows, seed=0)
        for packing in (False, True):
            pair = [run(args, model, data, Path(tmp) / f"{packing}_{balance}", packing, balance)
                    for balance in (False, True)]
            pair[1]["speedup_over_shuffled"] = pair[1]["tokens_per_second"] / pair[0]["tokens_per_second"]
            for result in pair:
                print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
