"""The run's own export at the end of training, written by the main process: the model in Hugging Face layout
(full, or the LoRA adapter with its optional merge), the run report and the model card. A disk that fills while
writing them stops the run with the way out (the export is staged: --output_dir keeps what it held before)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from open_sft.export.model_card import write_model_card
from open_sft.export.save import save_lora, save_model
from open_sft.file_modes import share_as_umask
from open_sft.model.anatomy import is_peft_model
from open_sft.monitor.report import write_run_report
from open_sft.training.checkpoint import CHECKPOINTS, rerun_after_full_disk


def write_export(config: Any, trained_model: Any, trainer: Any, tokenizer: Any, output_dir: Path,
                 state_dict: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """Main process only. `trained_model`: the unwrapped model (a PeftModel under LoRA); `state_dict`: its gathered,
    checked weights (export.save.finite_state_dict); `trainer`: its metrics are closed before the report reads them."""
    what = f"the model could not be exported to {output_dir} (which holds what it held before the export)"
    with rerun_after_full_disk(output_dir, output_dir / CHECKPOINTS, what):
        state_dict = {k.removeprefix("model."): v for k, v in state_dict.items()}
        shard, flag = config.checkpoint.max_shard_size, config.checkpoint.save_dtype
        if is_peft_model(trained_model):  # a QLoRA merge is bf16 unless the flag says (its base was 4-bit)
            save_lora(trained_model, state_dict, tokenizer, output_dir, config.lora.merge_lora_on_save, shard,
                      dtype=None if config.lora.use_qlora and flag == "auto" else dtype)
        else:
            save_model(trained_model, state_dict, tokenizer, output_dir, max_shard_size=shard, dtype=dtype)
        trainer.metrics.close()
        write_run_report(output_dir)
        write_model_card(output_dir)
        share_as_umask(output_dir)  # everything the run wrote, as the umask says (safetensors writes 0600)
