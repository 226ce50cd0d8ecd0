"""A LoRA adapter merged into its base: W + (alpha/r)·B·A, from a run's gathered state dict (`--merge_lora_on_save`)
or offline from a saved adapter directory (`open_sft merge-lora ADAPTER OUT`, open_sft.export.merge_adapter).

The in-run merge works from the gathered full state dict, never from the live modules, because under ZeRO-3
those hold only shards. The one exception is QLoRA's 4-bit base weights, which are dequantized from their
modules: QLoRA never runs under DeepSpeed, so they are whole.
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import torch
from huggingface_hub import save_torch_state_dict
from peft import PeftModel
from peft.tuners.lora import LoraLayer, ParamWrapper
from peft.tuners.trainable_tokens.layer import TrainableTokensLayer

from open_sft.model.lora import ADAPTER, PEFT_PREFIX

MERGED_QLORA_DTYPE = torch.bfloat16


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


def _wide(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor in the dtype a merge computes in: fp32, or the tensor's own where it is wider (a float64 model)."""
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


def _lora_delta(layer: LoraLayer, name: str, state_dict: dict[str, torch.Tensor]) -> torch.Tensor:
    """scaling · B · A of one LoRA layer, in fp32 (or wider), in the base weight's layout."""
    lora_a = _wide(state_dict[f"{name}.lora_A.{ADAPTER}.weight"])
    lora_b = _wide(state_dict[f"{name}.lora_B.{ADAPTER}.weight"])
    delta = (lora_b @ lora_a) * layer.scaling[ADAPTER]
    return delta.T if getattr(layer, "fan_in_fan_out", False) else delta


def _parameter_delta(layer: ParamWrapper, name: str, state_dict: dict[str, torch.Tensor]) -> torch.Tensor:
    """The delta of a LoRA on a parameter (peft's ParamWrapper: an MoE's fused expert weights, a router's weight),
    computed by peft's own get_delta_weight (its layout of experts × rank) on the gathered factors, swapped in for
    the call: under ZeRO-3 the live ones are shards; an export's skeleton (on the meta device) has none, and
    it computes where the checkpoint's tensors are."""
    modules = (layer.lora_A[ADAPTER], layer.lora_B[ADAPTER])
    live = [module._parameters["weight"] for module in modules]
    try:
        for module, factor, part in zip(modules, live, "AB"):
            tensor = state_dict[f"{name}.lora_{part}.{ADAPTER}.weight"]
            module._parameters["weight"] = torch.nn.Parameter(
                _wide(tensor).to(tensor.device if factor.is_meta else factor.device), requires_grad=False)
        # peft moves the delta to the base parameter's device and casts it to its dtype: here it stays where the
        # factors are (an export's skeleton is on the meta device) and in fp32 or wider (a bf16 skeleton or frozen
        # base would round it to bf16 before the fp32 sum)
        wide = _wide(torch.empty(0, dtype=layer.get_param().dtype, device=modules[0].weight.device))
        layer.get_param = lambda: wide
        with torch.no_grad():
            return _wide(layer.get_delta_weight(ADAPTER)).cpu()
    finally:
        vars(layer).pop("get_param", None)
        for module, factor in zip(modules, live):
            module._parameters["weight"] = factor


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
    names = {id(module): name for name, module in model.named_modules()}
    for name, layer in model.named_modules():
        if isinstance(layer, ParamWrapper):  # the parameter sits on the module the wrapper (or wrappers) wrap
            key = f"{names[id(layer.get_base_layer())]}.{layer.parameter_name}"
            full[key] = _wide(full[key]) + _parameter_delta(layer, name, state_dict).to(full[key].device)
        elif isinstance(layer, LoraLayer):
            key = f"{name}.base_layer.weight"
            full[key] = _wide(full[key]) + _lora_delta(layer, name, state_dict)
        elif isinstance(layer, TrainableTokensLayer):  # the trained rows of added tokens replace the base's
            key, rows = f"{name}.base_layer.weight", f"{name}.trainable_tokens_delta.{ADAPTER}"
            if key in full and rows in state_dict:
                index = torch.tensor(layer.token_indices[ADAPTER], device=full[key].device)
                full[key] = full[key].index_copy(0, index, state_dict[rows].to(full[key].dtype))
    merged = {}
    for key, tensor in full.items():
        if ".lora_" in key or ".trainable_tokens_delta." in key:
            continue
        clean = key.removeprefix(PEFT_PREFIX).replace(".token_adapter.base_layer.", ".")
        while ".base_layer." in clean:  # nested wrappers (two parameters of one experts module) nest the name
            clean = clean.replace(".base_layer.", ".")
        merged[clean] = tensor.to(dtypes[key]).contiguous()
    return merged


def write_merged_model(model: PeftModel, merged: dict[str, torch.Tensor], directory: Path,
                        max_shard_size: str | int) -> None:
    config = copy.deepcopy(model.get_base_model().config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.use_cache = True
    config.dtype = next(iter(merged.values())).dtype
    config.save_pretrained(directory)
    save_torch_state_dict(merged, directory, max_shard_size=max_shard_size)
