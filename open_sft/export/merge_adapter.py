"""`open_sft merge-lora ADAPTER OUT`: a saved LoRA adapter merged into its base offline, written as
--merge_lora_on_save writes merged/ (open_sft.export.lora_merge's merge, open_sft.export.save's files)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Optional

from peft import PeftModel

from open_sft.config.whole_flags import WholeFlagParser
from open_sft.errors import UserError
from open_sft.export.lora_merge import merged_state_dict, write_merged_model
from open_sft.export.run_dir import (adapter_base, base_loading, fit_base_to_adapter, load_adapter_base,
                                     load_saved_tokenizer)
from open_sft.export.save import cast_floating, save_dtype, save_tokenizer, staged_export, write_generation_config
from open_sft.export.target import check_target
from open_sft.export.template_kwargs import run_record
from open_sft.file_modes import writable_dir_problem
from open_sft.model.lora_targets import linear_targets_kept

COMMAND = "open_sft merge-lora"


def merge_adapter_dir(adapter_dir: Path, output_dir: Path, dtype: str = "auto",
                      base_model: Optional[str] = None, max_shard_size: str | int = "5GB") -> Path:
    """Offline merge of a saved adapter into its base: `open_sft merge-lora ADAPTER OUT`. The merge, files and card
    are --merge_lora_on_save's (merged_state_dict, write_merged_model, the run's generation config and tokenizer),
    in `dtype` (auto: the base's stored dtype, as the run's export); a QLoRA run's adapter (run.json says so) is
    merged into the 4-bit NF4 base it trained against, dequantized, and is bf16 under auto, as its merged/: the
    unquantized base would give another model than the one training saw; a base the run resized (added tokens) is
    resized to the adapter's tokenizer first (open_sft.export.run_dir.fit_base_to_adapter). `output_dir` is new, empty
    or an earlier output of these commands (open_sft.export.target), written through a staging directory."""
    from open_sft.export.model_card import render_model_card

    config_file = adapter_dir / "adapter_config.json"
    if not config_file.exists():
        what = ("does not exist" if not adapter_dir.exists() else "is a file" if not adapter_dir.is_dir() else
                "holds a full model (config.json), not a LoRA adapter: nothing to merge" if
                (adapter_dir / "config.json").is_file() else "holds no adapter_config.json")
        raise UserError(f"{adapter_dir} {what}; pass the --output_dir of a --use_lora/--use_qlora run")
    why = writable_dir_problem(output_dir)
    if why:
        raise UserError(f"{output_dir}: {why}; pass a directory for the merged model (it is created if missing)")
    check_target(output_dir, COMMAND, {"the adapter's directory": str(adapter_dir),
                                       "the base model": adapter_base(adapter_dir, base_model)})
    loading = base_loading(adapter_dir)
    model, _ = load_adapter_base(adapter_dir, base_model, **loading)
    qlora_auto = "quantization_config" in loading and dtype == "auto"  # merged_state_dict's bf16, as the run's
    torch_dtype = None if qlora_auto else save_dtype(dtype, model.config)
    tokenizer = load_saved_tokenizer(adapter_dir)
    fit_base_to_adapter(model, adapter_dir, tokenizer)
    with linear_targets_kept():  # the adapters of shared experts and dense MLPs too (open_sft.model.lora_targets)
        peft_model = PeftModel.from_pretrained(model, str(adapter_dir))
    # on the CPU, as a run's gathered state dict is: a QLoRA base on the GPU (base_loading's) is dequantized to it
    merged = merged_state_dict(peft_model, {k: v.cpu() for k, v in peft_model.state_dict().items()})
    created = not output_dir.exists()
    try:
        with staged_export(output_dir, written_by=COMMAND) as staging:  # a failed merge leaves OUT as it was
            write_merged_model(peft_model, cast_floating(merged, torch_dtype) if torch_dtype else merged, staging,
                               max_shard_size)
            save_tokenizer(tokenizer, staging)
            write_generation_config(peft_model.get_base_model().generation_config, tokenizer, staging)
            (staging / "README.md").write_text(render_model_card(adapter_dir, merged=True))
            if (record := run_record(adapter_dir)) is not None:  # generate/chat render with the run's variables
                shutil.copy2(record, staging / "run.json")
    except BaseException:
        if created:
            shutil.rmtree(output_dir, ignore_errors=True)
        raise
    return output_dir


def main(argv: Optional[list[str]] = None, prog: str = "open_sft merge-lora") -> int:
    parser = WholeFlagParser(prog=prog, description="merge a LoRA adapter into its base model and save the "
                             "full model")
    parser.add_argument("adapter_dir", type=Path)
    parser.add_argument("output_dir", type=Path)
    parser.add_argument("--dtype", choices=["auto", "bfloat16", "float32", "float16"], default="auto",
                        help="auto (default): the base checkpoint's stored dtype, as --merge_lora_on_save writes it")
    parser.add_argument("--base_model", default=None, help="default: base_model_name_or_path of adapter_config.json")
    args = parser.parse_args(argv)
    try:
        print(merge_adapter_dir(args.adapter_dir, args.output_dir, args.dtype, args.base_model))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
