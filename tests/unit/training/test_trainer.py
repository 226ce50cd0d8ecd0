"""The training loop: the non-finite guard skips and counts bad steps (in-process, and under ZeRO-2/3 with 2
real ranks), and eval_loss is the token-weighted mean a direct computation gives.

The tests of this subject that launch real processes are in tests/integration/test_trainer.py.
"""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import SAMPLE
from open_sft.distributed.collectives import all_reduce_sum
from open_sft.distributed.setup import build_accelerator
from open_sft.config.args import DataArguments, TrainingArguments
from open_sft.data.prepare import prepare_data
from open_sft.training.evaluate import evaluate
from open_sft.model.loss import TokenLossModel
from open_sft.monitor.metrics import FlopCounter
from open_sft.training.optim import build_optimizer
from open_sft.training.steps import plan_steps
from open_sft.distributed.deepspeed import deepspeed_nonfinite_problems
from open_sft.training.trainer import NonFiniteError, Trainer
from tests.unit.model.flash_stub import flash_stub  # noqa: F401 (a fixture)


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
    accelerator = build_accelerator(gradient_accumulation_steps=1, mixed_precision="no",
                                                deepspeed_config=None)
    return tokenizer, data, accelerator


def make_trainer(setup, tiny_model_dir, poison: set[int], attention: str = "sdpa", **train_kwargs):
    tokenizer, data, accelerator = setup
    args = TrainingArguments(**{"per_device_train_batch_size": 4, "learning_rate": 1e-3, "logging_steps": 1,
                                "seed": 0, "max_train_steps": 6, **train_kwargs})
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    base.config._attn_implementation = attention  # flash_attention_2: what loading sets where flash-attn exists
    model = Poisoned(base, poison)
    optimizer = build_optimizer(model, args.learning_rate, 0.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    steps = plan_steps(args, data, 1, 256)
    return Trainer(accelerator, model, optimizer, args, steps, data, tokenizer.pad_token_id,
                   FlopCounter(base.config, 1), 1e12, None, reduce_sum=all_reduce_sum), base


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


@pytest.mark.parametrize("packing", [False, True])
def test_a_filler_micro_batch_is_not_data(setup, tiny_model_dir, packing) -> None:
    """The last step of an epoch with fewer examples than the global batch fills each empty micro-batch slot with
    a loss-free copy of example 0 (every rank runs the same passes): computed, but not data. The steps' tokens
    (total_tokens, tokens/s, the FLOPs of MFU) are the data's in every layout of the global batch: 2 epochs of
    4 × 2 and of 1 × 8 count each example's tokens twice; the filler's positions count as padding."""
    lengths = setup[1].lengths()
    assert len(lengths) % 8, "the data must leave the last step of an epoch partial"
    counts = []
    for micro, accumulation in ((4, 2), (1, 8)):
        trainer, _ = make_trainer(setup, tiny_model_dir, set(), per_device_train_batch_size=micro,
                                  gradient_accumulation_steps=accumulation, max_train_steps=None,
                                  num_train_epochs=2, packing=packing)
        works = [trainer._begin_step(step) for step in range(trainer.steps.total_steps)]
        fillers = [batch for w in works for batch, indices in w.batches if not indices]
        assert fillers or (micro == 4 and not packing)  # 1 × 8: 100 examples leave 4 of the last step's 8 empty
        counts.append((sum(w.tokens_global for w in works), sum(w.squares_global for w in works),
                       sum(w.row_squares_global for w in works) if not packing else None))
        assert sum(w.slots_global for w in works) >= sum(w.tokens_global for w in works) + sum(
            b["input_ids"].numel() for b in fillers)
    squares = sum(n * n for n in lengths)
    assert counts[0][:2] == counts[1][:2] == (2 * sum(lengths), 2 * squares)
    assert packing or counts[0][2] == counts[1][2] == 2 * squares  # unpacked: a row is an example


def test_packed_steps_under_flash_attention_2_are_those_of_sdpa(setup, tiny_model_dir, flash_stub) -> None:
    """A packed micro-batch's rows (here 4 × 256 tokens of examples in rows of 256) under flash_attention_2 (flash-attn
    stood in for by plain attention): the trainer hands where each example starts, and each step's loss is the one
    sdpa's block-diagonal mask gives; without them each row was one causal sequence and the loss another."""
    losses = {}
    for attention in ("sdpa", "flash_attention_2", "unsplit"):
        trainer, _ = make_trainer(setup, tiny_model_dir, set(), "sdpa" if attention == "sdpa" else "flash_attention_2",
                                  packing=True)
        assert trainer.engine.flash_rows == (attention != "sdpa")
        trainer.engine.flash_rows = attention == "flash_attention_2"  # "unsplit": as before
        flash_stub.calls.clear()
        losses[attention] = trainer.train_step(0)["loss_sum"]
        if attention == "flash_attention_2":
            assert {kind for kind, _, _ in flash_stub.calls} == {"varlen"}
            # the step's micro-batch: 4 rows of 255 positions, 50 blocks (its examples, and the padding at the end of a
            # row as a block of its own), none across a row
            (bounds,) = {tuple(b) for _, b, _ in flash_stub.calls}
            assert len(bounds) - 1 == 50 and bounds[-1] == 4 * 255 and {255, 510, 765} <= set(bounds)
    assert losses["flash_attention_2"] == pytest.approx(losses["sdpa"], rel=1e-5)
    assert abs(losses["unsplit"] - losses["sdpa"]) > 1e-4 * losses["sdpa"]  # 7e-4 here


def test_eval_loss_is_token_weighted(setup, tiny_model_dir) -> None:
    tokenizer, data, accelerator = setup
    model = TokenLossModel(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32))
    result = evaluate(accelerator, model, data, batch_size=7, pad_token_id=tokenizer.pad_token_id,
                      reduce_sum=all_reduce_sum)
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


