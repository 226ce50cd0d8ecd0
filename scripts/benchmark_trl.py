#!/usr/bin/env python
"""One TRL SFTTrainer run for scripts/benchmark.py, in TRL's own environment (its --trl_python): the settings come as
one JSON argument, one JSON line of figures goes to stdout (the median step's tokens/s, the mean's, peak memory
allocated and reserved).

TRL's fastest configuration for packed rows is padding-free packing (every micro-batch one flattened row, examples
told apart by position ids) with an attention that reads the position ids: `attention` "flex_attention"
(transformers' block mask, offline), "varlen" (torch's variable-length flash attention, registered with
transformers' AttentionInterface: the kernel open_sft's packed rows use on a GPU, so both sides attend with the
same kernel), or "sdpa" (a dense block-diagonal mask over the whole flattened row: TRL's default, kept for
reference). `peft` "lora" / "qlora": TRL + PEFT with LoRA on every linear layer (QLoRA: the base in 4-bit NF4 with
double quantization, bf16 compute), as open_sft's --use_lora / --use_qlora.

`--compare_loss RUN_DIR [--trl_precision fp32|autocast|bf16_weights] [--fp32_adapters] [--out FILE]`: TRL's
SFTTrainer trains what a finished one-process open_sft run (launched with OPEN_SFT_RECORD_DATA_ORDER=1 and
--logging_steps 1, run from the directory its --model_name_or_path is relative to) trained: its tokenized cache (the
same input_ids and labels), each step's examples as one batch (padding-free under --packing), the run's AdamW
settings, schedule, clipping and seed, the model in fp32 (`fp32`), under bf16 autocast (`autocast`, TRL's bf16=True)
or loaded in bf16 (`bf16_weights`); by default as the run computed (fp32, or autocast for a bf16 run; an fp16 run is
refused without --trl_precision: TRL has no CPU fp16 mode). A --use_lora /
--use_qlora run is trained by TRL + PEFT with the run's adapter_config.json as its peft_config (what the run adapted,
its rank, alpha and dropout; a run that added tokens is refused); QLoRA's base loaded as open_sft loads it (4-bit NF4,
double quantization, the run's compute dtype, the other weights fp32), and `--fp32_adapters` keeps TRL's adapters
fp32 as open_sft does (TRL casts them to bf16; refused for a full fine-tune, whose whole model it would cast). Both sides draw LoRA's A matrices right after seeding torch with the
run's seed (TRL's set_seed before get_peft_model), so the adapters start the same. Prints each step's loss beside
the run's and the largest relative difference."""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # open_sft from this checkout
# before trl imports peft (so bitsandbytes): the package keeps bitsandbytes from fetching its CPU kernel from the Hub
# and transformers from kernelizing with Hub kernels (LOCAL_KERNELS, USE_HUB_KERNELS), as in the run compared
import open_sft  # noqa: E402,F401


def _attention(name: str, root: str) -> str:
    """The attn_implementation to load the model with ("varlen": registered here, from open_sft's checkout)."""
    if name != "varlen":
        return name
    sys.path.insert(0, root)
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from open_sft.model.packed_attention import packed_sdpa

    AttentionInterface.register("open_sft_varlen", packed_sdpa(varlen=True))
    AttentionMaskInterface.register("open_sft_varlen", sdpa_mask)
    return "open_sft_varlen"


def _model(s: dict):
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    kwargs = {"attn_implementation": _attention(s["attention"], s["root"])}
    if s["peft"] == "qlora":
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16)
    # LoRA's frozen base in bf16 (PEFT's usual setup: it needs no fp32 master copy); full training keeps fp32
    # master weights under bf16 autocast, as open_sft does
    dtype = torch.bfloat16 if s["peft"] and s["bf16"] else torch.float32
    return AutoModelForCausalLM.from_pretrained(s["model"], dtype=dtype, **kwargs)


