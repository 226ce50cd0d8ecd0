"""The LM head as the losses call it: which heads a fused loss can take, the dtype its matmul runs in, and a loss
run as the head's own forward (so its hooks fire)."""

from __future__ import annotations

import torch
from torch import nn


def compute_dtype_for(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The matmul dtype nn.Linear would use here: the autocast dtype if autocast is on, else the weight's."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return weight.dtype


def supports_fused(lm_head: nn.Module) -> bool:
    """Only a plain nn.Linear: peft's LoRA layers and bitsandbytes' (an nn.Linear subclass) keep the plain path."""
    return type(lm_head) is nn.Linear


def call_in_head(lm_head: nn.Module, forward, *args: torch.Tensor) -> torch.Tensor:
    """`forward(*args)` run as lm_head's forward, through lm_head's own `__call__`, so that module hooks (ZeRO-3
    gathering its weight for forward and again for backward) fire as for lm_head(x)."""
    own_forward = lm_head.__dict__.get("forward")
    lm_head.forward = forward
    try:
        return lm_head(*args)
    finally:
        if own_forward is None:
            del lm_head.forward
        else:
            lm_head.forward = own_forward

