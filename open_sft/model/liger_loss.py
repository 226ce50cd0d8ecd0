"""Liger's fused linear cross-entropy as the LM-head loss on CUDA (--use_liger_kernel).

Liger fuses the LM head's matmul, the softmax and its gradient in Triton kernels, chunk by chunk, like
open_sft.model.fused_ce does with torch ops; on a GPU its single kernel per chunk replaces the several
elementwise passes of ours. It is used where it computes exactly our loss: the sum over trained positions
(reduction="sum", normalised by the trainer over the global batch), a family's cap passed as Liger's own
`softcap`, a family's scale folded into the hidden states (scale · (h Wᵀ + b) = (scale · h) Wᵀ + scale · b).

Where it cannot, open_sft's own chunked loss runs and the log says why (once per reason): not on CUDA, an LM
head that is not a plain weight (LoRA on the head, 4-bit), or a training step that needs each position's
loss (a run of several sources logs a loss per source; Liger gives per-position losses only with
reduction="none", and then recomputes its logits in backward, one more LM-head matmul per step).
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch
from torch import nn

from open_sft.data.token_rows import IGNORE_INDEX
from open_sft.model.lm_head import call_in_head, compute_dtype_for, supports_fused
from open_sft.model.logits import LogitTransform

logger = logging.getLogger(__name__)
_said: set[str] = set()


def kernel() -> Callable:
    """Liger's function (a CPU test stands in a reference of its semantics: Triton needs CUDA)."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return liger_fused_linear_cross_entropy


def on_cuda(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"


def why_not(lm_head: nn.Module, hidden: torch.Tensor, per_position: bool, training: bool) -> Optional[str]:
    """None where Liger's fused loss computes this pass's loss, else the reason it does not."""
    if not on_cuda(hidden):
        return "Liger's fused linear cross-entropy runs on CUDA only; the loss is open_sft's chunked loss"
    if not supports_fused(lm_head):
        return (f"the LM head is a {type(lm_head).__name__} (LoRA on the head, or 4-bit), not the plain weight "
                "Liger's fused linear cross-entropy takes; the loss is open_sft's chunked loss")
    if per_position and training:
        return ("this run logs a loss per source, which needs each position's loss: Liger gives those only by "
                "recomputing its logits in backward (one more LM-head matmul per step), so the loss is open_sft's "
                "chunked loss, which gives them at no cost")
    if per_position:
        return "evaluation (a loss per source, no gradient) uses open_sft's chunked loss"
    return None


def peak_bytes(vocab_size: int, hidden_size: int, rows: int, compute_bytes: int) -> int:
    """Liger's fused loss's own peak memory, as liger-kernel 0.8 allocates it: the fp32 weight gradient, the weight
    cast to the compute dtype (liger_loss_sum's cast), the hidden states' gradient, and one chunk's logits in the
    compute dtype and fp32. Liger sizes a chunk so that chunk × vocab is about rows × hidden: the next power of
    two of rows / ceil(vocab / hidden)."""
    per_chunk = -(-rows // max(-(-vocab_size // max(hidden_size, 1)), 1))
    chunk = min(1 << max(per_chunk - 1, 0).bit_length(), max(rows, 1))
    return ((4 + compute_bytes) * vocab_size * hidden_size + compute_bytes * rows * hidden_size
            + (4 + compute_bytes) * chunk * vocab_size)


def say_once(reason: str) -> None:
    if reason not in _said:
        _said.add(reason)
        logger.info("--use_liger_kernel: %s", reason)


def liger_loss_sum(lm_head: nn.Linear, hidden: torch.Tensor, targets: torch.Tensor,
                   transform: LogitTransform) -> torch.Tensor:
    """Sum over rows of cross_entropy(transform(hidden @ Wᵀ + b), targets), in fp32, through Liger's kernel,
    inside a call to lm_head (ZeRO-3 gathers its weight there)."""

    def forward(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        weight, bias = lm_head.weight, lm_head.bias
        dtype = compute_dtype_for(h, weight)
        # Liger multiplies in its operands' dtype; under autocast its out= products would not be cast, so the
        # operands are cast here once and autocast is off inside.
        with torch.autocast(h.device.type, enabled=False):
            if transform.scale != 1.0:
                h = h.float() * transform.scale
                bias = bias.float() * transform.scale if bias is not None else None
            loss = kernel()(h.to(dtype), weight.to(dtype), t, bias=bias.to(dtype) if bias is not None else None,
                            ignore_index=IGNORE_INDEX, reduction="sum", softcap=transform.softcap,
                            accum_dtype=torch.float32)  # the weight gradient summed over chunks in fp32
        return loss.float()

    return call_in_head(lm_head, forward, hidden, targets)
