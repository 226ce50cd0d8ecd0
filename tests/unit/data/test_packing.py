"""Padding-free packing: the plan covers every example once under the budget, and a packed
micro-batch gives the same loss and gradients as the same examples padded."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from open_sft.data.batching import (COUNT_KEYS, BatchLayout, PackedPlan, as_filler, best_fit_decreasing, collate,
                                    collate_packed)
from open_sft.data.labels import IGNORE_INDEX, Example
from open_sft.model.loss import TokenLossModel


def random_examples(n: int, vocab: int, seed: int = 0) -> list[Example]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.choice([3, 7, 19, 40, 90])  # very different lengths
        ids = [rng.randrange(10, vocab) for _ in range(length)]
        labels = [IGNORE_INDEX if i < length // 3 else t for i, t in enumerate(ids)]
        out.append(Example(ids, labels))
    return out


def test_best_fit_decreasing() -> None:
    bins, leftover = best_fit_decreasing({0: 6, 1: 5, 2: 4, 3: 3, 4: 2}, capacity=10)
    assert sorted(sorted(b) for b in bins) == [[0, 2], [1, 3, 4]]
    assert leftover == []
    bins, leftover = best_fit_decreasing({0: 6, 1: 5, 2: 4, 3: 3, 4: 2}, capacity=10, bins=1)
    assert bins == [[0, 2]] and leftover == [1, 3, 4]


def test_packed_plan_covers_each_example_once_within_budget() -> None:
    rng = random.Random(1)
    lengths = [rng.randint(5, 256) for _ in range(500)]
    layout = BatchLayout(micro_batch_size=4, gradient_accumulation_steps=2, world_size=2)
    plan = PackedPlan(lengths, layout, seed=3, max_tokens=1024)
    steps = plan.epoch(0)
    seen = [i for step in steps for slot in step for i in slot]
    assert sorted(seen) == list(range(500))
    assert all(sum(lengths[i] for i in slot) <= 1024 for step in steps for slot in step)
    assert all(len(step) == 4 for step in steps)
    assert sum(lengths) / (len(steps) * 4 * 1024) > 0.9  # little padding
    assert PackedPlan(lengths, layout, seed=3, max_tokens=1024).epoch(0) == steps  # same on every rank
    assert plan.epoch(1) != steps
    per_rank = [plan.micro_batches(0, 0, rank) for rank in (0, 1)]
    assert not set(sum(per_rank[0], [])) & set(sum(per_rank[1], []))



def _examples_per_step(micro_batch: int, accumulation: int, world: int, max_seq_length: int = 10) -> list[int]:
    """Examples in each packed step of twelve 6-token examples (all alike: the shuffle cannot matter) under the
    default budget, micro_batch × max_seq_length tokens per micro-batch."""
    layout = BatchLayout(micro_batch, accumulation, world)
    plan = PackedPlan([6] * 12, layout, seed=0, max_tokens=micro_batch * max_seq_length)
    return [sum(len(slot) for slot in step) for step in plan.epoch(0)]


def test_packed_steps_follow_the_micro_batch_budget_not_only_the_step_budget() -> None:
    """The README's word: a packed step is the same for any split of its micro-batches between accumulation and
    ranks, not for another budget per micro-batch. Each step has 40 tokens of room in every layout below; four
    10-token micro-batches hold one 6-token example each (the window's other two wait), two 20-token ones three
    each, one 40-token one six."""
    assert _examples_per_step(1, 4, 1) == _examples_per_step(1, 2, 2) == _examples_per_step(1, 1, 4) == [4, 4, 4]
    assert _examples_per_step(2, 2, 1) == _examples_per_step(2, 1, 2) == [6, 6]
    assert _examples_per_step(4, 1, 1) == [6, 6]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    torch.manual_seed(0)
    return TokenLossModel(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)).train()


def loss_and_grads(model, batch) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    batch = {k: v for k, v in batch.items() if k not in COUNT_KEYS}
    loss = model(**batch)
    loss.backward()
    return float(loss), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_packed_equals_padded_and_a_wrong_mask_does_not(model) -> None:
    vocab = model.model.config.vocab_size
    examples = random_examples(8, vocab)
    padded_loss, padded_grads = loss_and_grads(model, collate(examples, pad_token_id=0))
    packed = collate_packed(examples, pad_token_id=0, row_capacity=128)
    assert packed["input_ids"].shape[0] < len(examples)  # several examples share a row
    packed_loss, packed_grads = loss_and_grads(model, packed)
    assert packed_loss == pytest.approx(padded_loss, rel=1e-5)
    # Equal to fp32 rounding: the two layouts reach each gradient by different kernels (per-element differences
    # reach ~1e-6 on entries of cancelling sums), so each parameter's gradient is held as a whole.
    for name, grad in padded_grads.items():
        assert float((packed_grads[name] - grad).norm() / grad.norm()) < 1e-5, name
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-4, atol=5e-6)

    # Positions that do not restart make the examples of a row attend to each other: must differ.
    wrong = dict(packed)
    wrong["position_ids"] = torch.arange(packed["input_ids"].shape[1]).expand_as(packed["input_ids"]).clone()
    wrong_loss, wrong_grads = loss_and_grads(model, wrong)
    assert abs(wrong_loss - padded_loss) / padded_loss > 1e-4  # 10× the tolerance the right mask meets
    drift = max(float((wrong_grads[n] - g).norm() / g.norm()) for n, g in padded_grads.items() if g.norm() > 0)
    assert drift > 1e-2


def test_a_filler_computes_its_tokens_but_counts_none() -> None:
    """A filler (an empty micro-batch slot's loss-free copy of an example) keeps its inputs, the positions the
    device computes, but trains no label and reports no tokens: not the data's (total_tokens, MFU's FLOPs)."""
    examples = random_examples(3, vocab=100)
    for real, filler in ((collate(examples, 0), collate(examples, 0, loss_free=True)),
                         (collate_packed(examples, 0, 128), as_filler(collate_packed(examples, 0, 128)))):
        assert torch.equal(real["input_ids"], filler["input_ids"]) and (filler["labels"] == IGNORE_INDEX).all()
        assert all(int(real[key].sum()) > 0 and int(filler[key].sum()) == 0 for key in COUNT_KEYS)
