"""AdamW (fused where the build supports it) with decay only on matrices, and the learning-rate schedules
as pure functions of the step."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from open_sft.model.anatomy import param_shape

if TYPE_CHECKING:
    from open_sft.config.optimizer_args import OptimizerArguments


def param_group_names(model: nn.Module) -> tuple[list[str], list[str]]:
    """The names of the trained parameters with weight decay (matrices) and without (biases, norm scales: 1-D), in
    the optimizer's order: its state's index k is the k-th name of the two lists joined (what reads another engine's
    checkpoint by name: open_sft.training.portable). A parameter on the meta device is another pipeline stage's
    (open_sft.distributed.pipeline): not this rank's to step."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad and not param.is_meta:
            (decay if len(param_shape(param)) >= 2 else no_decay).append(name)
    return decay, no_decay


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on weight matrices only: never on biases or norm scales (1-D parameters)."""
    params = dict(model.named_parameters())
    decay, no_decay = param_group_names(model)
    return [{"params": [params[n] for n in decay], "weight_decay": weight_decay},
            {"params": [params[n] for n in no_decay], "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, learning_rate: float, weight_decay: float, fused: bool = True,
                    eight_bit: bool = False, betas: tuple[float, float] = (0.9, 0.999),
                    eps: float = 1e-8) -> torch.optim.Optimizer:
    """torch AdamW: the fused kernel (one kernel per parameter group) when `fused` and this torch build has it
    for every device and dtype of the trained parameters, else the multi-tensor (foreach) implementation.
    Under DeepSpeed ZeRO the same optimizer steps the flat fp32 partitions (see optimizer_impl).
    `eight_bit` (--use_8bit_optimizer): bitsandbytes' AdamW8bit, its moments stored in 8 bits (blockwise
    quantized), same betas and eps; bitsandbytes runs it on CPU too. `betas`, `eps`: --adam_beta1/--adam_beta2,
    --adam_epsilon."""
    groups = param_groups(model, weight_decay)
    if eight_bit:
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(groups, lr=learning_rate, betas=betas, eps=eps)
    params = [p for group in groups for p in group["params"]]
    impl = {"fused": True} if fused and fused_adamw_supported(params) else {"foreach": True}
    return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, eps=eps, **impl)


def optimizer_for(model: nn.Module, args: OptimizerArguments) -> torch.optim.Optimizer:
    """build_optimizer with the flags' settings (its learning rate the peak: the trainer sets each step's)."""
    return build_optimizer(model, args.learning_rate, args.weight_decay, fused=args.fused_optimizer,
                           eight_bit=args.use_8bit_optimizer, betas=(args.adam_beta1, args.adam_beta2),
                           eps=args.adam_epsilon)


def set_hyperparameters(optimizer: torch.optim.Optimizer, weight_decay: float, betas: tuple[float, float],
                        eps: float) -> None:
    """The flags' AdamW hyperparameters on the groups of param_groups (decay, then no decay) after a resume: torch's
    load_state_dict puts the checkpoint's own back, so a setting --allow_changed_settings let change (a new
    --adam_beta2, --weight_decay) would not take, where a new --learning_rate does (the trainer sets each step's)."""
    for index, group in enumerate(optimizer.param_groups):
        group.update(betas=tuple(betas), eps=eps, weight_decay=weight_decay if index == 0 else 0.0)


def fused_adamw_supported(params: list[torch.Tensor]) -> bool:
    """Whether fused AdamW steps every (device, dtype) of `params`: torch only checks on the first step,
    so probe one step on a one-element tensor of each."""
    for device, dtype in {(p.device, p.dtype) for p in params}:
        probe = torch.zeros(1, device=device, dtype=dtype, requires_grad=True)
        probe.grad = torch.zeros_like(probe)
        try:
            torch.optim.AdamW([probe], fused=True).step()
        except RuntimeError:
            return False
    return True


def optimizer_impl(optimizer: torch.optim.Optimizer) -> dict:
    """What actually steps the weights, for run.json: the innermost optimizer, its implementation, and the
    wrappers around it (accelerate's, DeepSpeed ZeRO's)."""
    wrappers = []
    while hasattr(optimizer, "optimizer"):
        wrappers.append(type(optimizer).__name__)
        optimizer = optimizer.optimizer
    defaults = getattr(optimizer, "defaults", {})
    impl = "fused" if defaults.get("fused") else "foreach" if defaults.get("foreach") else "default"
    return {"class": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}", "implementation": impl,
            "wrapped_by": wrappers}


