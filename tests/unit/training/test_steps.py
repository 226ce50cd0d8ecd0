"""The step plan's epoch boundaries: under --packing each epoch packs its own shuffle, so epochs differ in steps."""

from __future__ import annotations

import random

from open_sft.data.batching import BatchLayout, PackedPlan, UnpackedPlan
from open_sft.training.steps import StepPlan


def _plan(inner) -> StepPlan:
    per_epoch = [inner.steps_in_epoch(e) for e in range(4)]
    return StepPlan(inner.layout, per_epoch[0], sum(per_epoch), 0, 4, inner, 1024)


def test_packed_epochs_of_different_lengths_end_where_they_really_end() -> None:
    rng = random.Random(0)
    lengths = [rng.randint(10, 500) for _ in range(300)]
    inner = PackedPlan(lengths, BatchLayout(2, 2, 1), seed=0, max_tokens=1024)
    per_epoch = [inner.steps_in_epoch(e) for e in range(4)]
    assert per_epoch == [42, 42, 43, 42]  # epoch 2 packs into one more step: epoch 0's count is not every epoch's
    plan = _plan(inner)
    ends = [sum(per_epoch[:e + 1]) for e in range(4)]  # 42, 84, 127, 169
    assert [done for done in range(1, plan.total_steps + 1) if plan.ends_epoch(done)] == ends
    assert [plan.epochs_done(done) for done in ends] == [1.0, 2.0, 3.0, 4.0]
    assert plan.position(127) == (3, 0) and plan.position(126) == (2, 42)
    assert plan.epochs_done(85) == 2 + 1 / 43


def test_unpacked_epochs_are_even() -> None:
    plan = _plan(UnpackedPlan(10, BatchLayout(2, 1, 1), seed=0))
    assert [done for done in range(1, plan.total_steps + 1) if plan.ends_epoch(done)] == [5, 10, 15, 20]
    assert plan.position(7) == (1, 2) and plan.epochs_done(7) == 1.4
