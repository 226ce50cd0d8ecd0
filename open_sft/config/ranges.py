"""The allowed range of every numeric flag, in one table (open_sft.config.checks reports what falls outside).

Each float must be finite as well: a NaN passes every `x <= 0` comparison and an inf none of the upper bounds that
were never written, and either one reaches the optimizer, the schedule or the model (`--learning_rate inf` trained
a model of NaNs and exported it). A flag whose range depends on another flag is checked beside that flag and named
in CHECKED_ELSEWHERE; tests/unit/config/test_numeric_ranges.py holds every numeric field to one of the two.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from open_sft.config.args import FinetuneConfig


@dataclass(frozen=True)
class Range:
    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    """The low end itself is outside (`positive`: above 0)."""
    high_open: bool = False
    also: tuple[float, ...] = ()
    """Values allowed outside the range, said by `also_means` (-1: keep all checkpoints, or no clipping)."""
    also_means: str = ""

    def holds(self, value: float) -> bool:
        if value in self.also:
            return True
        if not math.isfinite(value):
            return False
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def describe(self) -> str:
        if self.low is not None and self.high is not None:
            text = (f"in {'(' if self.low_open else '['}{_number(self.low)}, {_number(self.high)}"
                    f"{')' if self.high_open else ']'}")
        elif self.low == 0:
            text = "positive" if self.low_open else "non-negative"
        elif self.low is not None:
            text = f"above {_number(self.low)}" if self.low_open else f"at least {_number(self.low)}"
        else:
            text = "a number"
        return f"{text}, or {self.also_means}" if self.also_means else text


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


AT_LEAST_1, POSITIVE, NON_NEGATIVE, FRACTION = Range(low=1), Range(low=0, low_open=True), Range(low=0), \
    Range(low=0, high=1, high_open=True)
SEED_MAX = 2**32 - 1  # numpy's (and so transformers' set_seed's) seeds; torch takes 64-bit ones

RANGES: dict[str, Range] = {
    # model
    "neftune_noise_alpha": POSITIVE,
    # LoRA
    "lora_rank": AT_LEAST_1, "lora_alpha": POSITIVE, "lora_dropout": FRACTION,
    # data
    "eval_split_ratio": FRACTION, "max_seq_length": Range(low=2),
    # training
    "per_device_train_batch_size": AT_LEAST_1, "per_device_eval_batch_size": AT_LEAST_1,
    "gradient_accumulation_steps": AT_LEAST_1, "num_train_epochs": AT_LEAST_1, "max_train_steps": AT_LEAST_1,
    "logging_steps": AT_LEAST_1, "eval_steps": AT_LEAST_1, "max_nonfinite_steps": AT_LEAST_1,
    "learning_rate": POSITIVE, "final_lr_ratio": Range(low=0, high=1), "warmup_ratio": FRACTION,
    "warmup_steps": NON_NEGATIVE, "wsd_decay_ratio": Range(low=0, high=1), "weight_decay": NON_NEGATIVE,
    "adam_beta1": FRACTION, "adam_beta2": FRACTION, "adam_epsilon": POSITIVE,
    "clip_grad_norm": Range(low=0, low_open=True, also=(-1,), also_means="-1 to disable clipping"),
    "seed": Range(low=0, high=SEED_MAX), "timeout": AT_LEAST_1, "sequence_parallel_size": AT_LEAST_1,
    "max_memory_per_rank_gib": POSITIVE,
    # checkpoints
    "keep_last_n_checkpoints": Range(low=1, also=(-1,), also_means="-1 to keep all"),
}

CHECKED_ELSEWHERE = {
    "max_tokens_per_batch": "open_sft.config.checks: at least --max_seq_length",
    "pipeline_parallel_size": "open_sft.distributed.pipeline_plan.pipeline_flag_problems",
    "pipeline_virtual_stages": "open_sft.distributed.pipeline_plan.pipeline_flag_problems",
    "preprocessing_num_workers": "open_sft.config.checks: at least 1, or unset for one per usable core",
}


def numeric_problems(config: FinetuneConfig) -> list[str]:
    """Every numeric flag outside its range (unset optional flags are skipped), named with the value given."""
    problems = []
    for section in (config.model, config.lora, config.data, config.train, config.checkpoint):
        for name, allowed in RANGES.items():
            value = getattr(section, name, None)
            if value is None or isinstance(value, bool) or allowed.holds(value):
                continue
            why = " (not a finite number)" if not math.isfinite(value) else ""
            problems.append(f"--{name} must be {allowed.describe()}, got {value}{why}")
    return problems
