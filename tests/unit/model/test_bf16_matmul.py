"""bf16 matmuls on fp32 kernels (CPUs without native bf16): the same numerics as bf16 autocast, chosen
when the probe measures bf16 slower, or forced with OPEN_SFT_BF16_MATMULS.

The tests of this subject that launch real processes are in tests/integration/test_bf16_matmul.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from open_sft.model import bf16_matmul
from open_sft.model import precision
from open_sft.config.args import ModelArguments
from open_sft.errors import UserError
from open_sft.model.fused_ce import lm_head_loss_sum
from open_sft.model.precision import choose_dtype


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


def native_and_emulated(x: torch.Tensor, layer: nn.Linear):
    """(output, grad_x, grad_w, grad_b) of `layer(x)` under bf16 autocast, natively and via fp32."""
    results = []
    for via_fp32 in (False, True):
        module = copy.deepcopy(layer)
        if via_fp32:
            assert bf16_matmul.install(module) == 1
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = module(xi)
        (out.float() * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
        results.append((out, xi.grad, module.weight.grad, module.bias.grad))
    return results


def test_linear_matches_bf16_autocast_in_values_and_dtypes() -> None:
    torch.manual_seed(0)
    x, layer = torch.randn(3, 40, 96), nn.Linear(96, 200)
    (out, gx, gw, gb), (e_out, e_gx, e_gw, e_gb) = native_and_emulated(x, layer)
    assert e_out.dtype == out.dtype == torch.bfloat16
    assert (e_gx.dtype, e_gw.dtype, e_gb.dtype) == (gx.dtype, gw.dtype, gb.dtype) == (torch.float32,) * 3
    # Both are bf16 products with fp32 accumulation: they differ by summation order and one rounding.
    for a, b in ((e_out, out), (e_gx, gx), (e_gw, gw), (e_gb, gb)):
        assert rel_err(a, b) < 1e-2
    # And they are really bf16-rounded, not fp32: far from the fp32 result's last bits.
    assert rel_err(e_out, F.linear(x, layer.weight, layer.bias)) > 1e-4
    exact = F.linear(x.bfloat16().float(), layer.weight.bfloat16().float(), layer.bias.bfloat16().float()).bfloat16()
    assert torch.equal(e_out, exact)


def test_only_bf16_calls_are_rerouted_and_copies_keep_their_own_weights() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    assert bf16_matmul.install(model) == 2 and bf16_matmul.install(model) == 0  # idempotent
    x = torch.randn(5, 8)
    assert torch.equal(model(x), F.linear(F.relu(F.linear(x, *model[0].parameters())), *model[2].parameters()))
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin[2].weight.zero_(), twin[2].bias.zero_()
    assert torch.equal(twin(x), torch.zeros(5, 4)) and not torch.equal(model(x), torch.zeros(5, 4))


def test_fused_lm_head_loss_matches_native_bf16() -> None:
    torch.manual_seed(0)
    head, hidden, targets = nn.Linear(64, 1000, bias=False), torch.randn(300, 64), torch.randint(0, 1000, (300,))
    results = []
    for via_fp32 in (False, True):
        module = copy.deepcopy(head)
        if via_fp32:
            bf16_matmul.install(module)
        h = hidden.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = lm_head_loss_sum(module, h, targets, chunk_rows=128)
        loss.backward()
        results.append((loss, h.grad, module.weight.grad))
    (loss, gh, gw), (e_loss, e_gh, e_gw) = results
    assert float(e_loss) == pytest.approx(float(loss), rel=2e-3)
    assert rel_err(e_gh, gh) < 1e-2 and rel_err(e_gw, gw) < 1e-2


def test_choice_follows_the_probe_and_the_override(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv(precision.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(precision, "cpu_flags", lambda: ("Test CPU", {"avx2"}))

    def measure(bf16: float, fp32: float):
        return lambda shapes, dtype: bf16 if dtype == torch.bfloat16 else fp32

    wanted = ModelArguments(torch_dtype="bfloat16")
    assert choose_dtype(wanted, measure=measure(17.0, 104.0)).bf16_via_fp32  # emulated bf16: fp32 kernels
    monkeypatch.setenv(precision.CACHE_ENV, str(tmp_path / "native"))
    fast = choose_dtype(wanted, measure=measure(700.0, 180.0))
    assert not fast.bf16_via_fp32 and fast.to_dict()["bf16_matmuls_via_fp32"] is False
    monkeypatch.setenv(bf16_matmul.ENV, "fp32")
    assert choose_dtype(wanted, measure=measure(700.0, 180.0)).bf16_via_fp32
    monkeypatch.setenv(bf16_matmul.ENV, "native")
    assert not choose_dtype(wanted, measure=measure(17.0, 104.0)).bf16_via_fp32
    monkeypatch.setenv(bf16_matmul.ENV, "fast")
    with pytest.raises(UserError, match="OPEN_SFT_BF16_MATMULS='fast' is not one of auto, fp32, native"):
        choose_dtype(wanted, measure=measure(17.0, 104.0))


def test_sdpa_attention_runs_in_fp32_and_matches_native_bf16(tiny_model_dir) -> None:
    from transformers import AutoModelForCausalLM
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    torch.manual_seed(0)
    native = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa")
    emulated = copy.deepcopy(native)
    ids = torch.randint(3, native.config.vocab_size, (2, 24))
    try:
        assert bf16_matmul.install(emulated) > 0
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is bf16_matmul._sdpa_via_fp32
        grads = []
        for model in (native, emulated):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(input_ids=ids, use_cache=False).logits
            logits.float().logsumexp(-1).sum().backward()
            grads.append((logits, model.get_input_embeddings().weight.grad))
        (logits, grad), (e_logits, e_grad) = grads
        assert rel_err(e_logits, logits) < 2e-2 and rel_err(e_grad, grad) < 2e-2
        # fp32 inputs pass straight through the replaced entry: a model without autocast is unchanged.
        with torch.no_grad():
            assert torch.equal(emulated(input_ids=ids).logits, native(input_ids=ids).logits)
    finally:
        ALL_ATTENTION_FUNCTIONS._local_mapping.pop("sdpa", None)


def test_tensor_parallel_layers_keep_their_forward() -> None:
    """A layer tensor parallelism sharded (a DTensor weight, a forward TP wrapped to make its inputs DTensors)
    is left alone: replacing its forward failed every TP run in bf16 on CPUs without native bf16 ("mixed
    torch.Tensor and DTensor"). One gloo process, a mesh of one."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from open_sft.model import bf16_matmul

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
        x = torch.randn(3, 8)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = model(x).float()
        parallelize_module(model, init_device_mesh("cpu", (1,)), {"1": ColwiseParallel()})
        assert bf16_matmul.install(model) == 1 and bf16_matmul.installed(model[0]) and not bf16_matmul.installed(model[1])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        torch.testing.assert_close(out.float(), expected, rtol=0, atol=2e-2)
    finally:
        dist.destroy_process_group()
