"""Learning-rate schedules against their formulas, decay groups, and fused AdamW against the reference loop."""

from __future__ import annotations

import math

import pytest
import torch

from open_sft.training.optim import (build_optimizer, fused_adamw_supported, lr_multiplier, optimizer_impl, param_groups,
                             warmup_steps_for)


@pytest.mark.parametrize("kind, step, expected", [
    # total 100 steps, 10 warmup: warmup reaches the peak at step 9
    ("linear", 0, 0.1), ("linear", 9, 1.0), ("linear", 10, 1.0), ("linear", 55, 1 - 45 / 90), ("linear", 99, 1 / 90),
    ("cosine", 10, 1.0), ("cosine", 55, 0.5 * (1 + math.cos(math.pi * 0.5))), ("cosine", 99, 0.5 * (1 + math.cos(math.pi * 89 / 90))),
    ("constant", 0, 1.0), ("constant", 99, 1.0),
    ("constant_with_warmup", 4, 0.5), ("constant_with_warmup", 50, 1.0),
    ("wsd", 4, 0.5), ("wsd", 89, 1.0), ("wsd", 90, 1 - 1 / 11), ("wsd", 99, 1 - 10 / 11),
])
def test_schedules_follow_the_formula(kind, step, expected) -> None:
    assert lr_multiplier(kind, step, warmup_steps=10, total_steps=100) == pytest.approx(expected)


def test_warmup_steps_and_decay_groups() -> None:
    assert warmup_steps_for(0.03, 100) == 3 and warmup_steps_for(0.0, 100) == 0
    # the product rounded before the ceiling: 0.07 × 100 is 7.000000000000001 in floating point
    assert warmup_steps_for(0.07, 100) == 7 and warmup_steps_for(0.03, 50) == 2 and warmup_steps_for(0.1, 13) == 2
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and [p.shape for p in decay["params"]] == [torch.Size([4, 4])]
    assert no_decay["weight_decay"] == 0.0 and len(no_decay["params"]) == 3  # bias, norm weight, norm bias


def test_fused_adamw_matches_the_reference_loop() -> None:
    """30 steps with weight decay on matrices only: the fused kernel build_optimizer picks on CPU gives the
    weights and Adam moments of torch's single-tensor loop within float32 rounding (observed: weights and
    moments equal to < 1e-6 in relative norm). The optimizer always holds fp32 weights here (bf16 runs keep fp32 master weights)."""
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.LayerNorm(256), torch.nn.Linear(256, 64))
    fused_model, reference_model = model(), model()
    fused = build_optimizer(fused_model, 1e-2, 0.1)
    reference = torch.optim.AdamW(param_groups(reference_model, 0.1), lr=1e-2, betas=(0.9, 0.999), eps=1e-8,
                                  foreach=False)
    assert optimizer_impl(fused) == {"class": "torch.optim.adamw.AdamW", "implementation": "fused", "wrapped_by": []}
    generator = torch.Generator().manual_seed(1)
    for _ in range(30):
        x = torch.randn(16, 64, generator=generator)
        for net, optimizer in ((fused_model, fused), (reference_model, reference)):
            optimizer.zero_grad()
            net(x).pow(2).mean().backward()
            optimizer.step()
    start = model()
    for (name, a), b, b0 in zip(fused_model.named_parameters(), reference_model.parameters(), start.parameters()):
        assert not torch.equal(b, b0), name  # the comparison is over weights that really moved
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
        for key in ("exp_avg", "exp_avg_sq"):  # moments pass through zero: compare relative norms (observed < 1e-6)
            ours, theirs = fused.state[a][key], reference.state[b][key]
            assert float((ours - theirs).norm() / theirs.norm()) < 1e-5, (name, key)


def test_foreach_where_fused_is_not_built(monkeypatch) -> None:
    """The meta device has no fused kernel: the probe says so, and where it says so AdamW falls back to foreach."""
    from open_sft.training import optim

    assert fused_adamw_supported([torch.zeros(2)]) and not fused_adamw_supported([torch.zeros(2, device="meta")])
    monkeypatch.setattr(optim, "fused_adamw_supported", lambda params: False)
    assert optimizer_impl(build_optimizer(torch.nn.Linear(4, 4), 1e-3, 0.0))["implementation"] == "foreach"


def test_parameters_on_the_meta_device_are_not_stepped() -> None:
    """Another pipeline stage's parameters (open_sft.distributed.pipeline) are not this rank's to step."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with torch.device("meta"):
        model[1] = torch.nn.Linear(4, 4)
    stepped = [p for group in build_optimizer(model, 1e-3, 0.1).param_groups for p in group["params"]]
    assert len(stepped) == 2 and all(not p.is_meta for p in stepped)