@pytest.mark.parametrize("deepspeeds, logged", [(0.0, 0.0), (torch.tensor(0.0), 0.0), (2.5, 2.5), (None, "nan")])
def test_the_deepspeed_gradient_norm_is_logged_as_deepspeed_gives_it(deepspeeds, logged) -> None:
    """A step whose gradients are all zero (every label masked, a frozen model) has norm 0.0, which was logged as
    NaN (`norm or nan`); NaN stays for a step DeepSpeed measured no norm of."""
    from types import SimpleNamespace

    from open_sft.training.engine import DeepSpeedEngine

    engine = DeepSpeedEngine.__new__(DeepSpeedEngine)  # grad_norm reads the model alone
    engine.trainer = SimpleNamespace(model=SimpleNamespace(get_global_grad_norm=lambda: deepspeeds))
    norm = engine.grad_norm(float("nan"))
    assert math.isnan(norm) if logged == "nan" else norm == logged


@pytest.mark.parametrize("eval_batch, expected", [(None, 4), (13, 13)])
def test_evaluation_batches_by_the_eval_batch_size(setup, tiny_model_dir, monkeypatch, eval_batch, expected) -> None:
    """--per_device_eval_batch_size sets the evaluation batch (default: the training micro-batch, 4 here)."""
    from open_sft.training import engine as engine_module

    tokenizer, data, _ = setup
    trainer, _ = make_trainer(setup, tiny_model_dir, poison=set(), per_device_eval_batch_size=eval_batch)
    trainer.eval_data = data
    seen = []
    real = engine_module.evaluate
    monkeypatch.setattr(engine_module, "evaluate", lambda acc, model, d, batch_size, *rest, **kw:
                        seen.append(batch_size) or real(acc, model, d, batch_size, *rest))
    record = trainer.evaluate(1)
    assert seen == [expected] and record["eval_tokens"] == sum(example_trained(data, i) for i in range(len(data)))


def example_trained(data, index: int) -> int:
    from open_sft.data.labels import count_trained

    return count_trained(list(data.example(index).labels))


