"""What a model's own causal-LM forward does to its logits between the LM head and the loss.

open_sft runs the backbone and the LM head itself (open_sft.model.loss), so anything a family's
`ForCausalLM.forward` applies to the logits would be skipped: Gemma-2/3 cap them (`final_logit_softcapping`:
cap · tanh(z / cap)), Granite divides them (`logits_scaling`), Cohere multiplies them (`logit_scale`). Those
are elementwise, so the fused, chunked loss applies them to each block of logits (open_sft.model.fused_ce)
and the full logits still never exist.

A family not in VERIFIED (the families tests/unit/model/test_logits.py holds to the model's own loss) is
checked when it is loaded: our loss against `model(input_ids, labels=...)` on a short sequence; a difference
stops the run with the family named, instead of training a loss the model was not trained with.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from open_sft.errors import UserError

logger = logging.getLogger(__name__)

# model_type of each family whose loss, with its logit transform, equals the model's own loss and gradients
# (tests/unit/model/test_logits.py, tiny random configs of each).
VERIFIED = frozenset({
    "llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3_text", "phi", "phi3",
    "olmo", "olmo2", "olmoe", "granite", "granitemoe", "cohere", "cohere2", "gpt_neox", "starcoder2", "smollm3",
})
PARITY_TOKENS = 24
PARITY_RTOL = 1e-4


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


def logit_transform(config: Any) -> LogitTransform:
    """The transform a model's config declares (the attribute names transformers' families use)."""
    scale = 1.0
    if getattr(config, "logit_scale", None) is not None:  # Cohere, Cohere2
        scale *= float(config.logit_scale)
    if getattr(config, "logits_scaling", None):  # Granite, GraniteMoE
        scale /= float(config.logits_scaling)
    softcap = getattr(config, "final_logit_softcapping", None)  # Gemma-2, Gemma-3
    return LogitTransform(scale, float(softcap) if softcap else None)


def _probe_ids(vocab: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (1, PARITY_TOKENS), generator=generator)


@torch.no_grad()
def check_loss_parity(model: torch.nn.Module) -> Optional[str]:
    """For a family outside VERIFIED: our loss against the model's own on a short sequence (a no-op for verified
    families). Returns a log line, or raises UserError when the two differ."""
    from open_sft.model.loss import TokenLossModel

    config = model.config
    family = getattr(config, "model_type", type(model).__name__)
    if family in VERIFIED:
        return None
    if any(getattr(p, "ds_numel", None) is not None for p in model.parameters()):
        raise UserError(
            f"model type {family!r} is not among the families open_sft has verified its loss for "
            f"({', '.join(sorted(VERIFIED))}), and its start-up check needs the whole model on each rank, but "
            "ZeRO-3 loaded it partitioned: set zero3_init_flag: false in the accelerate config (the model is then "
            "loaded whole and partitioned when training starts)")
    device = next(model.parameters()).device
    ids = _probe_ids(config.vocab_size).to(device)
    was_training = model.training
    model.eval()
    try:
        router = {"output_router_logits": False} if hasattr(config, "output_router_logits") else {}  # no aux loss
        theirs = float(model(input_ids=ids, labels=ids, use_cache=False, **router).loss)
        ours = float(TokenLossModel(model)(input_ids=ids, labels=ids)) / (PARITY_TOKENS - 1)
    finally:
        model.train(was_training)
    if not abs(ours - theirs) <= PARITY_RTOL * abs(theirs):
        raise UserError(
            f"model type {family!r}: open_sft's loss ({ours:.6f}) differs from the model's own ({theirs:.6f}) on a "
            f"{PARITY_TOKENS}-token check: its causal-LM forward changes the logits in a way open_sft does not "
            "know (verified families: " + ", ".join(sorted(VERIFIED)) + "); training would optimise another loss "
            "than the model's. Please report the model type.")
    return f"model type {family!r}: open_sft's loss equals the model's own on a {PARITY_TOKENS}-token check"
