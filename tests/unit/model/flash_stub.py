"""flash-attn's two entry points as transformers calls them, computed on CPU with plain attention (per row, or per
segment of the cumulative lengths), so that a model run with attn_implementation "flash_attention_2" gives real
numbers on a machine without a GPU: installed in transformers' flash-attention loader for the test (`flash_stub`),
each call recorded (which entry point, the segment bounds it was given)."""

from __future__ import annotations

from typing import Iterator

import pytest
import torch
from transformers import modeling_flash_attention_utils as flash_utils

from open_sft.model import packed_attention


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None,
            window: tuple[int, int], softcap: float) -> torch.Tensor:
    """One sequence, [tokens, heads, head_dim]: flash-attn's math (grouped key/value heads, its inclusive window
    bounds (left, right), -1 unbounded; softcap before the softmax), in fp32."""
    heads, dim = q.shape[1], q.shape[2]
    if k.shape[1] != heads:
        k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * (scale if scale is not None else dim ** -0.5)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    i = torch.arange(q.shape[0])[:, None]
    j = torch.arange(k.shape[0])[None]
    allowed = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool)
    if causal:
        allowed &= j <= i
    if window[0] >= 0:
        allowed &= i - j <= window[0]
    if window[1] >= 0:
        allowed &= j - i <= window[1]
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", weights, v.float()).to(q.dtype)


class FlashStub:
    def __init__(self) -> None:
        self.calls: list[tuple[str, list[int] | None, object]] = []  # (entry point, segment bounds, max_seqlen)

    def flash_attn_func(self, q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                        softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
        self.calls.append(("rows", None, None))
        return torch.stack([_attend(q[b], k[b], v[b], causal, softmax_scale, window_size, softcap)
                            for b in range(q.shape[0])])

    def flash_attn_varlen_func(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                               alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None):
        assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_q.device == q.device  # what the kernel takes
        bounds = cu_seqlens_q.tolist()
        self.calls.append(("varlen", bounds, max_seqlen_q))
        return torch.cat([_attend(q[a:b], k[a:b], v[a:b], causal, softmax_scale, window_size, softcap)
                          for a, b in zip(bounds, bounds[1:])])


@pytest.fixture
def flash_stub(monkeypatch) -> Iterator[FlashStub]:
    """The stub behind transformers' "flash_attention_2" for the test (its loader keeps what it loaded in module
    globals: reset before and after)."""
    stub = FlashStub()
    entry = (stub.flash_attn_func, stub.flash_attn_varlen_func, None, flash_utils._pad_input, flash_utils._unpad_input)
    monkeypatch.setattr(flash_utils, "_lazy_imports", lambda *args, **kwargs: entry)
    monkeypatch.setattr(flash_utils, "_loaded_implementation", None)
    monkeypatch.setattr(packed_attention, "KERNEL_DEVICE", "cpu")  # the CPU stands in for flash-attn's GPU
    yield stub
    flash_utils._loaded_implementation = None
