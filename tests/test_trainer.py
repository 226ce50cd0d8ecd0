"""The training loop in-process: the non-finite guard skips and counts bad steps, and eval_loss is the
token-weighted mean a direct computation gives."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import SAMPLE
from open_sft import distributed
from open_sft.config import DataArguments, TrainingArguments
from open_sft.data.pipeline import prepare_data
from open_sft.evaluate import evaluate
from open_sft.loss import TokenLossModel
from open_sft.metrics import FlopCounter
from open_sft.optim import build_optimizer
from open_sft.trainer import NonFiniteError, Trainer, plan_schedule


class Poisoned(TokenLossModel):
    """Returns a NaN loss on the forward calls listed in `poison` (0-based call numbers)."""

    def __init__(self, model, poison: set[int]):
        super().__init__(model)
        self.poison, self.calls = poison, 0

    def forward(self, **batch):
        loss = super().forward(**batch)
        self.calls += 1
        return loss * float("nan") if self.calls - 1 in self.poison else loss


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    data = prepare_data(DataArguments(dataset_mixer_list=[str(SAMPLE), "0.05"], dataset_skip_cache=True), tokenizer, 0)
    accelerator = distributed.build_accelerator(gradient_accumulation_steps=1, mixed_precision="no",
                                                deepspeed_config=None)
    return tokenizer, data, accelerator


def make_trainer(setup, tiny_model_dir, poison: set[int], **train_kwargs):
    tokenizer, data, accelerator = setup
    args = TrainingArguments(per_device_train_batch_size=4, learning_rate=1e-3, logging_steps=1, seed=0,
                             max_train_steps=6, **train_kwargs)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = Poisoned(base, poison)
    optimizer = build_optimizer(model, args.learning_rate, 0.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    schedule = plan_schedule(args, data, 1, 256)
    return Trainer(accelerator, model, optimizer, args, schedule, data, tokenizer.pad_token_id,
                   FlopCounter(base.config, 1), 1e12, None, reduce_sum=distributed.all_reduce_sum), base


def test_nan_step_is_skipped_and_counted(setup, tiny_model_dir) -> None:
    trainer, base = make_trainer(setup, tiny_model_dir, poison={2})
    before = {n: p.detach().clone() for n, p in base.named_parameters()}
    trainer.train_step(0)
    trainer.train_step(1)
    after_two = {n: p.detach().clone() for n, p in base.named_parameters()}
    assert any(not torch.equal(before[n], after_two[n]) for n in before)
    result = trainer.train_step(2)  # the poisoned step
    assert trainer.nonfinite_steps == 1 and result["trained_tokens"] == 0 and result["loss_sum"] == 0.0
    for name, param in base.named_parameters():  # no update was applied, no NaN leaked into the weights
        assert torch.equal(param, after_two[name]), name
    records = trainer.train(start_step=3)
    assert all(math.isfinite(r["loss"]) for r in records)
    assert records[-1]["nonfinite_steps"] == 1


def test_too_many_nonfinite_steps_abort(setup, tiny_model_dir) -> None:
    trainer, _ = make_trainer(setup, tiny_model_dir, poison={1, 2}, max_nonfinite_steps=2)
    with pytest.raises(NonFiniteError, match="2 optimizer steps in a row had a non-finite loss"):
        trainer.train()


def test_eval_loss_is_token_weighted(setup, tiny_model_dir) -> None:
    tokenizer, data, accelerator = setup
    model = TokenLossModel(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32))
    result = evaluate(accelerator, model, data, batch_size=7, pad_token_id=tokenizer.pad_token_id,
                      reduce_sum=distributed.all_reduce_sum)
    total, tokens = 0.0, 0
    with torch.no_grad():
        for i in range(len(data)):  # one example at a time: no padding, no batching effects
            example = data.example(i)
            ids = torch.tensor([example.input_ids])
            labels = torch.tensor([example.labels])
            total += float(model(input_ids=ids, labels=labels))
            tokens += int((labels[:, 1:] != -100).sum())
    assert result["eval_tokens"] == tokens
    assert result["eval_loss"] == pytest.approx(total / tokens, rel=1e-5)
