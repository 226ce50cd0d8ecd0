"""What a model's own causal-LM forward does to its logits between the LM head and the loss.

open_sft runs the backbone and the LM head itself (open_sft.model.loss), so anything a family's
`ForCausalLM.forward` applies to the logits would be skipped: Gemma-2/3 cap them (`final_logit_softcapping`:
cap · tanh(z / cap); RecurrentGemma's `logits_soft_cap`, xLSTM's `output_logit_soft_cap`), Granite divides them
(`logits_scaling`), Cohere multiplies them (`logit_scale`); a multimodal class applies its text model's (Gemma 4's
cap; Gemma-3's multimodal class applies none). Those
are elementwise, so the fused, chunked loss applies them to each block of logits (open_sft.model.fused_ce)
and the full logits still never exist. That a family's loss is ours is checked at load (open_sft.model.loss_parity).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from open_sft.model.anatomy import text_config

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LogitTransform:
    """y = softcap(scale · z): the logits the model's own loss sees, from the LM head's output z."""

    scale: float = 1.0
    softcap: Optional[float] = None

    @property
    def identity(self) -> bool:
        return self.scale == 1.0 and self.softcap is None

    def apply(self, z: torch.Tensor) -> torch.Tensor:
        """A new tensor (autograd follows it on the plain path)."""
        y = z * self.scale if self.scale != 1.0 else z
        if self.softcap is not None:
            y = torch.tanh(y / self.softcap) * self.softcap
        return y if y is not z else z.clone()

    def slope(self, y: torch.Tensor) -> Union[float, torch.Tensor]:
        """dy/dz from y: scale · (1 − (y / cap)²) under a cap (tanh' = 1 − tanh²), else the scale."""
        if self.softcap is None:
            return self.scale
        return (1.0 - (y / self.softcap) ** 2) * self.scale

    def describe(self) -> str:
        parts = ([f"scaled by {self.scale:g}"] if self.scale != 1.0 else []) + (
            [f"capped at {self.softcap:g} (tanh)"] if self.softcap is not None else [])
        return ", ".join(parts) or "as the LM head gives them"


# configs of the multimodal classes whose forward leaves their text model's transform out (Gemma-3 4B-27B's and
# ShieldGemma-2's Gemma3ForConditionalGeneration); the others apply it as their text model does (Gemma 3n's and
# Gemma 4's cap)
TEXT_TRANSFORM_SKIPPED = frozenset({"Gemma3Config", "ShieldGemma2Config"})


def logit_transform(config: Any) -> LogitTransform:
    """The transform a model's config declares (the attribute names transformers' families use); a multimodal
    model's is in its text_config."""
    if type(config).__name__ not in TEXT_TRANSFORM_SKIPPED:
        config = text_config(config)
    scale = 1.0
    if getattr(config, "logit_scale", None) is not None:  # Cohere, Cohere2
        scale *= float(config.logit_scale)
    if getattr(config, "logits_scaling", None):  # Granite, GraniteMoE
        scale /= float(config.logits_scaling)
    softcap = (getattr(config, "final_logit_softcapping", None)  # Gemma-2, Gemma-3
               or getattr(config, "logits_soft_cap", None)  # RecurrentGemma
               or getattr(config, "output_logit_soft_cap", None))  # xLSTM
    return LogitTransform(scale, float(softcap) if softcap else None)
