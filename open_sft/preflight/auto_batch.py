"""--auto_micro_batch_size: the largest micro-batch whose estimated memory fits, with the accumulation
raised so the global batch stays what the user asked for.

HF Trainer's auto_find_batch_size halves the batch after an out-of-memory error, which changes the global
batch (and so the training math), and refuses ZeRO-3. Here the choice is made before anything is
allocated, from the preflight memory estimate (on CPU an out-of-memory kills the process, so trying and
catching is not an option), and only among micro-batches that divide the per-rank batch exactly: with
token-normalised loss the run is then the same run, only split differently. A loss that depends on the split is
refused: --loss_normalization mean and --load_balancing_loss with the flags (open_sft.config.checks), a router loss
the model's config asks for here, once the model is known.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

from open_sft.errors import UserError
from open_sft.model.anatomy import causal_lm_of
from open_sft.model.router_loss import router_loss_choice
from open_sft.preflight.estimate import GIB, estimate_run

if TYPE_CHECKING:
    from open_sft.distributed.parallelism import Parallelism

logger = logging.getLogger(__name__)
# Leave room for what the estimate does not see (fragmentation, other processes' page cache pressure).
SAFETY_FRACTION = 0.9


def divisors_descending(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]


def _agree(fits: list[bool], parallelism: Parallelism) -> list[bool]:
    """Whether each candidate fits on every rank. Each rank measured its own process memory, so near the
    budget they could disagree; choosing different micro-batches would split the data inconsistently.
    The process group is started here (as the Accelerator would start it; it reuses this state)."""
    if not parallelism.distributed:
        return fits
    import torch
    from accelerate import PartialState

    from open_sft.distributed.collectives import all_reduce_sum

    on_cpu = not torch.cuda.is_available()
    PartialState(cpu=on_cpu and not parallelism.deepspeed, **({"backend": "gloo"} if on_cpu else {}))
    counts = all_reduce_sum(torch.tensor([int(f) for f in fits], dtype=torch.int64))
    return [int(c) == parallelism.world_size for c in counts.tolist()]


def fit_micro_batch(config: Any, model: Any, data: Any, ds_config: Any, bf16: bool, baseline: int,
                    parallelism: Parallelism) -> Any:
    """The config with per_device_train_batch_size / gradient_accumulation_steps replaced by the largest
    split of the same per-rank batch that fits on every rank. Raises UserError when even 1 does not fit."""
    from open_sft.training.steps import plan_steps

    t = config.train
    refuse_a_router_loss(t.load_balancing_loss, model)
    per_rank = t.per_device_train_batch_size * t.gradient_accumulation_steps
    world_size = parallelism.world_size
    candidates, fits, tried = [], [], []
    for micro in divisors_descending(per_rank):
        train = dataclasses.replace(t, per_device_train_batch_size=micro, gradient_accumulation_steps=per_rank // micro)
        candidate = dataclasses.replace(config, train=train)
        steps = plan_steps(train, data, world_size, config.data.max_seq_length)
        estimate = estimate_run(candidate, model, steps, data, ds_config, bf16, baseline, parallelism)
        budget = SAFETY_FRACTION * estimate.device_bytes
        candidates.append(candidate)
        fits.append(estimate.memory.total <= budget)
        tried.append(f"{micro} × {per_rank // micro}: {estimate.memory.total / GIB:.2f} GiB")
    for candidate, fit in zip(candidates, _agree(fits, parallelism)):
        if fit:
            logger.info("--auto_micro_batch_size: micro-batch %d × accumulation %d per rank (estimates: %s; "
                        "budget %.2f GiB = %.0f%% of %s)", candidate.train.per_device_train_batch_size,
                        candidate.train.gradient_accumulation_steps, "; ".join(tried), budget / GIB,
                        100 * SAFETY_FRACTION, estimate.device_name)
            return candidate
    raise UserError(
        f"--auto_micro_batch_size: no micro-batch fits {SAFETY_FRACTION:.0%} of the memory per rank "
        f"({estimate.device_bytes / GIB:.2f} GiB, {estimate.device_name}); estimates: {'; '.join(tried)}. Use "
        "--gradient_checkpointing, a shorter --max_seq_length, ZeRO-3 or LoRA, or more memory")


def refuse_a_router_loss(flag: Any, model: Any) -> None:
    """A router load-balancing loss that the model's config turns on (output_router_logits: true, the flag not
    given) is computed over each micro-batch's routing: another micro-batch size would train another loss."""
    on, _ = router_loss_choice(flag, causal_lm_of(model).config)
    if on:
        raise UserError("--auto_micro_batch_size: the model's config trains the router's load-balancing loss "
                        "(output_router_logits: true), which is computed over each micro-batch's routing, so "
                        "another micro-batch size would train another loss; set --per_device_train_batch_size and "
                        "--gradient_accumulation_steps yourself, or pass --no_load_balancing_loss")
