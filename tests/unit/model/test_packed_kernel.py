"""What reaches torch's CUDA variable-length flash attention, held to the kernel's contract by its CPU stand-in
(tests/unit/model/varlen_stand_in.py): CPU tensors never (the start-up packing check ran the model on the CPU on
every GPU machine and crashed), head sizes over 256 or not a multiple of 8 never (Gemma-4's 512-wide full-attention
layers), sliding-window layers with the window the kernel applies as transformers' mask does."""

from __future__ import annotations

import functools

import pytest
import torch
import transformers
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from open_sft.model import packed_attention
from tests.unit.model.varlen_stand_in import cpu_as_gpu, own_sdpa_entry, reference_varlen  # noqa: F401 (fixtures)

POSITIONS = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]])  # examples 3 2 5 | 6 4
SEGMENT = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, 2], [0, 0, 0, 0, 0, 0, 1, 1, 1, 1]])


def block_mask(window: int | None = None) -> torch.Tensor:
    """transformers' [batch, 1, row, row] mask for the packed rows: causal within each example, within `window`
    where given (query i sees keys j with i - window < j <= i: masking_utils.sliding_window_overlay)."""
    i = torch.arange(10)
    mask = (SEGMENT[:, :, None] == SEGMENT[:, None, :]) & (i[:, None] >= i[None, :])
    if window is not None:
        mask &= i[:, None] - i[None, :] < window
    return mask[:, None]


