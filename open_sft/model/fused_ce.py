"""LM head + cross-entropy over chunks of positions, without the [tokens, vocab] logits.

The plain path (`F.cross_entropy(lm_head(hidden).float(), targets)`) keeps the logits in the compute
dtype and in fp32 for backward: for 8k trained tokens and a 50k vocabulary that is ~2.5 GB, the
largest tensors of a small model's step. Here the forward pass walks over chunks of rows: each chunk's
logits are computed in the compute dtype, its softmax in fp32 (a cache-sized block at a time), and — since
the loss is the last operation of the graph — the gradients (softmax − one-hot) are turned into the chunk's
hidden-state gradient and added into the weight gradient at once. Only grad_hidden [N, d], grad_weight
[V, d] (and grad_bias [V]) are kept; backward scales them by the incoming gradient.

ZeRO-3 gathers a module's parameters only inside a call to that module, so `lm_head_loss_sum` calls
the LM head's own `__call__` (hooks included) with a forward that computes the fused loss.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from open_sft.data.token_rows import IGNORE_INDEX
from open_sft.model import bf16_matmul
from open_sft.model.lm_head import call_in_head, compute_dtype_for, supports_fused
from open_sft.model.logits import LogitTransform

# The logits of one chunk of rows are the largest tensor: at most this many bytes (e.g. 1,334 rows of a 50k
# vocabulary in bf16, 667 in fp32).
CHUNK_BYTES = 1 << 27
MIN_CHUNK_ROWS = 64
# Rows per matmul: a [256, d] × [d, V] product runs near the machine's matmul peak, while one of ~700 rows whose
# output is a 67 MB bf16 block ran at half of it (measured on a 2-core AMD EPYC: 368 vs 191 GFLOP/s).
MATMUL_ROWS = 256
# Elements of one softmax block in fp32 (4 MiB): its passes (to fp32, softmax, − one-hot, back to the chunk's
# dtype) run out of the CPU's cache instead of streaming the whole chunk through memory each time.
SOFTMAX_ELEMENTS = 1 << 20
# On a GPU the pieces that suit a CPU's caches are launches too small to fill it (a 20-row softmax block is a
# few kernels of microseconds each, and the CPU blocks' check for tiny probabilities waits on the device):
# there a chunk's logits may take 512 MiB, its matmuls and its softmax run whole, and the log-probability comes
# from a log-sum-exp, which needs no check (open_sft.model.fused_ce._softmax_grad_lse_).
GPU_CHUNK_BYTES = 1 << 29


def gpu_layout(t: torch.Tensor) -> bool:
    """Whether the loss over `t` takes the GPU's layout of chunks (a test runs that layout on CPU by patching)."""
    return t.device.type == "cuda"