def test_batches_reach_the_model_on_the_accelerators_device(setup, tiny_model_dir, monkeypatch) -> None:
    """Batches are collated on the host: every forward pass, training and evaluation, gets them through
    to_device(batch, accelerator.device) (the first GPU run failed here: 'index is on cpu')."""
    from open_sft.data import batching
    from open_sft.training import engine as engine_module
    from open_sft.training import evaluate as evaluate_module

    moved = []

    def recording(batch, device):
        moved.append(device)
        return batching.to_device(batch, device)

    monkeypatch.setattr(engine_module, "to_device", recording)
    monkeypatch.setattr(evaluate_module, "to_device", recording)
    trainer, _ = make_trainer(setup, tiny_model_dir, poison=set(), gradient_accumulation_steps=2)
    trainer.train_step(0)
    assert trainer.model.calls == 2 and moved == [setup[2].device] * 2
    evaluate(setup[2], trainer.model, setup[1], 4, setup[0].pad_token_id, all_reduce_sum)
    assert trainer.model.calls > 2 and moved == [setup[2].device] * trainer.model.calls
    meta = batching.to_device({"input_ids": torch.ones(2, 3, dtype=torch.long)}, torch.device("meta"))
    assert meta["input_ids"].device.type == "meta" and meta["input_ids"].dtype == torch.long


def test_evaluation_and_checkpoint_saves_are_not_training_time(tiny_model_dir, tmp_path, monkeypatch) -> None:
    """A real run whose every evaluation and checkpoint save takes 1,000 s (the clock moved while they run): its
    elapsed_s and every window's tokens/s and MFU count training alone (they counted both: a window with an
    evaluation in it logged 10 tokens/s against 6,000 in training)."""
    import json
    import time

    from open_sft.run import main
    from open_sft.training.checkpointer import Checkpointer

    real, offset = time.perf_counter, [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: real() + offset[0])

    def slow(method):
        def wrapped(*args, **kwargs):
            result = method(*args, **kwargs)
            offset[0] += 1000.0
            return result
        return wrapped

    monkeypatch.setattr(Trainer, "evaluate", slow(Trainer.evaluate))
    monkeypatch.setattr(Checkpointer, "save", slow(Checkpointer.save))
    out = tmp_path / "out"
    assert main(["--model_name_or_path", str(tiny_model_dir), "--dataset_mixer_list", str(SAMPLE), "24",
                 "--eval_dataset_mixer_list", str(SAMPLE), "8", "--eval_steps", "2", "--checkpointing_steps", "3",
                 "--max_train_steps", "6", "--per_device_train_batch_size", "4", "--logging_steps", "1",
                 "--max_seq_length", "128", "--torch_dtype", "float32", "--report_to", "none",
                 "--output_dir", str(out), "--dataset_local_cache_dir", str(tmp_path / "cache")]) == 0
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if "loss" in r]
    assert len(train) == 6 and sum("eval_loss" in r for r in lines) == 3 and offset[0] >= 5000.0
    assert train[-1]["elapsed_s"] < 500.0  # 3 evaluations and 2 saves took 5,000 s of the clock
    assert all(r["tokens_per_second"] > 1.0 for r in train)  # ~1,000 here; 0.1-0.4 with a pause counted
    summary = json.loads((out / "report" / "summary.json").read_text())
    assert summary["elapsed_s"] == train[-1]["elapsed_s"] and summary["tokens_per_second"] > 1.0


