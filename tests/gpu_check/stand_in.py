"""torch's variable-length flash attention (torch.nn.attention.varlen.varlen_attn, CUDA only) as a CPU stand-in:
the kernel's contract computed per example with sdpa, so the path to the kernel (flattened rows, cumulative lengths,
multi-head latent attention's zero-padded values) runs in the smoke run and the unit tests, and a faulty kernel can
be planted (`acausal`). On a GPU the probes use the kernel itself."""

from __future__ import annotations

import inspect
from typing import Callable

import torch


def varlen_stand_in(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_q: torch.Tensor,
                    cu_seq_k: torch.Tensor, max_q: int, max_k: int, *, scale=None, window_size=(-1, -1),
                    enable_gqa: bool = False) -> torch.Tensor:
    """[tokens, heads, dim] in and out; causal where `window_size` is (-1, 0), the kernel's way of saying it."""
    if not torch.equal(cu_seq_q, cu_seq_k) or cu_seq_q.dtype != torch.int32:
        raise ValueError(f"the stand-in takes equal int32 cumulative lengths, not {cu_seq_q} and {cu_seq_k}")
    if key.shape[-1] != query.shape[-1] or value.shape[-1] != query.shape[-1]:
        raise ValueError(f"the kernel takes one head_dim for query, key and value: {query.shape}, {key.shape}, "
                         f"{value.shape}")
    bounds = cu_seq_q.tolist()
    out = []
    for a, b in zip(bounds, bounds[1:]):
        q, k, v = (t[a:b].transpose(0, 1)[None] for t in (query, key, value))
        out.append(torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=tuple(window_size) == (-1, 0), scale=scale, enable_gqa=enable_gqa)[0].transpose(0, 1))
    return torch.cat(out)


def acausal(kernel: Callable) -> Callable:
    """A faulty kernel: `kernel` called without its causal mask (every query sees its example's later keys), which
    leaks nothing across examples, so only a comparison with the per-example attention finds it."""
    params = inspect.signature(kernel).parameters

    def faulty(*args, **kwargs):
        if "is_causal" in params:  # torch 2.10/2.11
            kwargs["is_causal"] = False
        else:
            kwargs["window_size"] = (-1, -1)
        return kernel(*args, **kwargs)

    faulty.__signature__ = inspect.signature(kernel)
    return faulty
