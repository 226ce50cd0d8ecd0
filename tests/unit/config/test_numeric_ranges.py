"""Every numeric flag is checked up front, floats finite: a NaN passed `x <= 0` and an inf was never looked at
(`--learning_rate inf` exported a model of NaNs, exit 0; `--wsd_decay_ratio nan`, `--max_memory_per_rank_gib nan`,
`--neftune_noise_alpha inf` and a 20-digit --seed were tracebacks mid-run)."""

from __future__ import annotations

import re
import typing

import pytest

from open_sft.config.args import DATACLASSES
from open_sft.config.parse import parse_config
from open_sft.config.ranges import CHECKED_ELSEWHERE, RANGES
from open_sft.errors import ConfigError

BASE = ["--model_name_or_path", "org/model", "--dataset_mixer_list", "a.jsonl", "1.0"]


def _numeric_fields() -> set[str]:
    fields = set()
    for cls in DATACLASSES:
        for name, hint in typing.get_type_hints(cls).items():
            if hint in (int, float) or {int, float} & set(typing.get_args(hint)):
                fields.add(name)
    return fields


def test_every_numeric_flag_has_a_range() -> None:
    assert _numeric_fields() == set(RANGES) | set(CHECKED_ELSEWHERE)
    assert not set(RANGES) & set(CHECKED_ELSEWHERE)


@pytest.mark.parametrize("flag, value, message", [
    ("--learning_rate", "inf", "--learning_rate must be positive, got inf (not a finite number)"),
    ("--learning_rate", "nan", "--learning_rate must be positive, got nan (not a finite number)"),
    ("--weight_decay", "nan", "--weight_decay must be non-negative, got nan"),
    ("--weight_decay", "inf", "--weight_decay must be non-negative, got inf"),
    ("--lora_alpha", "nan", "--lora_alpha must be positive, got nan"),
    ("--neftune_noise_alpha", "inf", "--neftune_noise_alpha must be positive, got inf"),
    ("--neftune_noise_alpha", "nan", "--neftune_noise_alpha must be positive, got nan"),
    ("--max_memory_per_rank_gib", "nan", "--max_memory_per_rank_gib must be positive, got nan"),
    ("--max_memory_per_rank_gib", "inf", "--max_memory_per_rank_gib must be positive, got inf"),
    ("--wsd_decay_ratio", "1.5", "--wsd_decay_ratio must be in [0, 1], got 1.5"),
    ("--wsd_decay_ratio", "nan", "--wsd_decay_ratio must be in [0, 1], got nan"),
    ("--final_lr_ratio", "nan", "--final_lr_ratio must be in [0, 1], got nan"),
    ("--warmup_ratio", "nan", "--warmup_ratio must be in [0, 1), got nan"),
    ("--warmup_steps", "-3", "--warmup_steps must be non-negative, got -3"),
    ("--clip_grad_norm", "nan", "--clip_grad_norm must be positive, or -1 to disable clipping, got nan"),
    ("--clip_grad_norm", "inf", "--clip_grad_norm must be positive, or -1 to disable clipping, got inf"),
    ("--clip_grad_norm", "0", "--clip_grad_norm must be positive, or -1 to disable clipping, got 0.0"),
    ("--clip_grad_norm", "-5", "--clip_grad_norm must be positive, or -1 to disable clipping, got -5.0"),
    ("--max_nonfinite_steps", "0", "--max_nonfinite_steps must be at least 1, got 0"),
    ("--logging_steps", "0", "--logging_steps must be at least 1, got 0"),
    ("--seed", "99999999999999999999", "--seed must be in [0, 4294967295], got 99999999999999999999"),
    ("--seed", "-1", "--seed must be in [0, 4294967295], got -1"),
    ("--lora_dropout", "nan", "--lora_dropout must be in [0, 1), got nan"),
    ("--eval_split_ratio", "inf", "--eval_split_ratio must be in [0, 1), got inf"),
    ("--timeout", "0", "--timeout must be at least 1, got 0"),
    ("--adam_beta1", "1", "--adam_beta1 must be in [0, 1), got 1.0"),
    ("--adam_beta2", "-0.5", "--adam_beta2 must be in [0, 1), got -0.5"),
    ("--adam_beta2", "nan", "--adam_beta2 must be in [0, 1), got nan"),
    ("--adam_epsilon", "0", "--adam_epsilon must be positive, got 0.0"),
    ("--adam_epsilon", "-0.001", "--adam_epsilon must be positive, got -0.001"),
])
def test_a_value_out_of_range_is_named_with_the_flag(flag, value, message) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(BASE + [flag, value])
    assert len(info.value.problems) == 1 and info.value.problems[0].startswith(message)


def test_every_out_of_range_value_is_said_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(BASE + ["--learning_rate", "inf", "--weight_decay", "nan", "--seed", "-2", "--warmup_steps", "-1"])
    assert [re.match(r"--(\w+)", p).group(1) for p in info.value.problems] == [
        "learning_rate", "warmup_steps", "weight_decay", "seed"]


@pytest.mark.parametrize("args", [
    ["--clip_grad_norm", "-1"], ["--clip_grad_norm", "0.5"], ["--keep_last_n_checkpoints", "-1"],
    ["--seed", "0"], ["--seed", "4294967295"], ["--warmup_steps", "0"], ["--wsd_decay_ratio", "1"],
    ["--wsd_decay_ratio", "0"], ["--weight_decay", "0"], ["--lora_dropout", "0"], ["--final_lr_ratio", "1"],
    ["--max_nonfinite_steps", "1"], ["--neftune_noise_alpha", "5"], ["--max_memory_per_rank_gib", "0.5"],
    ["--adam_beta1", "0"], ["--adam_beta2", "0.95"], ["--adam_epsilon", "1e-30"],
])
def test_the_ends_of_each_range_are_accepted(args) -> None:
    assert parse_config(BASE + args)