def default_chunk_rows(vocab_size: int, element_size: int = 4, on_gpu: bool = False) -> int:
    budget = GPU_CHUNK_BYTES if on_gpu else CHUNK_BYTES
    return max(MIN_CHUNK_ROWS, budget // (max(vocab_size, 1) * element_size))


def peak_bytes(vocab_size: int, hidden_size: int, rows: int, compute_bytes: int, on_gpu: bool = False) -> int:
    """The fused loss's own peak memory: the fp32 weight gradient, the weight in the compute dtype (twice: as it
    is and transposed), one chunk's logits in the compute dtype and its softmax's fp32 temporaries (one block
    of them on CPU, the whole chunk's on a GPU)."""
    chunk = min(rows, default_chunk_rows(vocab_size, compute_bytes, on_gpu))
    weights = (4 + 2 * compute_bytes) * vocab_size * hidden_size
    softmax = 4 * chunk * vocab_size if on_gpu else 8 * SOFTMAX_ELEMENTS
    return weights + chunk * vocab_size * compute_bytes + softmax


def _pieces(stop: int, step: int):
    """(start, end) of consecutive pieces of 0..stop, `step` long (the last one shorter)."""
    return ((i, min(i + step, stop)) for i in range(0, stop, step))


# Below this a target's fp32 probability has lost precision (fp32's smallest normal is ~1.2e-38): its
# log-probability is then taken from a log-softmax of its row instead.
TINY_PROBABILITY = 1e-30


def _softmax_grad_(logits: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype, need_grad: bool,
                   transform: Optional[LogitTransform] = None) -> torch.Tensor:
    """Each row's log-probability of its target, in fp32; with need_grad, `logits` is overwritten in place by
    d loss / d logits = softmax − one-hot (computed in fp32, rounded to `dtype`).

    One softmax (one exp per logit) gives both: the loss is log(p_target), which in fp32 is as exact as a
    log-softmax's entry while p_target is a normal number; rows where it is not (a target ~69 nats below
    the row's best) are recomputed with log-softmax. A log-softmax followed by exp would cost a second
    exp per logit, measured ~1.5x the time of this block's passes in bf16 (AMD EPYC, 50k vocabulary)."""
    # a family's logit transform (open_sft.model.logits) on the block's fp32 scores
    scores = transform.apply(logits.float()) if transform is not None else logits
    probs = torch.softmax(scores, dim=1, dtype=torch.float32)  # one block: it stays in the cache
    target_probs = probs.gather(1, targets[:, None])[:, 0]
    picked = target_probs.log()
    tiny = target_probs < TINY_PROBABILITY
    if bool(tiny.any()):
        rows = tiny.nonzero()[:, 0]
        exact = torch.log_softmax(scores[rows], dim=1, dtype=torch.float32)
        picked[rows] = exact.gather(1, targets[rows, None])[:, 0]
    if need_grad:
        probs[torch.arange(targets.shape[0], device=targets.device), targets] -= 1.0
        if transform is not None:
            probs *= transform.slope(scores)  # d loss / d z = (softmax(y) − one-hot) · dy/dz
        # rounded to the logits' dtype; bf16 via fp32 matmuls: rounded as a bf16 gradient would be first
        logits.copy_(probs.to(dtype) if logits.dtype != dtype else probs)
    return picked


def _softmax_grad_lse_(logits: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype,
                       need_grad: bool, transform: Optional[LogitTransform] = None) -> torch.Tensor:
    """`_softmax_grad_` for a GPU, over a whole chunk: log p_target = logit_target − logsumexp(row), exact without
    a check that waits on the device; the gradient exp(logits − lse) − one-hot in one fp32 temporary."""
    scores = logits.float()
    if transform is not None:
        scores = transform.apply(scores)
        slope = transform.slope(scores) if need_grad else None
    lse = torch.logsumexp(scores, dim=1)
    picked = scores.gather(1, targets[:, None])[:, 0] - lse
    if need_grad:
        probs = scores.sub_(lse[:, None]).exp_()  # in place: `scores` is `logits` itself when they are fp32
        probs[torch.arange(targets.shape[0], device=targets.device), targets] -= 1.0
        if transform is not None:
            probs *= slope
        if probs is not logits or dtype != logits.dtype:
            logits.copy_(probs.to(dtype))
    return picked


def _buffers(hidden: torch.Tensor, weight: torch.Tensor, chunk_rows: int, mm_dtype: torch.dtype,
             rounded_product: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """One logits buffer for every chunk, and one for the weight gradient's rounded product. A fresh 128 MB block
    per chunk is a fresh mapping on CPU (glibc maps blocks over 32 MB), whose first write page-faults inside the
    matmul (measured: the logits matmul at 294 vs 356 GFLOP/s, bf16, 2-core AMD EPYC)."""
    rows = min(chunk_rows, hidden.shape[0])
    buffer = torch.empty((rows, weight.shape[0]), dtype=mm_dtype, device=hidden.device)
    return buffer, torch.empty(weight.shape, dtype=mm_dtype, device=weight.device) if rounded_product else None


class _LinearCrossEntropySum(torch.autograd.Function):
    """sum_i cross_entropy(hidden_i @ weight.T + bias, target_i), every target valid (no ignore_index).

    Per chunk of rows: the logits are computed into one buffer a matmul of MATMUL_ROWS at a time, turned
    into softmax − one-hot in place a cache-sized block at a time (the loss read off it), and the chunk's
    gradient then goes into grad_hidden (MATMUL_ROWS at a time) and into the fp32 weight gradient (one
    matmul over the whole chunk, so its fp32 accumulation is read and written once per chunk)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                targets: torch.Tensor, chunk_rows: int, dtype: torch.dtype, via_fp32: bool,
                token_losses: Optional[torch.Tensor], transform: Optional[LogitTransform]) -> torch.Tensor:
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        need_grad = need_hidden or need_weight or need_bias
        # via_fp32 (open_sft.model.bf16_matmul): every operand and product rounded to `dtype`, multiplied in fp32.
        mm_dtype = torch.float32 if via_fp32 else dtype

        def cast(t: torch.Tensor) -> torch.Tensor:
            return t.to(dtype).to(mm_dtype)

        with torch.autocast(hidden.device.type, enabled=False):
            w = cast(weight)
            # [d, V]: a bf16 logits matmul runs ~7 % faster on it than on w.t() (measured); fp32 keeps w.t(), the
            # operand nn.Linear gives its kernel, so the logits are those of the plain path bit for bit.
            w_t = w.t().contiguous() if mm_dtype != torch.float32 else w.t()
            b = cast(bias) if bias is not None else None
            loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
            grad_hidden = torch.empty_like(hidden) if need_hidden else None
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
            grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_bias else None
            vocab = weight.shape[0]
            on_gpu = gpu_layout(hidden)
            block = chunk_rows if on_gpu else max(1, SOFTMAX_ELEMENTS // vocab)
            matmul_rows = chunk_rows if on_gpu else MATMUL_ROWS
            softmax_grad = _softmax_grad_lse_ if on_gpu else _softmax_grad_
            buffer, product = _buffers(hidden, weight, chunk_rows, mm_dtype, need_weight and dtype != torch.float32)
            for start, stop in _pieces(hidden.shape[0], chunk_rows):
                h = cast(hidden[start:stop])
                logits = buffer[: stop - start]
                for i, j in _pieces(stop - start, matmul_rows):
                    if b is not None:
                        torch.addmm(b, h[i:j], w_t, out=logits[i:j])
                    else:
                        torch.mm(h[i:j], w_t, out=logits[i:j])
                    if via_fp32:
                        logits[i:j] = logits[i:j].to(dtype)
                for i, j in _pieces(stop - start, block):
                    picked = softmax_grad(logits[i:j], targets[start + i : start + j], dtype, need_grad, transform)
                    loss -= picked.sum()
                    if token_losses is not None:  # each position's loss, for per-source sums (no gradient)
                        token_losses[start + i : start + j] = -picked
                if not need_grad:
                    continue
                grad_logits = logits
                if need_hidden:
                    for i, j in _pieces(stop - start, matmul_rows):
                        grad_hidden[start + i : start + j] = cast(grad_logits[i:j] @ w)
                if need_weight and dtype == torch.float32:
                    grad_weight.addmm_(grad_logits.t(), h)
                elif need_weight:  # each chunk's product rounded once to `dtype`, the sum kept in fp32
                    torch.mm(grad_logits.t(), h, out=product)
                    grad_weight += product.to(dtype)
                if need_bias:
                    grad_bias += grad_logits.sum(0, dtype=torch.float32)
                del logits, grad_logits
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
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                             targets: torch.Tensor, chunk_rows: Optional[int] = None,
                             bf16_via_fp32: bool = False, token_losses: Optional[torch.Tensor] = None,
                             transform: Optional[LogitTransform] = None, all_trained: bool = False) -> torch.Tensor:
    """Sum of cross-entropies of `hidden @ weight.T + bias` ([N, d] rows) against `targets` ([N]) in fp32.

    `token_losses` (fp32, one value per target that is not IGNORE_INDEX), when given, receives each position's loss
    (no gradient flows through it; the sum returned is computed as without it).
    Positions whose target is IGNORE_INDEX are skipped (they add nothing, as in F.cross_entropy); `all_trained`: the
    caller selected the trained positions already, so no check (on a GPU, one that waits on the device). Matmuls run in
    the autocast dtype when autocast is on, else the weight's dtype; the softmax always in fp32. With
    `bf16_via_fp32`, bf16 matmuls run as fp32 matmuls of bf16-rounded operands (open_sft.model.bf16_matmul)."""
    hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = targets.reshape(-1)
    if hidden.shape[0] != targets.shape[0]:
        raise ValueError(f"{hidden.shape[0]} hidden rows but {targets.shape[0]} targets")
    keep = None if all_trained else targets != IGNORE_INDEX
    if keep is not None and not bool(keep.all()):
        hidden, targets = hidden[keep], targets[keep]
    if not torch.is_grad_enabled():  # evaluation: a Function sees requires_grad even under no_grad
        hidden, weight = hidden.detach(), weight.detach()
        bias = bias.detach() if bias is not None else None
    dtype = compute_dtype_for(hidden, weight)
    via_fp32 = bf16_via_fp32 and dtype == torch.bfloat16
    rows = chunk_rows or default_chunk_rows(weight.shape[0], (torch.float32 if via_fp32 else dtype).itemsize,
                                            on_gpu=gpu_layout(hidden))
    if rows < 1:
        raise ValueError(f"chunk_rows must be positive, got {rows}")
    if token_losses is not None and token_losses.shape != targets.shape:
        raise ValueError(f"token_losses holds {token_losses.numel()} values for {targets.numel()} trained positions")
    if transform is not None and transform.identity:
        transform = None
    return _LinearCrossEntropySum.apply(hidden, weight, bias, targets, rows, dtype, via_fp32, token_losses, transform)


def lm_head_loss_sum(lm_head: nn.Linear, hidden: torch.Tensor, targets: torch.Tensor,
                     chunk_rows: Optional[int] = None, token_losses: Optional[torch.Tensor] = None,
                     transform: Optional[LogitTransform] = None, all_trained: bool = False) -> torch.Tensor:
    """`linear_cross_entropy_sum` with lm_head's parameters, run inside a call to lm_head itself (`call_in_head`)."""
    if not supports_fused(lm_head):
        raise TypeError(f"the fused loss needs a plain nn.Linear LM head, got {type(lm_head).__name__}")

    def fused_forward(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return linear_cross_entropy_sum(h, lm_head.weight, lm_head.bias, t, chunk_rows,
                                        bf16_via_fp32=bf16_matmul.installed(lm_head), token_losses=token_losses,
                                        transform=transform, all_trained=all_trained)

    return call_in_head(lm_head, fused_forward, hidden, targets)