def lr_multiplier(kind: str, step: int, warmup_steps: int, total_steps: int, decay_ratio: float = 0.1,
                  floor: float = 0.0) -> float:
    """Learning rate of optimizer step `step` (0-based) as a fraction of the peak.

    `floor`: where linear and polynomial decay end (--final_lr_ratio; polynomial: transformers' lr_end 1e-7 as
    a fraction of the peak). cosine_with_restarts has open-instruct's one cycle, so it is cosine.

    Warmup rises linearly to the peak at step warmup_steps - 1 (no step is wasted at lr 0); linear
    decay reaches 1 / (total - warmup) of the peak at the last step, not 0 (no wasted last step).
    """
    if step < warmup_steps and kind != "constant":
        return (step + 1) / warmup_steps
    if kind in ("constant", "constant_with_warmup"):
        return 1.0
    if kind == "wsd":  # warmup, stable at the peak, then linear decay over the last decay_ratio of steps
        decay_steps = wsd_decay_steps(decay_ratio, total_steps)
        decay_start = total_steps - decay_steps
        return 1.0 if step < decay_start else max(0.0, 1.0 - (step - decay_start + 1) / (decay_steps + 1))
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    if kind in ("linear", "polynomial"):  # polynomial of power 1, transformers' default, is linear to lr_end
        return floor + (1.0 - floor) * max(0.0, 1.0 - progress)
    if kind in ("cosine", "cosine_with_restarts"):
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown schedule {kind!r}")


def wsd_decay_steps(decay_ratio: float, total_steps: int) -> int:
    """The last steps over which wsd decays: ceil(ratio × steps), at least one, of the product rounded first as
    warmup_steps_for rounds it (0.07 × 100 is 7.000000000000001: 7 decay steps, not 8)."""
    return max(1, math.ceil(round(decay_ratio * total_steps, 9)))


def warmup_flag(args: Any) -> str:
    """The flag that set the warmup (TrainingArguments' --warmup_steps or --warmup_ratio), as given."""
    return f"--warmup_steps {args.warmup_steps}" if args.warmup_steps is not None else \
        f"--warmup_ratio {args.warmup_ratio:g}"


def wsd_overlap_problem(kind: str, warmup_steps: int, total_steps: int, decay_ratio: float,
                        warmup_flag: str) -> str | None:
    """Why a wsd schedule's warmup runs into its decay (the rate would climb to the peak inside the decay, then drop
    back to the decay's line: --max_train_steps 20, --warmup_ratio 0.5, --wsd_decay_ratio 0.6 trained steps 9-11 at
    0.9, 1.0, 0.77 of the peak), or None. `warmup_flag`: the flag that set the warmup, as given. One step has no
    shape to break. The warmup's last step may be the decay's first: that step trains at the peak and the decay
    goes on from it (ratios adding to 1.0, each rounded up: 0.1 and 0.9 of 15 steps are 2 and 14)."""
    if kind != "wsd" or total_steps <= 1:
        return None
    decay = wsd_decay_steps(decay_ratio, total_steps)
    if warmup_steps <= total_steps - decay + 1:
        return None
    return (f"--lr_scheduler_type wsd: {warmup_flag} makes {warmup_steps} warmup steps, which run into the decay over "
            f"the last {decay} of the {total_steps} steps (--wsd_decay_ratio {decay_ratio:g}): the learning rate would "
            f"rise to its peak inside the decay, then drop; lower {warmup_flag} or --wsd_decay_ratio so that warmup "
            f"and decay fit in {total_steps} steps")


POLYNOMIAL_LR_END = 1e-7  # transformers' get_polynomial_decay_schedule_with_warmup default, as open-instruct uses it


def schedule_floor(kind: str, learning_rate: float, final_lr_ratio: float | None) -> float:
    """The `floor` of lr_multiplier for the flags."""
    if kind == "polynomial":
        return min(1.0, POLYNOMIAL_LR_END / learning_rate)
    return (final_lr_ratio or 0.0) if kind == "linear" else 0.0


def warmup_steps_for(warmup_ratio: float, total_steps: int) -> int:
    """ceil(ratio × steps), of the product rounded first: 0.07 × 100 is 7.000000000000001 in floating point, and
    7 warmup steps are meant, not 8."""
    return math.ceil(round(warmup_ratio * total_steps, 9))