def test_a_checkpoints_own_save_and_the_export_are_not_training_time(tiny_model_dir, tmp_path, monkeypatch) -> None:
    """A checkpoint records the run's training seconds and its open window's while it saves: each save of the
    model and optimizer states here takes 1,000 s (the clock moved inside it), and so does each export. The
    checkpoint of step 3 (mid-window of --logging_steps 2), the launch that resumes from it and RUN_COMPLETE count
    training alone; they counted that save (a resumed run's elapsed_s grew by the save it resumed from, its first
    window's tokens/s fell by as much) and RUN_COMPLETE the export."""
    import json
    import time

    from accelerate import Accelerator

    from open_sft.export import final
    from open_sft.run import main

    real, offset = time.perf_counter, [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: real() + offset[0])

    def slowed(method):
        def wrapped(*args, **kwargs):
            offset[0] += 1000.0
            return method(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(Accelerator, "save_state", slowed(Accelerator.save_state))
    monkeypatch.setattr(final, "write_model_card", slowed(final.write_model_card))
    out = tmp_path / "out"
    argv = ["--model_name_or_path", str(tiny_model_dir), "--dataset_mixer_list", str(SAMPLE), "24",
            "--checkpointing_steps", "3", "--max_train_steps", "6", "--per_device_train_batch_size", "4",
            "--logging_steps", "2", "--max_seq_length", "128", "--torch_dtype", "float32", "--report_to", "none",
            "--output_dir", str(out), "--dataset_local_cache_dir", str(tmp_path / "cache")]
    assert main(argv) == 0
    state = json.loads((out / "checkpoints" / "step_3" / "trainer_state.json").read_text())
    assert offset[0] == 3000.0 and state["elapsed_s"] < 500.0 and state["window"]["seconds"] < 500.0
    (out / "RUN_COMPLETE").unlink()  # the launch after a kill between the two saves: it resumes from step 3
    shutil.rmtree(out / "checkpoints" / "step_6")
    assert main(argv) == 0
    train = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in train] == [2, 4, 6] and offset[0] == 5000.0
    assert train[-1]["elapsed_s"] < 500.0 and train[1]["tokens_per_second"] > 1.0  # 0.1-0.5 with the save counted
    complete = json.loads((out / "RUN_COMPLETE").read_text())["elapsed_s"]
    assert complete == pytest.approx(train[-1]["elapsed_s"], abs=1.0)  # the steps' seconds, not the export's 1,000


def test_collating_ahead_gives_each_step_the_batches_it_would_collate(setup, tiny_model_dir, monkeypatch) -> None:
    """On a GPU the next step's micro-batches are collated in a background thread while the device computes: the
    same batches, pinned, in the same order as collating each step when it starts (a step asked out of turn, as a
    resume does, is collated then); the loop's losses are those without it."""
    import threading

    from open_sft.training.micro_batches import StepBatches

    trainer, _ = make_trainer(setup, tiny_model_dir, poison=set())
    plain = trainer.batches
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self.clone())  # no CUDA here: pinning is a copy
    threads = []
    collate_for = StepBatches.for_rank

    def recording(self, step, rank=None):
        threads.append((step, threading.current_thread().name))
        return collate_for(self, step, rank)

    ahead = StepBatches(trainer.data, trainer.steps, trainer.args, plain.pad_token_id, 0, ahead=True)
    monkeypatch.setattr(StepBatches, "for_rank", recording)
    for step, next_step in ((0, 1), (1, 2), (2, 3), (4, 5), (5, None)):  # step 3 skipped: 4 comes out of turn
        got, want = ahead.for_step(step, next_step), collate_for(plain, step)
        assert [indices for _, indices in got] == [indices for _, indices in want]
        for (a, _), (b, _) in zip(got, want):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ahead.close()
    background = {step for step, name in threads if name.startswith("open_sft-collate")}
    assert {1, 2, 3, 5} <= background and 0 in {step for step, name in threads if name == "MainThread"}
    assert (4, "MainThread") in threads  # collated ahead was step 3's; step 4 is collated when asked
    losses_plain = [r["loss"] for r in make_trainer(setup, tiny_model_dir, poison=set())[0].train()]
    trainer_ahead, _ = make_trainer(setup, tiny_model_dir, poison=set())
    trainer_ahead.batches = StepBatches(trainer.data, trainer.steps, trainer.args, plain.pad_token_id, 0, ahead=True)
    assert [r["loss"] for r in trainer_ahead.train()] == losses_plain


