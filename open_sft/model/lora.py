"""LoRA and QLoRA through peft: the adapter config, the 4-bit base, and what a LoRA run saves.

Saving works from the gathered full state dict (keys as in `PeftModel.state_dict()`, e.g.
`base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight`), never from the live
modules, because under ZeRO-3 those hold only shards. The one exception is QLoRA's 4-bit base
weights, which are dequantized from their modules: QLoRA never runs under DeepSpeed, so they are whole.

Output directory of a LoRA / QLoRA run:
    adapter_config.json, adapter_model.safetensors   the adapter (peft format; base = --model_name_or_path)
    tokenizer files, generation_config.json
    merged/                                          only with --merge_lora_on_save: the full model
                                                     (config.json, model*.safetensors, tokenizer, generation
                                                     config) with W + (alpha/r)·B·A; a QLoRA base is
                                                     dequantized and the merge saved in bf16
The top level has no config.json: `AutoModelForCausalLM.from_pretrained(output_dir)` loads the base
named in adapter_config.json and applies the adapter, and it would do so on top of a merged model that
sat beside the adapter (the delta counted twice), so the merged model lives in its own directory.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import os
import shutil
from pathlib import Path
from typing import Optional

import torch

# bitsandbytes' CPU backend warns on import that an optional fused kernel could not be fetched from the
# Hub (`kernels` package); training falls back to its built-in CPU kernels, so keep the log quiet.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

from peft import LoraConfig, PeftModel, get_peft_model, prepare_model_for_kbit_training  # noqa: E402
from peft.tuners.lora import LoraLayer  # noqa: E402
from transformers import BitsAndBytesConfig, PreTrainedModel, PreTrainedTokenizerBase  # noqa: E402

from open_sft.config.args import LoraArguments  # noqa: E402
from open_sft.errors import UserError  # noqa: E402

logger = logging.getLogger(__name__)

ADAPTER = "default"  # peft's adapter name; saved files drop it from the keys
PEFT_PREFIX = "base_model.model."  # PeftModel state-dict keys = this + the base model's keys
MERGED_QLORA_DTYPE = torch.bfloat16
MERGED_DIR = "merged"  # --merge_lora_on_save writes the full model here, inside --output_dir


def uses_lora(args: LoraArguments) -> bool:
    return args.use_lora or args.use_qlora


def check_qlora_supported(args: LoraArguments, under_deepspeed: bool) -> None:
    """QLoRA runs in one process or under DDP; DeepSpeed cannot shard bitsandbytes' packed 4-bit weights."""
    if not args.use_qlora:
        return
    if under_deepspeed:
        raise UserError(
            "--use_qlora does not work under DeepSpeed: ZeRO flattens and partitions parameters, and "
            "bitsandbytes' packed 4-bit weights (with their quantization state) cannot be partitioned or cast. "
            "Run QLoRA in one process (python finetune.py ...) or with DDP (accelerate launch --multi_gpu "
            "--num_processes N finetune.py ...), or use --use_lora under DeepSpeed"
        )
    if importlib.util.find_spec("bitsandbytes") is None:
        raise UserError("--use_qlora needs bitsandbytes>=0.50 (it has a CPU backend): pip install 'open_sft[qlora]'")


def quantization_config(args: LoraArguments) -> Optional[BitsAndBytesConfig]:
    """4-bit NF4 with double quantization and bf16 compute, or None without --use_qlora."""
    if not args.use_qlora:
        return None
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.bfloat16)


def lora_config(args: LoraArguments) -> LoraConfig:
    targets = args.lora_target_modules
    return LoraConfig(
        r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout, bias="none",
        target_modules="all-linear" if targets == ["all-linear"] else list(targets), task_type="CAUSAL_LM",
    )


def apply_lora(model: PreTrainedModel, args: LoraArguments, gradient_checkpointing: bool) -> PeftModel:
    """Freeze the base model and inject LoRA adapters in place; returns the PeftModel."""
    if args.use_qlora:
        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=gradient_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False},
        )
    try:
        peft_model = get_peft_model(model, lora_config(args))
    except ValueError as exc:
        raise UserError(
            f"--lora_target_modules {' '.join(args.lora_target_modules)}: {exc}; name linear layers of the model "
            "(e.g. q_proj v_proj) or use all-linear"
        ) from exc
    from open_sft.model.load import param_numel

    trainable = sum(param_numel(p) for p in peft_model.parameters() if p.requires_grad)
    total = sum(param_numel(p) for p in peft_model.parameters())
    logger.info("%s: %d trainable adapter parameters of %d (%.3f%%)", "QLoRA" if args.use_qlora else "LoRA",
                trainable, total, 100 * trainable / max(total, 1))
    return peft_model


def is_peft_model(model: torch.nn.Module) -> bool:
    return isinstance(model, PeftModel)


def _dequantized_4bit_weights(model: PeftModel) -> dict[str, torch.Tensor]:
    """`<module>.weight` → fp32 dequantized weight, for every bitsandbytes 4-bit linear layer."""
    if importlib.util.find_spec("bitsandbytes") is None:
        return {}
    import bitsandbytes as bnb

    out = {}
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            weight = bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state)
            out[f"{name}.weight"] = weight.float().cpu()
    return out


