"""The CPU stand-in for torch's CUDA variable-length flash attention (torch.nn.attention.varlen.varlen_attn), held to
the kernel's contract: what the kernel refuses on a GPU, the stand-in refuses here, so a call the GPU would refuse
fails a CPU test too.

- Tensors on the kernel's device only: aten::_flash_attention_forward has no CPU kernel (NotImplementedError). A test
  that stands the CPU in for the GPU says so with the `cpu_as_gpu` fixture (packed_attention.KERNEL_DEVICE = "cpu").
- Query, key and value in one dtype, bf16 or fp16; head size at most 256 and a multiple of 8 (mha_varlen_fwd's checks).
- Cumulative lengths int32 on the queries' device, max lengths the longest example's.
- window_size (left, right): query i attends keys j with i - left <= j <= i + right, -1 unbounded; (-1, 0) is causal.
"""

from __future__ import annotations

import pytest
import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from open_sft.model import packed_attention


@pytest.fixture(autouse=True)
def own_sdpa_entry():
    """transformers' own "sdpa" entry for each test of a module that imports this fixture (one installed before would be kept: install does not wrap
    twice), and what was there put back after."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    before = ALL_ATTENTION_FUNCTIONS["sdpa"]
    ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa_attention_forward
    yield
    ALL_ATTENTION_FUNCTIONS["sdpa"] = before


@pytest.fixture
def cpu_as_gpu(monkeypatch):
    """The CPU stands in for the GPU: the packed attention takes the kernel for CPU tensors, and the stand-in
    takes them."""
    monkeypatch.setattr(packed_attention, "KERNEL_DEVICE", "cpu")


def _check_contract(query, key, value, cu_q, cu_k, max_q, max_k) -> None:
    device = getattr(packed_attention, "KERNEL_DEVICE", "cuda")
    if any(t.device.type != device for t in (query, key, value, cu_q, cu_k)):
        raise NotImplementedError("Could not run 'aten::_flash_attention_forward' with arguments from the "
                                  f"'{query.device.type.upper()}' backend (the kernel's device: {device})")
    if query.dtype not in (torch.bfloat16, torch.float16) or not query.dtype == key.dtype == value.dtype:
        raise RuntimeError(f"FlashAttention only support fp16 and bf16 data type (got {query.dtype}, {key.dtype}, "
                           f"{value.dtype})")
    if not query.shape[-1] == key.shape[-1] == value.shape[-1]:
        raise RuntimeError("query, key and value must have the same head size")
    if query.shape[-1] > 256 or query.shape[-1] % 8:
        raise RuntimeError(f"FlashAttention forward only supports head dimension at most 256, a multiple of 8 (got "
                           f"{query.shape[-1]})")
    assert cu_q.dtype == cu_k.dtype == torch.int32 and torch.equal(cu_q, cu_k)
    lengths = (cu_q[1:] - cu_q[:-1]).tolist()
    assert isinstance(max_q, int) and max(lengths) == max_q == max_k and int(cu_q[-1]) == query.shape[0]


def _window(n: int, window_size: tuple[int, int]) -> torch.Tensor:
    left, right = window_size
    distance = torch.arange(n)[:, None] - torch.arange(n)[None, :]  # query minus key
    return ((distance <= left) | (left < 0)) & ((-distance <= right) | (right < 0))


def reference_varlen(query, key, value, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                     enable_gqa=False):
    """varlen_attn's contract ([tokens, heads, dim], cumulative lengths, a window (left, right)) computed per example
    with sdpa (fp32, rounded to the queries' dtype), after the kernel's checks."""
    _check_contract(query, key, value, cu_q, cu_k, max_q, max_k)
    if not enable_gqa and key.shape[1] != query.shape[1]:
        raise ValueError("Expect query and key/value to have the same number of heads")
    out = []
    for a, b in zip(cu_q.tolist(), cu_q.tolist()[1:]):
        q, k, v = (t[a:b].transpose(0, 1)[None].float() for t in (query, key, value))
        out.append(torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=_window(b - a, tuple(window_size)), scale=scale,
            enable_gqa=enable_gqa)[0].transpose(0, 1))
    return torch.cat(out).to(query.dtype)