def main() -> None:
    import torch
    from datasets import load_dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    s = json.loads(sys.argv[1])
    torch.set_num_threads(s["threads"])
    gpu = torch.cuda.is_available()
    tokenizer = AutoTokenizer.from_pretrained(s["model"])
    model = _model(s)
    data = load_dataset("json", data_files=s["data"], split="train").select_columns(["messages"])

    class Clock(TrainerCallback):
        def __init__(self):
            self.times = []

        def on_step_end(self, args, state, control, **kwargs):
            if gpu:
                torch.cuda.synchronize()
            self.times.append(time.perf_counter())

    clock = Clock()
    peft_config = None
    if s["peft"]:
        from peft import LoraConfig

        peft_config = LoraConfig(r=s["lora_rank"], lora_alpha=2 * s["lora_rank"], lora_dropout=0.0,
                                 target_modules="all-linear", task_type="CAUSAL_LM")
    config = SFTConfig(output_dir="/tmp/trl_bench", max_steps=s["steps"], per_device_train_batch_size=s["batch_size"],
                       max_length=s["max_length"], packing=s["packing"], padding_free=s["packing"], bf16=s["bf16"],
                       logging_steps=1, save_strategy="no", report_to=[], assistant_only_loss=s["assistant_only"],
                       dataloader_num_workers=0, use_cpu=not gpu, gradient_checkpointing=s["gradient_checkpointing"],
                       use_liger_kernel=s["liger"], torch_compile=s["compile"])
    trainer = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer,
                         callbacks=[clock], peft_config=peft_config)
    tokens = []
    compute_loss = trainer.compute_loss

    def counting(model, inputs, *args, **kwargs):
        mask = inputs.get("attention_mask")
        tokens.append(int(mask.sum()) if mask is not None else int(inputs["input_ids"].numel()))
        return compute_loss(model, inputs, *args, **kwargs)

    trainer.compute_loss = counting
    trainer.train()
    t, warm = clock.times, s["warmup"]
    rates = sorted(tokens[i] / (t[i] - t[i - 1]) for i in range(warm + 1, len(t)))  # the median step, as open_sft's
    n = len(rates)
    if gpu:
        peaks = {"peak_gib": torch.cuda.max_memory_allocated() / 2**30,
                 "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30, "peak_of": "GPU memory allocated"}
    else:
        peaks = {"peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "peak_of": "process RSS"}
    print(json.dumps({"tokens_per_second": rates[n // 2] if n % 2 else (rates[n // 2 - 1] + rates[n // 2]) / 2,
                      "mean_tokens_per_second": sum(tokens[warm + 1:]) / (t[-1] - t[warm]), "steps_timed": n,
                      **peaks}))


def _step_examples(run_dir: str, rows) -> list[list[int]]:
    """The examples of each of the run's steps: its recorded order cut where each step's trained tokens add up."""
    order = json.load(open(f"{run_dir}/data_order.rank0.json"))["example_indices"]
    totals = [m["train_tokens"] for m in map(json.loads, open(f"{run_dir}/metrics.jsonl")) if "loss" in m]
    trained = [sum(label != -100 for label in labels[1:]) for labels in rows["labels"]]
    steps, at, before = [], 0, 0
    for total in totals:
        step, got = [], 0
        while got < total - before:
            step.append(order[at])
            got, at = got + trained[order[at]], at + 1
        if got != total - before:
            sys.exit(f"{run_dir}: the recorded order does not add up to step {len(steps) + 1}'s trained tokens "
                     "(one process, --logging_steps 1 and OPEN_SFT_RECORD_DATA_ORDER=1 are needed)")
        steps.append(step)
        before = total
    return steps


def _loading(run: dict, precision: str) -> dict:
    """from_pretrained's arguments for --compare_loss's model: its dtype, and a QLoRA run's quantization as open_sft
    loads it (open_sft.model.lora.quantization_config, the run's compute dtype; the other weights fp32)."""
    import torch

    from open_sft.config.args import LoraArguments
    from open_sft.model.lora import quantization_config

    kwargs = {"dtype": torch.bfloat16 if precision == "bf16_weights" else torch.float32}
    if run["args"]["lora"]["use_qlora"]:
        kwargs["quantization_config"] = quantization_config(LoraArguments(use_qlora=True),
                                                            fp16=run["compute_dtype"] == "torch.float16")
    return kwargs


def _trl_precision(args, run: dict) -> str:
    """--trl_precision, by default the run's (fp32, or autocast for a bf16 run); exits where the flags do not fit the
    run: --fp32_adapters on a run without adapters (it would cast the whole model to fp32), an fp16 run without
    --trl_precision (TRL on the CPU has no fp16 mode, so no default is the run's precision)."""
    lora = run["args"]["lora"]
    if args.fp32_adapters and not (lora["use_lora"] or lora["use_qlora"]):
        sys.exit(f"--fp32_adapters: {args.compare_loss} is a full fine-tune, with no adapters to keep fp32 (the "
                 "flag would cast the whole model to fp32); drop it, or pass --trl_precision fp32")
    if args.trl_precision is None and run["compute_dtype"] == "torch.float16":
        sys.exit(f"--compare_loss {args.compare_loss}: the run computed in fp16, which TRL has no CPU mode for; "
                 "pass --trl_precision fp32 or autocast (bf16) to compare it against that precision")
    return args.trl_precision or ("autocast" if run["compute_dtype"] == "torch.bfloat16" else "fp32")


def _compare_model(run_dir: str, run: dict, precision: str):
    """The model TRL trains for --compare_loss, and the peft LoraConfig of a LoRA / QLoRA run (else None): the run's
    own adapter_config.json, what it adapted (all-linear resolved to module names) with its rank, alpha and dropout."""
    from transformers import AutoModelForCausalLM

    lora = run["args"]["lora"]
    model = AutoModelForCausalLM.from_pretrained(run["args"]["model"]["model_name_or_path"],
                                                 **_loading(run, precision))
    if not (lora["use_lora"] or lora["use_qlora"]):
        return model, None
    from peft import LoraConfig

    config = LoraConfig.from_pretrained(run_dir)
    if config.trainable_token_indices:
        sys.exit(f"--compare_loss {run_dir}: the run added tokens and trained their rows (trainable_token_indices), "
                 "which open_sft starts at the mean of the trained rows and TRL would not have; compare a run that "
                 "adds no tokens")
    config.inference_mode = False  # saved adapters say True: their weights frozen
    return model, config


def compare_loss(argv: list[str]) -> None:
    from open_sft.config.whole_flags import WholeFlagParser

    parser = WholeFlagParser("benchmark_trl.py --compare_loss")
    parser.add_argument("--compare_loss", required=True, metavar="RUN_DIR")
    parser.add_argument("--trl_precision", choices=("fp32", "autocast", "bf16_weights"),
                        help="default: the run's, fp32 or (bf16 runs) autocast")
    parser.add_argument("--fp32_adapters", action="store_true",
                        help="LoRA/QLoRA runs: TRL's adapters kept fp32, as open_sft keeps them (TRL casts them to "
                             "bf16)")
    parser.add_argument("--out", help="a JSON file for both sides' per-step losses and grad norms")
    args = parser.parse_args(argv)  # a mistyped flag is refused before TRL is imported
    import datasets
    from torch.utils.data import DataLoader
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    run = json.load(open(f"{args.compare_loss}/run.json"))
    args.trl_precision = _trl_precision(args, run)
    train, model_args = run["args"]["train"], run["args"]["model"]
    if run["schedule"]["warmup_steps"] or run["world_size"] != 1:
        sys.exit("--compare_loss takes a one-process run without warmup (TRL's warmup starts at lr 0 by design, "
                 "README \"Batching, schedules and the loss\")")
    if train.get("final_lr_ratio") is not None or train["lr_scheduler_type"] == "wsd":
        sys.exit("--compare_loss takes the schedules TRL has: no --final_lr_ratio, no wsd")
    rows = datasets.load_from_disk(run["dataset_cache_path"]).select_columns(["input_ids", "labels"])
    steps = _step_examples(args.compare_loss, rows)
    model, peft_config = _compare_model(args.compare_loss, run, args.trl_precision)
    config = SFTConfig(output_dir="/tmp/benchmark_trl_compare", report_to="none", save_strategy="no", use_cpu=True,
                       bf16=args.trl_precision != "fp32", max_length=None, logging_steps=1, max_steps=len(steps),
                       learning_rate=train["learning_rate"], lr_scheduler_type=train["lr_scheduler_type"],
                       warmup_steps=0, weight_decay=train["weight_decay"], max_grad_norm=train["clip_grad_norm"] or 0.0,
                       adam_beta1=train.get("adam_beta1", 0.9), adam_beta2=train.get("adam_beta2", 0.999),
                       adam_epsilon=train.get("adam_epsilon", 1e-8),
                       seed=train["seed"], padding_free=train["packing"], dataloader_num_workers=0)
    trainer = SFTTrainer(model=model, args=config, train_dataset=rows, peft_config=peft_config,
                         processing_class=AutoTokenizer.from_pretrained(model_args["model_name_or_path"]))
    trainer.get_train_dataloader = lambda: DataLoader(rows, batch_sampler=steps, collate_fn=trainer.data_collator)
    if args.fp32_adapters:  # before train() builds the optimizer over them
        for param in trainer.model.parameters():
            if param.requires_grad:
                param.data = param.data.float()
    trainer.train()
    theirs = [entry for entry in trainer.state.log_history if "loss" in entry]
    ours = [m for m in map(json.loads, open(f"{args.compare_loss}/metrics.jsonl")) if "loss" in m]
    print(f"{'step':>4} {'open_sft':>12} {'TRL ' + args.trl_precision:>14} {'relative':>10}")
    worst = 0.0
    for m, entry in zip(ours, theirs):
        relative = abs(m["loss"] - entry["loss"]) / abs(entry["loss"])
        worst = max(worst, relative)
        print(f"{m['step']:4d} {m['loss']:12.6f} {entry['loss']:14.6f} {relative:10.2e}")
    print(f"largest relative loss difference over {len(theirs)} steps: {worst:.2e}")
    if args.out:
        json.dump({"open_sft": {"loss": [m["loss"] for m in ours], "grad_norm": [m["grad_norm"] for m in ours]},
                   "trl": {"loss": [e["loss"] for e in theirs], "grad_norm": [e["grad_norm"] for e in theirs]},
                   "trl_precision": args.trl_precision}, open(args.out, "w"))


def cli(argv: list[str]) -> None:
    """benchmark.py's one JSON argument runs main(); any other command line is --compare_loss's, read whole."""
    if len(argv) == 1 and argv[0].lstrip().startswith("{"):
        main()
    else:
        compare_loss(argv)


if __name__ == "__main__":
    cli(sys.argv[1:])
