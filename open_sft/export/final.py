"""The run's own export at the end of training, written by the main process: the model in Hugging Face layout
(full, or the LoRA adapter with its optional merge), the run report and the model card. A disk that fills while
writing them stops the run with the way out (the export is staged: --output_dir keeps what it held before)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from open_sft.export.model_card import write_model_card
from open_sft.durable import human_size
from open_sft.export.save import PLACED, save_lora, save_model
from open_sft.file_modes import share_as_umask
from open_sft.model.anatomy import is_peft_model
from open_sft.monitor.report import write_run_report
from open_sft.training.checkpoint import CHECKPOINTS, rerun_after_full_disk


def write_export(config: Any, trained_model: Any, trainer: Any, tokenizer: Any, output_dir: Path,
                 state_dict: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """Main process only. `trained_model`: the unwrapped model (a PeftModel under LoRA); `state_dict`: its gathered,
    checked weights (export.save.finite_state_dict); `trainer`: its metrics are closed before the report reads them."""
    placed: list[bool] = []  # the model's files are in output_dir: what fails after them is the report or card

    def what(exc: BaseException) -> str:
        if placed or getattr(exc, PLACED, False):
            return (f"the export to {output_dir} was left unfinished: the new model files are in place, not all of "
                    "the export's record, report and model card, and the run is not marked complete")
        return f"the model could not be exported to {output_dir} (which holds what it held before the export)"

    needs = f"the export needs about {human_size(export_bytes(trained_model, state_dict, dtype, config))}"
    with rerun_after_full_disk(output_dir, output_dir / CHECKPOINTS, what, needs=needs):
        state_dict = {k.removeprefix("model."): v for k, v in state_dict.items()}
        shard, flag = config.checkpoint.max_shard_size, config.checkpoint.save_dtype
        if is_peft_model(trained_model):  # a QLoRA merge is bf16 unless the flag says (its base was 4-bit)
            save_lora(trained_model, state_dict, tokenizer, output_dir, config.lora.merge_lora_on_save, shard,
                      dtype=None if config.lora.use_qlora and flag == "auto" else dtype)
        else:
            save_model(trained_model, state_dict, tokenizer, output_dir, max_shard_size=shard, dtype=dtype)
        placed.append(True)
        trainer.metrics.close()
        write_run_report(output_dir)
        write_model_card(output_dir)
        share_as_umask(output_dir)  # everything the run wrote, as the umask says (safetensors writes 0600)


def export_bytes(trained_model: Any, state_dict: dict[str, torch.Tensor], dtype: torch.dtype, config: Any) -> int:
    """About what the export's weights take on disk (what a full disk's message says the rerun needs): the weights
    in `dtype`, under LoRA the adapter's (and the merged model's with --merge_lora_on_save); not a checkpoint's
    size, which holds the optimizer's moments as well."""
    def size(tensors: Any) -> int:
        return sum(t.numel() * (dtype.itemsize if t.is_floating_point() else t.element_size()) for t in tensors)

    if not is_peft_model(trained_model):
        return size(state_dict.values())
    adapter = size(v for k, v in state_dict.items() if "lora_" in k)
    base = size(v for k, v in state_dict.items() if "lora_" not in k)
    return adapter + (base if config.lora.merge_lora_on_save else 0)
