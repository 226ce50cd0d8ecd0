"""The step plan: a run's optimizer steps, from the flags and the data (the learning-rate schedule over those
steps is open_sft.training.optim's)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from open_sft.config.args import TrainingArguments
from open_sft.data.batching import BatchLayout, PackedPlan, UnpackedPlan, locate
from open_sft.data.prepare import PreparedData
from open_sft.errors import UserError
from open_sft.training.optim import warmup_flag, warmup_steps_for, wsd_overlap_problem


@dataclass(frozen=True)
class StepPlan:
    """The run in optimizer steps: the batch layout, which examples each rank trains on at each step, how many
    steps there are and how many warm up. Derived once from the flags and the data; logged, and written to
    run.json as "schedule"."""

    layout: BatchLayout
    steps_per_epoch: int
    total_steps: int
    warmup_steps: int
    num_epochs: int
    plan: Any = None  # UnpackedPlan | PackedPlan: which examples each rank trains on at each step
    max_seq_length: int = 0  # row capacity of packed micro-batches
    balanced: bool = False  # token-balanced ranks (open_sft.data.balance)

    def position(self, done: int) -> tuple[int, int]:
        """(epoch, step within it) at which training continues after `done` optimizer steps. Under --packing
        epochs differ in steps (each epoch packs its own shuffle), so this walks the plan, never divides."""
        return locate(self.plan, done)

    def epochs_done(self, done: int) -> float:
        """Epochs completed after `done` (>= 1) optimizer steps, fractional within an epoch."""
        epoch, step_in_epoch = locate(self.plan, done - 1)
        return epoch + (step_in_epoch + 1) / self.plan.steps_in_epoch(epoch)

    def ends_epoch(self, done: int) -> bool:
        """Whether optimizer step number `done` (1-based) is the last of its epoch."""
        epoch, step_in_epoch = locate(self.plan, done - 1)
        return step_in_epoch + 1 == self.plan.steps_in_epoch(epoch)

    def describe(self) -> str:
        """The plan as one log line."""
        layout = self.layout
        tokens = getattr(self.plan, "max_tokens", None)  # --packing: micro-batches are token budgets
        micro = f"micro-batches of up to {tokens} packed tokens" if tokens else f"{layout.micro_batch_size} examples"
        return (f"{self.total_steps} optimizer steps ({self.num_epochs} epoch(s) of {self.steps_per_epoch}, "
                f"{self.warmup_steps} warming up), each {micro} × {layout.gradient_accumulation_steps} accumulation"
                f" × {layout.world_size} rank(s)" + ("" if tokens else f" = {layout.global_batch_size} examples")
                + ("; ranks balanced by tokens" if self.balanced else ""))

    def to_dict(self) -> dict:
        # --packing: a step is micro-batches of up to this many tokens, not global_batch_size examples
        tokens = getattr(self.plan, "max_tokens", None)
        return {"micro_batch_size": self.layout.micro_batch_size,
                "gradient_accumulation_steps": self.layout.gradient_accumulation_steps,
                "world_size": self.layout.world_size, "global_batch_size": self.layout.global_batch_size,
                "steps_per_epoch": self.steps_per_epoch, "total_steps": self.total_steps,
                "warmup_steps": self.warmup_steps, "num_epochs": self.num_epochs, "balanced": self.balanced,
                **({"packed_tokens_per_micro_batch": tokens} if tokens else {})}


def plan_steps(args: TrainingArguments, data: PreparedData, world_size: int, max_seq_length: int) -> StepPlan:
    layout = BatchLayout(args.per_device_train_batch_size, args.gradient_accumulation_steps, world_size)
    balanced = balances(args)
    if args.packing:
        budget = args.max_tokens_per_batch or args.per_device_train_batch_size * max_seq_length
        plan: Any = PackedPlan(data.lengths(), layout, args.seed, budget, balance=balanced)
    else:
        plan = UnpackedPlan(len(data), layout, args.seed, data.lengths() if balanced else None)
    per_epoch = plan.steps_in_epoch(0)
    if args.max_train_steps:
        total = args.max_train_steps
        epochs = locate(plan, total - 1)[0] + 1
    else:
        total = sum(plan.steps_in_epoch(e) for e in range(args.num_train_epochs))
        epochs = args.num_train_epochs
    warmup = args.warmup_steps if args.warmup_steps is not None else warmup_steps_for(args.warmup_ratio, total)
    if args.lr_scheduler_type == "constant":  # no warmup, as transformers' (constant_with_warmup has one): none said
        warmup = 0
    overlap = wsd_overlap_problem(args.lr_scheduler_type, warmup, total, args.wsd_decay_ratio, warmup_flag(args))
    if overlap:  # the flags' check (open_sft.config.checks) knew the steps only with --max_train_steps
        raise UserError(overlap)
    return StepPlan(layout, per_epoch, total, warmup, epochs, plan, max_seq_length, balanced)


def balances(args: TrainingArguments) -> bool:
    """--balance_micro_batches, whose default is on except under --loss_normalization mean."""
    if args.balance_micro_batches is not None:
        return args.balance_micro_batches
    if args.sequence_parallel_size > 1 and not args.packing:
        return False  # Ulysses wants micro-batches of a fixed row count; balanced ones vary
    return args.loss_normalization != "mean"
