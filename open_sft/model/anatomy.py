"""A model's anatomy: the transformers model inside a peft one, its decoder (the backbone) and decoder layers,
and what a parameter holds also when ZeRO-3 has partitioned it. A leaf: it imports nothing else of open_sft's, so
loading, LoRA, the loss and every parallelism can ask it."""

from __future__ import annotations

import sys

import torch
from torch import nn


def causal_lm_of(model: nn.Module) -> nn.Module:
    """The transformers model of a model or of a peft model around it (peft injects its adapters in place)."""
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


def backbone_of(causal_lm: nn.Module) -> nn.Module:
    """The decoder a causal LM's head sits on: the attribute its base_model_prefix names, or `model` where the
    class names another (Llama4ForCausalLM's prefix is language_model, its decoder `model`)."""
    backbone = getattr(causal_lm, causal_lm.base_model_prefix, None)
    if backbone is None or backbone is causal_lm:
        backbone = getattr(causal_lm, "model", None)
    if not isinstance(backbone, nn.Module):
        raise ValueError(f"{type(causal_lm).__name__} has no decoder at .{causal_lm.base_model_prefix} or .model")
    return backbone


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a transformers causal LM (or a peft model around one)."""
    causal_lm = causal_lm_of(model)
    try:
        backbone = backbone_of(causal_lm)
    except ValueError:
        backbone = None
    layers = getattr(backbone, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise ValueError(f"{type(causal_lm).__name__} has no decoder layers at "
                         f"{causal_lm.base_model_prefix}.layers to compile")
    return layers


def is_peft_model(model: torch.nn.Module) -> bool:
    # Without peft imported no PeftModel exists, and importing peft only to say so (it imports bitsandbytes, which
    # sets up torch.compile) would cost every run without LoRA seconds of CPU per rank at its end.
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def param_shape(param: torch.Tensor) -> torch.Size:
    """A parameter's full shape, also when ZeRO-3 has partitioned it (its own tensor is then empty)."""
    return getattr(param, "ds_shape", param.shape)


def param_numel(param: torch.Tensor) -> int:
    return getattr(param, "ds_numel", None) or param.numel()

