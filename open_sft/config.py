"""Typed run configuration: parsed from flags (and an optional YAML file), validated up front.

`python finetune.py [run.yaml] --flag value ...`: the YAML gives defaults, flags override them.
Flag names follow allenai/open-instruct `finetune.py` so existing command lines keep working.
Each field is documented once, in its `help` metadata (shown by `--help`).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml
from transformers import HfArgumentParser

from open_sft.errors import ConfigError, UserError


def _help(text: str, **kwargs: Any) -> Any:
    return field(metadata={"help": text}, **kwargs)


@dataclass
class ModelArguments:
    model_name_or_path: Optional[str] = _help(
        "Local model directory or Hub id of the model to fine-tune.", default=None
    )
    tokenizer_name_or_path: Optional[str] = _help(
        "Tokenizer directory or Hub id; defaults to --model_name_or_path.", default=None
    )
    config_name: Optional[str] = _help(
        "Model config directory or Hub id, if not the same as --model_name_or_path.", default=None
    )
    model_revision: Optional[str] = _help("Hub revision (branch, tag or commit) of the model.", default=None)
    trust_remote_code: bool = _help("Allow custom modelling code from the model repository.", default=False)
    torch_dtype: str = _help(
        "Compute dtype: auto (bf16 where supported), bfloat16 or float32. Parameters and optimizer "
        "states stay in fp32 (bf16 runs use autocast, or DeepSpeed's bf16 mode with fp32 master weights).",
        default="auto",
    )
    attn_implementation: str = _help(
        "Attention kernel: auto (flash_attention_2 on CUDA when installed, else sdpa), sdpa, eager, "
        "flash_attention_2.",
        default="auto",
    )
    gradient_checkpointing: bool = _help("Recompute activations in the backward pass to save memory.", default=False)
    use_liger_kernel: bool = _help("Use Liger kernels (needs CUDA and Triton).", default=False)


@dataclass
class DataArguments:
    dataset_mixer_list: list[str] = _help(
        "Pairs NAME AMOUNT: NAME a local .jsonl/.json/.parquet file or a dataset id; AMOUNT with a '.' "
        "is a fraction of that source (may exceed 1.0 to upsample), without a '.' a row count.",
        default_factory=list,
    )
    dataset_mixer_list_splits: list[str] = _help(
        "Split(s) to read from dataset ids: one for all sources or one per source.",
        default_factory=lambda: ["train"],
    )
    max_seq_length: int = _help("Longest tokenized example, in tokens.", default=2048)
    truncation: str = _help(
        "Examples longer than --max_seq_length: 'truncate' cuts them, 'drop' removes them.", default="truncate"
    )
    train_on: str = _help(
        "Which tokens get a loss: all_assistant (every assistant turn), last_assistant, all.",
        default="all_assistant",
    )
    dataset_local_cache_dir: str = _help(
        "Directory of the tokenization cache (OPEN_SFT_CACHE overrides it).", default="local_dataset_cache"
    )
    dataset_skip_cache: bool = _help("Tokenize without reading or writing the cache.", default=False)
    cache_dataset_only: bool = _help(
        "Build the tokenization cache, print its path on the last line, and exit without training.", default=False
    )


@dataclass
class TrainingArguments:
    output_dir: str = _help("Where the model, metrics.jsonl and run.json are written.", default="output/")
    per_device_train_batch_size: int = _help("Examples per micro-batch on each process.", default=8)
    gradient_accumulation_steps: int = _help("Micro-batches per optimizer step on each process.", default=1)
    learning_rate: float = _help("Peak learning rate.", default=2e-5)
    lr_scheduler_type: str = _help("Learning-rate schedule: linear, cosine, constant, constant_with_warmup.", default="linear")
    warmup_ratio: float = _help("Fraction of the optimizer steps spent warming up linearly.", default=0.03)
    weight_decay: float = _help("AdamW weight decay (not applied to biases and norm weights).", default=0.0)
    num_train_epochs: int = _help("Passes over the training data (ignored when --max_train_steps is set).", default=2)
    max_train_steps: Optional[int] = _help("Total optimizer steps; overrides --num_train_epochs.", default=None)
    clip_grad_norm: float = _help("Clip the global gradient norm to this value; -1 disables.", default=1.0)
    loss_normalization: str = _help(
        "token: sum of token losses over the global batch / its trained tokens (invariant to batch "
        "layout). mean: mean of micro-batch means. sum: sum of token losses.",
        default="token",
    )
    seed: int = _help("Seed for data order, mixing and model-side randomness.", default=42)
    logging_steps: int = _help("Log (metrics.jsonl, stdout, trackers) every this many optimizer steps.", default=10)
    report_to: str = _help("Trackers used with --with_tracking: tensorboard, none.", default="tensorboard")
    with_tracking: bool = _help("Write tracker logs (see --report_to) in addition to metrics.jsonl.", default=False)


DATACLASSES = (ModelArguments, DataArguments, TrainingArguments)

CHOICES = {
    "torch_dtype": ("auto", "bfloat16", "bf16", "float32", "fp32"),
    "attn_implementation": ("auto", "sdpa", "eager", "flash_attention_2"),
    "truncation": ("truncate", "drop"),
    "train_on": ("all_assistant", "last_assistant", "all"),
    "lr_scheduler_type": ("linear", "cosine", "constant", "constant_with_warmup"),
    "loss_normalization": ("token", "mean", "sum"),
    "report_to": ("tensorboard", "none"),
}


@dataclass
class FinetuneConfig:
    """Everything a run needs; built by `parse_config` and never mutated after validation."""

    model: ModelArguments
    data: DataArguments
    train: TrainingArguments

    def to_dict(self) -> dict[str, Any]:
        return {"model": dataclasses.asdict(self.model), "data": dataclasses.asdict(self.data),
                "train": dataclasses.asdict(self.train)}


def _make_parser() -> HfArgumentParser:
    return HfArgumentParser(DATACLASSES)


def _yaml_defaults(path: Path) -> dict[str, Any]:
    try:
        loaded = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise UserError(f"{path}: not valid YAML ({exc}); fix the file or pass the settings as flags") from exc
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise UserError(f"{path}: expected a mapping of flag names to values, got {type(loaded).__name__}")
    known = {f.name for cls in DATACLASSES for f in dataclasses.fields(cls)}
    unknown = sorted(set(loaded) - known)
    if unknown:
        raise UserError(f"{path}: unknown setting(s) {', '.join(unknown)}; see `python finetune.py --help`")
    return loaded


def parse_config(argv: list[str]) -> FinetuneConfig:
    """Parse `[config.yaml] --flag value ...` into a validated FinetuneConfig."""
    parser = _make_parser()
    if argv and argv[0].endswith((".yaml", ".yml")):
        path = Path(argv[0])
        if not path.is_file():
            raise UserError(f"config file {path} does not exist; pass an existing YAML file or only flags")
        parser.set_defaults(**_yaml_defaults(path))
        argv = argv[1:]
    model, data, train = parser.parse_args_into_dataclasses(args=argv, look_for_args_file=False)
    config = FinetuneConfig(model=model, data=data, train=train)
    validate(config)
    return config


def _is_local_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or os.path.exists(name)


def validate(config: FinetuneConfig) -> None:
    """Collect every problem in the configuration and raise them together."""
    problems: list[str] = []
    m, d, t = config.model, config.data, config.train
    for section in (m, d, t):
        for name, allowed in CHOICES.items():
            value = getattr(section, name, None)
            if value is not None and hasattr(section, name) and value not in allowed:
                problems.append(f"--{name} {value!r} is not one of {', '.join(allowed)}")

    if not m.model_name_or_path:
        problems.append("--model_name_or_path is required (a local model directory or a Hub id)")
    for flag in ("model_name_or_path", "tokenizer_name_or_path", "config_name"):
        value = getattr(m, flag)
        if value and _is_local_path(value) and not Path(value).expanduser().exists():
            problems.append(f"--{flag} {value}: no such file or directory; check the path")

    if not d.dataset_mixer_list:
        problems.append("--dataset_mixer_list is required, e.g. --dataset_mixer_list data.jsonl 1.0")
    elif len(d.dataset_mixer_list) % 2:
        problems.append(
            f"--dataset_mixer_list takes NAME AMOUNT pairs; got {len(d.dataset_mixer_list)} values "
            f"({' '.join(d.dataset_mixer_list)})"
        )
    n_sources = len(d.dataset_mixer_list) // 2
    if len(d.dataset_mixer_list_splits) not in (1, n_sources):
        problems.append(
            f"--dataset_mixer_list_splits has {len(d.dataset_mixer_list_splits)} values; give one for all "
            f"sources or one per source ({n_sources})"
        )
    if d.max_seq_length < 2:
        problems.append(f"--max_seq_length must be at least 2, got {d.max_seq_length}")

    for flag in ("per_device_train_batch_size", "gradient_accumulation_steps", "num_train_epochs", "logging_steps"):
        if getattr(t, flag) < 1:
            problems.append(f"--{flag} must be at least 1, got {getattr(t, flag)}")
    if t.max_train_steps is not None and t.max_train_steps < 1:
        problems.append(f"--max_train_steps must be at least 1, got {t.max_train_steps}")
    if t.learning_rate <= 0:
        problems.append(f"--learning_rate must be positive, got {t.learning_rate}")
    if not 0.0 <= t.warmup_ratio < 1.0:
        problems.append(f"--warmup_ratio must be in [0, 1), got {t.warmup_ratio}")
    if t.weight_decay < 0:
        problems.append(f"--weight_decay must be non-negative, got {t.weight_decay}")
    if problems:
        raise ConfigError(problems)
