"""What each --loss_normalization trains: the gradient of one step against autograd of the objective written out
(token: the step's token-loss sum ÷ its trained tokens; sum: the step's sum; mean: the mean of each micro-batch's
mean), and why only `token` leaves the math alone when a step's per-rank batch is split into other micro-batches
(the reason --auto_micro_batch_size is refused under mean)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import SAMPLE
from open_sft.config.args import DataArguments, TrainingArguments
from open_sft.data.batching import collate
from open_sft.data.labels import IGNORE_INDEX
from open_sft.data.prepare import prepare_data
from open_sft.distributed.collectives import all_reduce_sum
from open_sft.distributed.setup import build_accelerator
from open_sft.model.loss import TokenLossModel
from open_sft.monitor.metrics import FlopCounter
from open_sft.training.optim import build_optimizer
from open_sft.training.steps import plan_steps
from open_sft.training.trainer import Trainer


@pytest.fixture(scope="module")
def tokenizer_and_data(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    data = prepare_data(DataArguments(dataset_mixer_list=[str(SAMPLE), "0.2"], dataset_skip_cache=True), tokenizer, 0)
    return tokenizer, data


def first_step(tiny_model_dir, tokenizer_and_data, normalization: str, micro: int, accumulation: int):
    """(open_sft's gradient norm of step 1, the step's micro-batches as example indices) on the tiny model."""
    tokenizer, data = tokenizer_and_data
    accelerator = build_accelerator(gradient_accumulation_steps=accumulation, mixed_precision="no",
                                    deepspeed_config=None)
    args = TrainingArguments(per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation,
                             learning_rate=1e-3, logging_steps=1, seed=0, max_train_steps=1, clip_grad_norm=-1,
                             loss_normalization=normalization, balance_micro_batches=False)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = TokenLossModel(base)
    model, optimizer = accelerator.prepare(model, build_optimizer(model, 1e-3, 0.0))
    steps = plan_steps(args, data, 1, 256)
    trainer = Trainer(accelerator, model, optimizer, args, steps, data, tokenizer.pad_token_id,
                      FlopCounter(base.config, 1), 1e12, None, reduce_sum=all_reduce_sum)
    return trainer.train_step(0)["grad_norm"], steps.plan.micro_batches(0, 0, 0)


def reference_norm(tiny_model_dir, tokenizer_and_data, normalization: str, micro_batches: list[list[int]]) -> float:
    """The gradient norm of the objective written out, by autograd through the model's own logits."""
    tokenizer, data = tokenizer_and_data
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    sums, counts = [], []
    for indices in micro_batches:
        batch = collate([data.example(i) for i in indices], tokenizer.pad_token_id)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        targets = batch["labels"][:, 1:]
        sums.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum",
                                    ignore_index=IGNORE_INDEX))
        counts.append(int((targets != IGNORE_INDEX).sum()))
    objective = {"token": sum(sums) / sum(counts), "sum": sum(sums),
                 "mean": sum(s / c for s, c in zip(sums, counts)) / len(sums)}[normalization]
    objective.backward()
    return math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model.parameters() if p.grad is not None))


@pytest.mark.parametrize("normalization", ["token", "sum", "mean"])
def test_each_normalization_trains_the_gradient_of_its_objective(tiny_model_dir, tokenizer_and_data,
                                                                 normalization) -> None:
    norm, micro_batches = first_step(tiny_model_dir, tokenizer_and_data, normalization, micro=2, accumulation=2)
    assert len(micro_batches) == 2
    reference = reference_norm(tiny_model_dir, tokenizer_and_data, normalization, micro_batches)
    assert norm == pytest.approx(reference, rel=1e-5)
    # the three objectives differ on these micro-batches (unequal trained tokens), so each test tells them apart
    others = {other: reference_norm(tiny_model_dir, tokenizer_and_data, other, micro_batches)
              for other in ("token", "sum", "mean") if other != normalization}
    assert all(abs(norm - value) / value > 1e-3 for value in others.values())


def test_only_token_normalization_keeps_the_gradient_when_the_micro_batch_is_split(tiny_model_dir,
                                                                                 tokenizer_and_data) -> None:
    """Micro-batch 8 × accumulation 1 and 2 × 4 train the same 8 examples: under token the same gradient, under
    mean another one (the mean of four means is not the mean of one), which --auto_micro_batch_size would do."""
    whole, split = {}, {}
    for normalization in ("token", "mean"):
        whole[normalization], eight = first_step(tiny_model_dir, tokenizer_and_data, normalization, 8, 1)
        split[normalization], fours = first_step(tiny_model_dir, tokenizer_and_data, normalization, 2, 4)
        assert sorted(i for batch in fours for i in batch) == sorted(eight[0])  # the same examples
    assert split["token"] == pytest.approx(whole["token"], rel=1e-5)
    assert abs(split["mean"] - whole["mean"]) / whole["mean"] > 0.01
