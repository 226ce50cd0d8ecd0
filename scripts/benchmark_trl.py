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
double quantization, bf16 compute), as open_sft's --use_lora / --use_qlora."""

from __future__ import annotations

import json
import resource
import sys
import time


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


if __name__ == "__main__":
    main()