def _lora_delta(layer: LoraLayer, name: str, state_dict: dict[str, torch.Tensor]) -> torch.Tensor:
    """scaling · B · A of one LoRA layer, in fp32, in the base weight's layout."""
    lora_a = state_dict[f"{name}.lora_A.{ADAPTER}.weight"].float()
    lora_b = state_dict[f"{name}.lora_B.{ADAPTER}.weight"].float()
    delta = (lora_b @ lora_a) * layer.scaling[ADAPTER]
    return delta.T if getattr(layer, "fan_in_fan_out", False) else delta


def merged_state_dict(model: PeftModel, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base model's state dict (its own key names) with every adapter merged: W + (alpha/r)·B·A.

    `state_dict` is the gathered PeftModel state dict. A QLoRA base is dequantized first and the
    result is bf16; otherwise each tensor keeps the dtype it was trained in.
    """
    dequantized = _dequantized_4bit_weights(model)
    quantized = tuple(f"{key}." for key in dequantized)  # bitsandbytes' quant-state entries
    full = {k: v for k, v in state_dict.items() if isinstance(v, torch.Tensor) and not k.startswith(quantized)}
    full.update(dequantized)
    dtypes = {k: (MERGED_QLORA_DTYPE if dequantized else v.dtype) for k, v in full.items()}
    for name, layer in model.named_modules():
        if isinstance(layer, LoraLayer):
            key = f"{name}.base_layer.weight"
            full[key] = full[key].float() + _lora_delta(layer, name, state_dict)
    merged = {}
    for key, tensor in full.items():
        if ".lora_" in key:
            continue
        clean = key.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")
        merged[clean] = tensor.to(dtypes[key]).contiguous()
    return merged


def _write_generation_config(model: PeftModel, tokenizer: PreTrainedTokenizerBase, directory: Path) -> None:
    from open_sft.export.save import end_of_turn_ids

    generation = copy.deepcopy(model.get_base_model().generation_config)
    eot = end_of_turn_ids(tokenizer)
    generation.eos_token_id = eot[0] if len(eot) == 1 else eot
    generation.pad_token_id = tokenizer.pad_token_id
    if tokenizer.bos_token_id is not None:
        generation.bos_token_id = tokenizer.bos_token_id
    generation.save_pretrained(directory)


def _write_merged_model(model: PeftModel, merged: dict[str, torch.Tensor], directory: Path,
                        max_shard_size: str | int) -> None:
    from huggingface_hub import save_torch_state_dict

    config = copy.deepcopy(model.get_base_model().config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.use_cache = True
    config.dtype = next(iter(merged.values())).dtype
    config.save_pretrained(directory)
    save_torch_state_dict(merged, directory, max_shard_size=max_shard_size)


def save_lora(model: PeftModel, state_dict: dict[str, torch.Tensor], tokenizer: PreTrainedTokenizerBase,
              output_dir: Path, merge: bool, max_shard_size: str | int = "5GB") -> None:
    """Adapter (+ merged model with `merge`), tokenizer and generation config; main process only.

    Written to a staging directory first and moved into place, so a crash never leaves half an export.
    """
    staging = output_dir / ".export.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    model.save_pretrained(staging, state_dict=state_dict, safe_serialization=True)
    (staging / "README.md").unlink(missing_ok=True)  # peft's stub card; open_sft.export.model_card writes the real one
    directories = [staging]
    if merge:
        _write_merged_model(model, merged_state_dict(model, state_dict), staging / MERGED_DIR, max_shard_size)
        directories.append(staging / MERGED_DIR)
    for directory in directories:
        tokenizer.save_pretrained(directory)
        _write_generation_config(model, tokenizer, directory)
    shutil.rmtree(output_dir / MERGED_DIR, ignore_errors=True)  # a stale merge must not outlive this run
    for item in staging.iterdir():
        os.replace(item, output_dir / item.name)
    staging.rmdir()
    logger.info("saved the LoRA adapter%s to %s", " and the merged model" if merge else "", output_dir)


def merge_adapter_dir(adapter_dir: Path, output_dir: Path, dtype: str = "bfloat16",
                      base_model: Optional[str] = None) -> Path:
    """Offline merge of a saved adapter into its base: `python -m open_sft.model.lora merge ADAPTER OUT`.
    Uses peft's merge_and_unload (the live modules are whole here: no DeepSpeed)."""
    import json

    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config_file = adapter_dir / "adapter_config.json"
    if not config_file.exists():
        raise UserError(f"{config_file} not found; pass the --output_dir of a --use_lora/--use_qlora run")
    base = base_model or json.loads(config_file.read_text()).get("base_model_name_or_path")
    if not base:
        raise UserError(f"{config_file} names no base model; pass --base_model")
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[dtype]
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch_dtype)
    merged = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    output_dir.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(output_dir, safe_serialization=True)
    AutoTokenizer.from_pretrained(adapter_dir).save_pretrained(output_dir)
    return output_dir


def main(argv: Optional[list[str]] = None) -> int:
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m open_sft.model.lora")
    commands = parser.add_subparsers(dest="command", required=True)
    merge = commands.add_parser("merge", help="merge a LoRA adapter into its base model and save the full model")
    merge.add_argument("adapter_dir", type=Path)
    merge.add_argument("output_dir", type=Path)
    merge.add_argument("--dtype", choices=["bfloat16", "float32", "float16"], default="bfloat16")
    merge.add_argument("--base_model", default=None, help="default: base_model_name_or_path of adapter_config.json")
    args = parser.parse_args(argv)
    try:
        print(merge_adapter_dir(args.adapter_dir, args.output_dir, args.dtype, args.base_model))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
