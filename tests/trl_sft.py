"""TRL's SFTTrainer on an open_sft run's own tokenized cache (run.json's dataset_cache_path: its input_ids and
labels), so both sides train the same tokens: what tests/integration/test_trl_parity.py runs, in a process of its
own (the Trainer sets up accelerate's process-wide state and seeds, which the test process keeps out of).

One JSON argument, a list of trainings (one process: TRL's imports once), each with "model", "cache", "out",
optionally "lora" (peft LoraConfig's fields: TRL + PEFT trains the adapter its peft_config makes) and SFTConfig's
fields. Each writes OUT/log.json (the Trainer's per-step log_history) and OUT/final.safetensors (the trained weights;
a LoRA run's adapter, its keys as peft saves them); nothing else is saved."""

from __future__ import annotations

import json
import sys

import datasets
import torch
from peft import LoraConfig, get_peft_model_state_dict
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer


def main(settings: dict) -> None:
    model_dir, cache, out = settings.pop("model"), settings.pop("cache"), settings.pop("out")
    lora = settings.pop("lora", None)
    rows = datasets.load_from_disk(cache).select_columns(["input_ids", "labels"])
    config = SFTConfig(output_dir=out, report_to="none", save_strategy="no", use_cpu=True, bf16=False, fp16=False,
                       max_length=None, logging_steps=1, **settings)
    trainer = SFTTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), args=config,
                         train_dataset=rows, processing_class=AutoTokenizer.from_pretrained(model_dir),
                         peft_config=LoraConfig(task_type="CAUSAL_LM", **lora) if lora else None)
    trainer.train()
    with open(f"{out}/log.json", "w") as f:
        json.dump(trainer.state.log_history, f)
    weights = get_peft_model_state_dict(trainer.model) if lora else trainer.model.state_dict()
    save_file({k: v.detach().contiguous() for k, v in weights.items()}, f"{out}/final.safetensors")


if __name__ == "__main__":
    for training in json.loads(sys.argv[1]):
        main(training)