def test_a_steps_micro_batches_share_one_cast_of_each_weight(setup, tiny_model_dir) -> None:
    """bf16 autocast over 4 micro-batches a step: each fp32 weight is cast once a step, not once a pass (autocast's
    cache kept for the step's passes: Precision.step_casts), and the step's weights after the optimizer are bitwise
    those of casting at every pass."""
    import contextlib

    from torch.utils._python_dispatch import TorchDispatchMode

    class WeightCasts(TorchDispatchMode):
        def __init__(self, weights):
            super().__init__()
            self.weights, self.count = {id(w) for w in weights}, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.bfloat16 \
                    and id(args[0]) in self.weights:
                self.count += 1
            return func(*args, **kwargs)

    def one_step(cast_once: bool):
        trainer, base = make_trainer(setup, tiny_model_dir, poison=set(), gradient_accumulation_steps=4)
        trainer.precision.autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)
        if not cast_once:
            trainer.precision.step_casts = contextlib.nullcontext
        # the decoder's weights (the fused LM-head loss casts the head itself, with autocast off, at each pass)
        weights = [p for n, p in base.named_parameters() if p.dim() == 2 and "embed" not in n and "lm_head" not in n]
        with WeightCasts(weights) as casts:
            trainer.train_step(0)
        return casts.count, len(weights), {n: p.detach().clone() for n, p in base.named_parameters()}

    once, n_weights, after_once = one_step(cast_once=True)
    every_pass, _, after_every_pass = one_step(cast_once=False)
    assert n_weights == 2 * 7 and once == n_weights and every_pass == 4 * n_weights
    assert all(torch.equal(after_once[n], after_every_pass[n]) for n in after_once)


def test_nothing_in_the_step_waits_on_the_device_before_the_optimizer_step(setup, tiny_model_dir, monkeypatch) -> None:
    """In the GPU's layout (packed rows, packed attention, the fused loss's GPU chunks), from the first forward pass
    to the optimizer step no op reads a value off the device or makes a shape of its values (each one, on a GPU, a
    wait of the host for the device): the trained positions and the example lengths come from the host's batch, the
    non-finite verdict stays on the device (the fused AdamW skips by it). Left: transformers' own check of packed
    position ids and the packed attention's check of the mask transformers then builds, at most once per forward
    pass each. The poisoned step is skipped all the same."""
    import os
    import traceback

    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from open_sft.model import fused_ce, packed_attention
    from open_sft.training import engine as engine_module

    class DeviceReads(TorchDispatchMode):
        """The ops that wait on a GPU: a value read (.item(), bool(), int(), float()), a data-dependent shape."""

        WAITING = {"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_consecutive"}

        def __init__(self):
            super().__init__()
            self.reads, self.host_work = [], 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            by_mask = name == "index" and any(getattr(i, "dtype", None) == torch.bool for i in args[1] if i is not None)
            if self.host_work == 0 and (name in self.WAITING or by_mask):
                caller = [f for f in traceback.extract_stack() if "/open_sft/" in f.filename or "transformers" in f.filename]
                self.reads.append(f"{os.path.basename(caller[-1].filename)}:{caller[-1].name}")
            return func(*args, **(kwargs or {}))

    spy = DeviceReads()

    def on_host(function):  # the host's own work on the collated batch (on a GPU: host tensors, no wait)
        def host(*args, **kwargs):
            spy.host_work += 1
            try:
                return function(*args, **kwargs)
            finally:
                spy.host_work -= 1
        return host

    before = ALL_ATTENTION_FUNCTIONS["sdpa"]
    monkeypatch.setattr(fused_ce, "gpu_layout", lambda t: True)
    monkeypatch.setattr(engine_module, "trained_index", on_host(engine_module.trained_index))
    monkeypatch.setattr(engine_module, "known_segments", on_host(engine_module.known_segments))
    try:
        trainer, base = make_trainer(setup, tiny_model_dir, poison={2}, packing=True, gradient_accumulation_steps=2)
        assert packed_attention.install(base) and trainer.engine.skips_on_device
        adamw = trainer.optimizer.optimizer
        step = adamw.step

        def stepping(*args, **kwargs):
            spy.__exit__(None, None, None)
            return step(*args, **kwargs)

        monkeypatch.setattr(adamw, "step", stepping)
        forward_backward = trainer.engine.forward_backward
        monkeypatch.setattr(trainer.engine, "forward_backward", lambda work: (spy.__enter__(), forward_backward(work))[1])
        trainer.train_step(0)
        left = ["masking_utils.py:find_packed_sequence_indices", "packed_attention.py:_causal_within_examples"]
        assert set(spy.reads) <= set(left) and len(spy.reads) <= 2 * len(left)  # the step's two forward passes
        spy.reads.clear()
        after_first = {n: p.detach().clone() for n, p in base.named_parameters()}
        assert trainer.train_step(1)["trained_tokens"] == 0 and trainer.nonfinite_steps == 1  # calls 2 (poisoned), 3
        assert all(torch.equal(p, after_first[n]) for n, p in base.named_parameters())
        assert set(spy.reads) <= set(left) and len(spy.reads) <= 2 * len(left)
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = before


