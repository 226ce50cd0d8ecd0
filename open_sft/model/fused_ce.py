"""LM head + cross-entropy over chunks of positions, without the [tokens, vocab] logits.

The plain path (`F.cross_entropy(lm_head(hidden).float(), targets)`) keeps the logits in the compute
dtype and in fp32 for backward: for 8k trained tokens and a 50k vocabulary that is ~2.5 GB, the
largest tensors of a small model's step. Here the forward pass walks over chunks of rows: each chunk's
logits are computed in the compute dtype, its log-softmax in fp32, and — since the loss is the last
operation of the graph — the gradients (softmax − one-hot) are turned into the chunk's hidden-state
gradient and added into the weight gradient at once. Only grad_hidden [N, d], grad_weight [V, d]
(and grad_bias [V]) are kept; backward scales them by the incoming gradient.

ZeRO-3 gathers a module's parameters only inside a call to that module, so `lm_head_loss_sum` calls
the LM head's own `__call__` (hooks included) with a forward that computes the fused loss.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from open_sft.data.token_rows import IGNORE_INDEX
from open_sft.model import bf16_matmul

# At most this many logits per chunk: 2^25 fp32 values = 128 MiB (e.g. 671 rows of a 50k vocabulary).
CHUNK_ELEMENTS = 1 << 25
MIN_CHUNK_ROWS = 64


def default_chunk_rows(vocab_size: int) -> int:
    return max(MIN_CHUNK_ROWS, CHUNK_ELEMENTS // max(vocab_size, 1))


def compute_dtype_for(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The matmul dtype nn.Linear would use here: the autocast dtype if autocast is on, else the weight's."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return weight.dtype


class _LinearCrossEntropySum(torch.autograd.Function):
    """sum_i cross_entropy(hidden_i @ weight.T + bias, target_i), every target valid (no ignore_index)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                targets: torch.Tensor, chunk_rows: int, dtype: torch.dtype, via_fp32: bool,
                token_losses: Optional[torch.Tensor]) -> torch.Tensor:
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        need_grad = need_hidden or need_weight or need_bias
        # via_fp32 (open_sft.model.bf16_matmul): every operand and product rounded to `dtype`, multiplied in fp32.
        mm_dtype = torch.float32 if via_fp32 else dtype

        def cast(t: torch.Tensor) -> torch.Tensor:
            return t.to(dtype).to(mm_dtype)

        with torch.autocast(hidden.device.type, enabled=False):
            w = cast(weight)
            b = cast(bias) if bias is not None else None
            loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
            grad_hidden = torch.empty_like(hidden) if need_hidden else None
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
            grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_bias else None
            for start in range(0, hidden.shape[0], chunk_rows):
                h = cast(hidden[start : start + chunk_rows])
                t = targets[start : start + chunk_rows]
                logits = cast(torch.addmm(b, h, w.t()) if b is not None else h @ w.t())
                logprobs = torch.log_softmax(logits, dim=1, dtype=torch.float32)
                del logits
                picked = logprobs.gather(1, t[:, None])
                loss -= picked.sum()
                if token_losses is not None:  # each position's loss, for per-source sums (no gradient)
                    token_losses[start : start + chunk_rows] = -picked[:, 0]
                if not need_grad:
                    continue
                # d loss / d logits = softmax − one-hot, computed in fp32 in place, then cast for the matmuls.
                probs = logprobs.exp_()
                probs[torch.arange(t.shape[0], device=t.device), t] -= 1.0
                grad_logits = cast(probs)
                del probs, logprobs
                if need_hidden:
                    grad_hidden[start : start + chunk_rows] = cast(grad_logits @ w)
                if need_weight and dtype == torch.float32:
                    grad_weight.addmm_(grad_logits.t(), h)
                elif need_weight:  # each chunk's product rounded once to `dtype`, the sum kept in fp32
                    grad_weight += cast(grad_logits.t() @ h)
                if need_bias:
                    grad_bias += grad_logits.sum(0, dtype=torch.float32)
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.dtypes = (weight.dtype, bias.dtype if bias is not None else None)
        return loss

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        weight_dtype, bias_dtype = ctx.dtypes
        scale = grad_output.to(torch.float32)
        if grad_hidden is not None:
            grad_hidden = grad_hidden * scale.to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * scale).to(weight_dtype)
        if grad_bias is not None:
            grad_bias = (grad_bias * scale).to(bias_dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                             targets: torch.Tensor, chunk_rows: Optional[int] = None,
                             bf16_via_fp32: bool = False, token_losses: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Sum of cross-entropies of `hidden @ weight.T + bias` ([N, d] rows) against `targets` ([N]) in fp32.

    `token_losses` (fp32, one value per target that is not IGNORE_INDEX), when given, receives each position's loss
    (no gradient flows through it; the sum returned is computed as without it).
    Positions whose target is IGNORE_INDEX are skipped (they add nothing, as in F.cross_entropy). Matmuls run in
    the autocast dtype when autocast is on, else the weight's dtype; the softmax always in fp32. With
    `bf16_via_fp32`, bf16 matmuls run as fp32 matmuls of bf16-rounded operands (open_sft.model.bf16_matmul)."""
    hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = targets.reshape(-1)
    if hidden.shape[0] != targets.shape[0]:
        raise ValueError(f"{hidden.shape[0]} hidden rows but {targets.shape[0]} targets")
    keep = targets != IGNORE_INDEX
    if not bool(keep.all()):
        hidden, targets = hidden[keep], targets[keep]
    if not torch.is_grad_enabled():  # evaluation: a Function sees requires_grad even under no_grad
        hidden, weight = hidden.detach(), weight.detach()
        bias = bias.detach() if bias is not None else None
    rows = chunk_rows or default_chunk_rows(weight.shape[0])
    if rows < 1:
        raise ValueError(f"chunk_rows must be positive, got {rows}")
    dtype = compute_dtype_for(hidden, weight)
    via_fp32 = bf16_via_fp32 and dtype == torch.bfloat16
    if token_losses is not None and token_losses.shape != targets.shape:
        raise ValueError(f"token_losses holds {token_losses.numel()} values for {targets.numel()} trained positions")
    return _LinearCrossEntropySum.apply(hidden, weight, bias, targets, rows, dtype, via_fp32, token_losses)


def supports_fused(lm_head: nn.Module) -> bool:
    """Only a plain nn.Linear: peft's LoRA layers and bitsandbytes' (an nn.Linear subclass) keep the plain path."""
    return type(lm_head) is nn.Linear


def lm_head_loss_sum(lm_head: nn.Linear, hidden: torch.Tensor, targets: torch.Tensor,
                     chunk_rows: Optional[int] = None, token_losses: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`linear_cross_entropy_sum` with lm_head's parameters, run inside a call to lm_head itself so that
    module hooks (ZeRO-3 gathering its weight for forward and again for backward) fire as for lm_head(x)."""
    if not supports_fused(lm_head):
        raise TypeError(f"the fused loss needs a plain nn.Linear LM head, got {type(lm_head).__name__}")

    def fused_forward(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return linear_cross_entropy_sum(h, lm_head.weight, lm_head.bias, t, chunk_rows,
                                        bf16_via_fp32=bf16_matmul.installed(lm_head), token_losses=token_losses)

    own_forward = lm_head.__dict__.get("forward")
    lm_head.forward = fused_forward
    try:
        return lm_head(hidden, targets)
    finally:
        if own_forward is None:
            del lm_head.forward
        else:
            lm_head.forward = own_forward
