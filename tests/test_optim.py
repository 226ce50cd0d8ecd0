"""Learning-rate schedules against their formulas, decay groups, and the non-finite step guard."""

from __future__ import annotations

import math

import pytest
import torch

from open_sft.optim import lr_multiplier, param_groups, warmup_steps_for


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
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and [p.shape for p in decay["params"]] == [torch.Size([4, 4])]
    assert no_decay["weight_decay"] == 0.0 and len(no_decay["params"]) == 3  # bias, norm weight, norm bias