def attend(head_dim: int, window: int | None = None, kernel=reference_varlen) -> tuple:
    """The packed attention's output and the masked sdpa's for bf16 rows (GQA: 4 query heads, 2 kv heads), with the
    keyword arguments each kernel call got."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, 10, head_dim, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, 10, head_dim, dtype=torch.bfloat16) for _ in range(2))
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    expected, _ = sdpa_attention_forward(module, q.float(), k.float(), v.float(), block_mask(window), scaling=0.3)
    calls = []

    @functools.wraps(kernel)  # its signature: which keywords the kernel takes
    def recording(*args, **kwargs):
        calls.append(kwargs)
        return kernel(*args, **kwargs)

    wrapped = packed_attention._per_example(sdpa_attention_forward, recording)
    out, _ = wrapped(module, q, k, v, block_mask(window), position_ids=POSITIONS, scaling=0.3, sliding_window=window)
    return out.float(), expected, calls


def test_cpu_tensors_take_the_per_example_calls_not_the_cuda_kernel() -> None:
    """The kernel runs on CUDA tensors only: a model still on the CPU under a GPU machine's kernel (the start-up
    check before accelerate moved it) attends one example at a time instead of NotImplementedError."""
    out, expected, calls = attend(16)
    assert calls == []
    torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("head_dim", [512, 12])
def test_head_sizes_the_kernel_refuses_take_the_per_example_calls(head_dim, cpu_as_gpu) -> None:
    """mha_varlen_fwd takes head sizes up to 256, multiples of 8: Gemma-4's full-attention layers (global_head_dim
    512) attend one example at a time instead of a RuntimeError on the GPU; 16 still takes the kernel."""
    out, expected, calls = attend(head_dim)
    assert calls == []
    torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2)
    assert len(attend(16)[2]) == 1


@pytest.mark.parametrize("window, window_size", [(6, (-1, 0)), (3, (2, 0)), (1, (0, 0))])
def test_sliding_window_layers_take_the_kernel_with_transformers_window(window, window_size, cpu_as_gpu) -> None:
    """A sliding layer (Mistral, Gemma-3, OLMo-3: transformers passes sliding_window and the windowed mask) takes the
    kernel: causal where no example is longer than the window (6: the longest is 6), else the window as the kernel's
    (left, 0) = (window - 1, 0), which gives what transformers' windowed mask gives (a key window - 1 back is seen,
    one window back is not: off by one, window 3 would differ from the mask by ~0.3 here)."""
    out, expected, calls = attend(16, window)
    assert [c["window_size"] for c in calls] == [window_size]
    torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2)
    if window == 3:
        @functools.wraps(reference_varlen)
        def one_more(*args, **kwargs):
            return reference_varlen(*args, **{**kwargs, "window_size": (3, 0)})

        wrong, _, _ = attend(16, window, kernel=one_more)
        assert float((wrong - expected).abs().max()) > 0.1


def test_a_kernel_without_window_takes_sliding_layers_only_where_every_example_fits(cpu_as_gpu) -> None:
    """torch 2.10/2.11's kernel is causal only (is_causal, no window_size): a sliding layer takes it where the window
    changes nothing, else the per-example calls apply the window."""
    def causal_only(query, key, value, cu_q, cu_k, max_q, max_k, is_causal=False, scale=None, enable_gqa=False):
        assert is_causal
        return reference_varlen(query, key, value, cu_q, cu_k, max_q, max_k, scale=scale, window_size=(-1, 0),
                                enable_gqa=enable_gqa)

    assert len(attend(16, 6, causal_only)[2]) == 1
    out, expected, calls = attend(16, 3, causal_only)
    assert calls == []
    torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("at_once", [2**26, 20])
def test_a_mask_is_judged_within_each_example_in_blocks_of_query_rows(at_once, monkeypatch) -> None:
    """A mask is plain where it is causal (within the layer's window) inside each example; across examples it is not
    judged (each example attends to its own keys only), so Gemma-4's sliding mask over the whole row is plain. Judged
    in blocks of query rows (20 elements: one row at a time) the verdicts are the same."""
    monkeypatch.setattr(packed_attention, "JUDGED_AT_ONCE", at_once)
    judge, lengths = packed_attention._causal_within_examples, [3, 2, 5, 6, 4]
    assert judge(block_mask(), lengths, None) and judge(block_mask(3), lengths, 3)
    assert not judge(block_mask(3), lengths, None) and not judge(block_mask(), lengths, 3)
    whole = torch.ones(10, 10, dtype=torch.bool).tril()[None, None].expand(2, 1, 10, 10)
    assert judge(whole, lengths, None)
    late = block_mask().clone()
    late[1, 0, 9, 6] = False  # the last query of the last example does not see its example's first key
    assert not judge(late, lengths, None)


def tiny_gemma4() -> transformers.PreTrainedModel:
    config = transformers.Gemma4TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=16)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def test_gemma4_packed_rows_train_on_the_kernel_where_it_applies(cpu_as_gpu, monkeypatch) -> None:
    """Tiny Gemma-4 (5 sliding layers of head size 32, window 16; a full-attention layer of head size 512): packed
    examples of 10 and 20 tokens give each example's logits alone; the sliding layers take the kernel with the window
    (15, 0), the 512-wide layer the per-example calls."""
    model = tiny_gemma4()
    assert [layer.self_attn.head_dim for layer in model.model.layers] == [32] * 5 + [512]
    shapes = []

    @functools.wraps(reference_varlen)
    def kernel(*args, **kwargs):
        shapes.append((args[0].shape[-1], kwargs["window_size"]))
        return reference_varlen(*args, **kwargs)

    monkeypatch.setattr(packed_attention, "varlen_kernel", lambda: kernel)
    assert packed_attention.install(model, varlen=True)
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(10), torch.arange(20)])[None]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        packed = model(input_ids=ids, position_ids=positions).logits.float()
        alone = torch.cat([model(input_ids=ids[:, :10]).logits, model(input_ids=ids[:, 10:]).logits], dim=1).float()
    assert shapes == [(32, (15, 0))] * 5
    torch.testing.assert_close(packed, alone, rtol=5e-2, atol=5e-2)


def test_a_mask_wider_than_the_layers_window_still_gets_the_window() -> None:
    """A sliding layer whose mask from transformers allows more than its window (causal within each example, no
    window) is judged not plain and attends each example through its block of that mask: the layer's window is
    applied to that block too, as an example alone gets it, not dropped (window 3; examples of 3, 2, 5 | 6, 4)."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, 10, 16)
    k, v = (torch.randn(2, 2, 10, 16) for _ in range(2))
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    expected, _ = sdpa_attention_forward(module, q, k, v, block_mask(3), scaling=0.3)
    wider, _ = sdpa_attention_forward(module, q, k, v, block_mask(None), scaling=0.3)
    assert (expected - wider).abs().max() > 0.1  # the window matters here
    wrapped = packed_attention._per_example(sdpa_attention_forward)
    out, _ = wrapped(module, q, k, v, block_mask(None), position_ids=POSITIONS, scaling=0.3, sliding_window=3)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
