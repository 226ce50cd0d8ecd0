"""The training loop: the non-finite guard skips and counts bad steps (in-process, and under ZeRO-2/3 with 2
real ranks), and eval_loss is the token-weighted mean a direct computation gives."""

from __future__ import annotations

import glob
import json
import math
import os
import subprocess

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import ROOT, SAMPLE, child_env, launch_command, read_metrics
from open_sft.distributed import setup as distributed
from open_sft.config.args import DataArguments, TrainingArguments
from open_sft.data.pipeline import prepare_data
from open_sft.training.evaluate import evaluate
from open_sft.model.loss import TokenLossModel
from open_sft.monitor.metrics import FlopCounter
from open_sft.training.optim import build_optimizer
from open_sft.training.trainer import NonFiniteError, Trainer, deepspeed_nonfinite_problems, plan_schedule


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


def test_window_of_only_skipped_steps_logs_no_loss(setup, tiny_model_dir) -> None:
    """logging_steps=1: the window of the poisoned step trained nothing, so its loss is NaN (not 0.0)."""
    trainer, _ = make_trainer(setup, tiny_model_dir, poison={2})
    records = trainer.train()
    losses = [r["loss"] for r in records]
    assert math.isnan(losses[2]) and all(math.isfinite(loss) and loss > 0 for k, loss in enumerate(losses) if k != 2)
    assert [r["nonfinite_steps"] for r in records] == [0, 0, 1, 1, 1, 1]


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


# finetune.py with a NaN loss on rank 1's forward calls listed in POISON_CALLS (0-based).
POISONED_FINETUNE = """
import os, sys
from open_sft.model import loss
from open_sft import run
poison = {int(c) for c in os.environ["POISON_CALLS"].split(",")} if os.environ["RANK"] == "1" else set()
forward, calls = loss.TokenLossModel.forward, [0]
def poisoned(self, **batch):
    out = forward(self, **batch)
    calls[0] += 1
    return out * float("nan") if calls[0] - 1 in poison else out
loss.TokenLossModel.forward = poisoned
sys.exit(run.main())
"""


def saved_tensors(checkpoint) -> dict[str, torch.Tensor]:
    """Every tensor DeepSpeed saved for a checkpoint (all ranks): weights, fp32 master partitions, Adam state."""
    def walk(obj, prefix):
        if isinstance(obj, torch.Tensor):
            yield prefix, obj
        elif isinstance(obj, dict):
            for key, value in obj.items():
                yield from walk(value, f"{prefix}/{key}")
        elif isinstance(obj, (list, tuple)):
            for i, value in enumerate(obj):
                yield from walk(value, f"{prefix}/{i}")
    found = {}
    for path in sorted(glob.glob(str(checkpoint / "pytorch_model" / "*.pt"))):
        found.update(walk(torch.load(path, map_location="cpu", weights_only=False), os.path.basename(path)))
    return found


@pytest.mark.parametrize("ds_config", ["zero2.json", "zero3.json"])
def test_nan_step_is_skipped_under_deepspeed(tiny_model_dir, tmp_path, ds_config) -> None:
    """2 ranks, fp32: a NaN on one micro-batch of rank 1 at steps 2, 4 and 5. DeepSpeed skips each such step on
    every rank, so the checkpoint after it equals the one before it tensor for tensor (weights, fp32 master
    partitions, exp_avg, exp_avg_sq, Adam step count); step 3 trains; the second NaN in a row aborts."""
    script = tmp_path / "poisoned_finetune.py"
    script.write_text(POISONED_FINETUNE)
    out = tmp_path / "out"
    args = ["--model_name_or_path", str(tiny_model_dir), "--dataset_mixer_list", str(SAMPLE), "1.0",
            "--output_dir", str(out), "--max_train_steps", "5", "--per_device_train_batch_size", "2",
            "--gradient_accumulation_steps", "2", "--learning_rate", "3e-3", "--logging_steps", "1", "--seed", "1",
            "--torch_dtype", "float32", "--max_seq_length", "256", "--max_nonfinite_steps", "2",
            "--checkpointing_steps", "1", "--keep_last_n_checkpoints", "10"]
    # 2 micro-batches per step: the second micro-batch of steps 2, 4 and 5 is forward call 3, 7, 9.
    result = subprocess.run(launch_command(2, ds_config)[:-1] + [str(script)] + args, cwd=ROOT,
                            env=child_env(POISON_CALLS="3,7,9"), capture_output=True, text=True, timeout=600)
    assert result.returncode != 0
    assert ("2 optimizer steps in a row had a non-finite loss or gradient (last at step 5)"
            in result.stdout + result.stderr), result.stderr[-4000:]

    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]  # step 5 aborted before it was logged
    assert [m["nonfinite_steps"] for m in metrics] == [0, 1, 1, 2]
    assert math.isfinite(metrics[0]["loss"]) and math.isfinite(metrics[2]["loss"])
    assert math.isnan(metrics[1]["loss"]) and math.isnan(metrics[3]["loss"])  # windows of skipped steps only
    assert [m["learning_rate"] for m in metrics] == pytest.approx([3e-3, 3e-3, 2.25e-3, 1.5e-3])  # schedule by step

    counters = [json.loads((out / "checkpoints" / f"step_{step}" / "trainer_state.json").read_text())
                for step in (1, 2, 3, 4)]  # a resumed run continues the counts (and the in-a-row abort)
    assert [(c["nonfinite_steps"], c["nonfinite_in_a_row"]) for c in counters] == [(0, 0), (1, 1), (1, 0), (2, 1)]
    state = {step: saved_tensors(out / "checkpoints" / f"step_{step}") for step in (1, 2, 3, 4)}
    assert sum("optim_states" in key and "exp_avg_sq" in key for key in state[1]) >= 2  # both ranks' Adam state
    for before, after, changes in ((1, 2, False), (2, 3, True), (3, 4, False)):
        assert state[before].keys() == state[after].keys()
        changed = [key for key in state[before] if not torch.equal(state[before][key], state[after][key])]
        if changes:  # every rank's optimizer partition moved on the good step
            assert {key.split("/")[0] for key in changed} >= {
                os.path.basename(p) for p in glob.glob(str(out / "checkpoints/step_3/pytorch_model/*optim*"))}
        else:
            assert changed == [], (before, after, changed[:5])


def test_deepspeed_settings_that_would_apply_a_nan_step() -> None:
    assert deepspeed_nonfinite_problems({"zero_optimization": {"stage": 2}, "bf16": {"enabled": False}}) == []
    assert deepspeed_nonfinite_problems({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}) == []
    assert deepspeed_nonfinite_problems({"zero_optimization": {"stage": 0}, "bf16": {"enabled": True}}) == []
    fp32_stage0 = deepspeed_nonfinite_problems({"zero_optimization": {"stage": 0}, "bf16": {"enabled": False}})
    no_check = deepspeed_nonfinite_problems(
        {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True, "check_grad_overflow": False}})
    no_norm = deepspeed_nonfinite_problems({"zero_optimization": {"stage": 1, "compute_grad_norm": False}})
    assert ["stage 0" in p for p in fp32_stage0] == [True]
    assert ["check_grad_overflow" in p for p in no_check] == [True]
    assert ["compute_grad_norm" in p for p in no_norm] == [True]