def test_total_tokens_do_not_depend_on_the_batch_layout(tiny_model_dir, tmp_path) -> None:
    """A run's total_tokens are its data's tokens, padding and fillers excluded: 42 rows, 2 epochs of global
    batch 8 (each epoch's last step has 2 examples: 4 × 2 leaves no slot empty, 1 × 8 leaves 6) log the same
    total_tokens, losses and train_tokens; the report's summary says the same."""
    import json

    from open_sft.run import main

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(SAMPLE.read_text().splitlines(keepends=True)[:42]))
    runs = {}
    for micro, accumulation in ((4, 2), (1, 8)):
        out = tmp_path / f"{micro}x{accumulation}"
        assert main(["--model_name_or_path", str(tiny_model_dir), "--dataset_mixer_list", str(rows), "1.0",
                     "--num_train_epochs", "2", "--per_device_train_batch_size", str(micro),
                     "--gradient_accumulation_steps", str(accumulation), "--logging_steps", "1", "--seed", "1",
                     "--max_seq_length", "128", "--torch_dtype", "float32", "--report_to", "none",
                     "--output_dir", str(out), "--dataset_local_cache_dir", str(tmp_path / "cache")]) == 0
        lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        summary = json.loads((out / "report" / "summary.json").read_text())
        runs[micro] = ([(r["total_tokens"], r["train_tokens"]) for r in lines], [r["loss"] for r in lines])
        assert summary["total_tokens"] == lines[-1]["total_tokens"]
    tokens = json.loads((tmp_path / "4x2" / "data_report.json").read_text())["tokens"]
    assert runs[1][0] == runs[4][0] and runs[1][0][5][0] == tokens and runs[1][0][-1][0] == 2 * tokens
    assert runs[1][1] == pytest.approx(runs[4][1], rel=1e-5)


def test_a_constant_schedule_records_no_warmup(setup) -> None:
    """constant has no warmup (transformers' neither; its lr is the peak from step 1): the plan, and so run.json, the
    log line and the model card, said '2 warming up' from the default --warmup_ratio; constant_with_warmup keeps it."""
    _, data, _ = setup
    plans = {kind: plan_steps(TrainingArguments(per_device_train_batch_size=1, max_train_steps=40, warmup_ratio=0.1,
                                                lr_scheduler_type=kind), data, 1, 256)
             for kind in ("constant", "constant_with_warmup")}
    assert (plans["constant"].warmup_steps, plans["constant_with_warmup"].warmup_steps) == (0, 4)
    assert "0 warming up" in plans["constant"].describe() and plans["constant"].to_dict()["warmup_steps"] == 0
