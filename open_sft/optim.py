"""AdamW with decay only on matrices, and the learning-rate schedules as pure functions of the step."""

from __future__ import annotations

import math

import torch
from torch import nn


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on weight matrices only: never on biases or norm scales (1-D parameters)."""
    decay, no_decay = [], []
    for _, param in model.named_parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, learning_rate: float, weight_decay: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=learning_rate, betas=(0.9, 0.999), eps=1e-8)


def lr_multiplier(kind: str, step: int, warmup_steps: int, total_steps: int, decay_ratio: float = 0.1) -> float:
    """Learning rate of optimizer step `step` (0-based) as a fraction of the peak.

    Warmup rises linearly to the peak at step warmup_steps - 1 (no step is wasted at lr 0); linear
    decay reaches 1 / (total - warmup) of the peak at the last step, not 0 (no wasted last step).
    """
    if step < warmup_steps and kind != "constant":
        return (step + 1) / warmup_steps
    if kind in ("constant", "constant_with_warmup"):
        return 1.0
    if kind == "wsd":  # warmup, stable at the peak, then linear decay over the last decay_ratio of steps
        decay_steps = max(1, math.ceil(decay_ratio * total_steps))
        decay_start = total_steps - decay_steps
        return 1.0 if step < decay_start else max(0.0, 1.0 - (step - decay_start + 1) / (decay_steps + 1))
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    if kind == "linear":
        return max(0.0, 1.0 - progress)
    if kind == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown schedule {kind!r}")


def warmup_steps_for(warmup_ratio: float, total_steps: int) -> int:
    return math.ceil(warmup_ratio * total_steps)
