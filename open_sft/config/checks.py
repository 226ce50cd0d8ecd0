"""Up-front checks of a parsed configuration: every problem found, reported together with the flag
named and the fix (config.parse parses, this module judges)."""

from __future__ import annotations

import importlib.util
import math
import os
import typing
from pathlib import Path

import torch
import yaml

from open_sft.config.args import (CheckpointArguments, DataArguments, FinetuneConfig, HubArguments, ModelArguments,
                                  TrainingArguments)
from open_sft.config.companions import companion_problems
from open_sft.config.output_dir import output_dir_problems
from open_sft.config.ranges import numeric_problems
from open_sft.config.training_checks import training_problems
from open_sft.config.deepspeed_request import ENV_CONFIG_FILE, missing_config_hint, uses_deepspeed
from open_sft.distributed.pipeline_plan import pipeline_flag_problems
from open_sft.data.cache import cache_dir_flag, resolve_cache_dir
from open_sft.data.chat.templates import chat_template_problems, template_kwargs_problems
from open_sft.errors import ConfigError
from open_sft.export.hub import repo_id_problem
from open_sft.export.shard_size import shard_size_problem
from open_sft.file_modes import permitted, unreadable, writable_dir_problem
from open_sft.model.source import hub_offline, missing_problem, model_file_problem, tokenizer_problem
from open_sft.monitor.tracking import REPORT_TO_CHOICES, trackers_for, wandb_login_problem
from open_sft.training.checkpoint import continued


def _choices(cls: type) -> dict[str, tuple[str, ...]]:
    """The allowed values of each choice field of `cls`, as its Literal type says (the one place they are written)."""
    hints = typing.get_type_hints(cls)
    return {name: typing.get_args(hint) for name, hint in hints.items() if typing.get_origin(hint) is typing.Literal}


_SECTION_CHOICES = {cls: _choices(cls) for cls in (ModelArguments, DataArguments, TrainingArguments)}
CHOICES = {name: values for choices in _SECTION_CHOICES.values() for name, values in choices.items()}


def _is_local_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or os.path.exists(name)


def validate(config: FinetuneConfig, check_data_files: bool = False) -> None:
    """Collect every problem in the configuration and raise them together; `check_data_files`: with the local
    data files named that do not exist (the data phase would stop at the first, after these were fixed)."""
    problems = _choice_problems(config) + _model_problems(config.model, config.data.cache_dataset_only)
    problems += _data_problems(config.data)
    problems += _missing_data_files(config.data) if check_data_files and not _finished(config) else []
    problems += numeric_problems(config) + companion_problems(config)
    problems += training_problems(config.train, config.data)
    problems += _open_instruct_problems(config)
    problems += _lora_and_model_problems(config)
    problems += _checkpoint_problems(config.checkpoint, config.train.output_dir) + _hub_problems(config.hub)
    problems += _environment_problems(config) + _unreadable_input_problems(config)
    problems += output_dir_problems(config) + _online_problems(config)
    problems += _shard_size_problems(config.checkpoint) + _cache_dir_problems(config.data)
    if problems:
        raise ConfigError(problems)


def _choice_problems(config: FinetuneConfig) -> list[str]:
    problems = []
    for section in (config.model, config.data, config.train):
        for name, allowed in _SECTION_CHOICES[type(section)].items():
            if getattr(section, name) not in allowed:
                problems.append(f"--{name} {getattr(section, name)!r} is not one of {', '.join(allowed)}")
    return problems


def _model_problems(m: ModelArguments, cache_only: bool = False) -> list[str]:
    """`cache_only`: --cache_dataset_only, which reads the tokenizer alone (no config.json, no weights)."""
    problems = []
    if not m.model_name_or_path:
        problems.append("--model_name_or_path is required (a local model directory or a Hub id)")
    for flag in ("model_name_or_path", "tokenizer_name_or_path", "config_name"):
        value = getattr(m, flag)
        problem = value and missing_problem(f"--{flag}", value)
        if problem:
            problems.append(problem)
    if problems or not m.model_name_or_path:
        return problems
    # a directory's config.json and weights; its tokenizer files are judged when the tokenizer loads
    # (open_sft.model.tokenizer)
    model_problem = model_file_problem(m.model_name_or_path, config_given=bool(m.config_name) or cache_only,
                                       weights_needed=not cache_only)
    tokens = m.tokenizer_name_or_path and Path(m.tokenizer_name_or_path).expanduser().is_file() and \
        tokenizer_problem("--tokenizer_name_or_path", m.tokenizer_name_or_path)
    return [problem for problem in (model_problem, tokens) if problem]


def _unreadable_input_problems(config: FinetuneConfig) -> list[str]:
    """Local inputs this user may not read (a container's user and root-only files): named before anything loads."""
    m, d = config.model, config.data
    named = [(flag, getattr(m, flag)) for flag in ("model_name_or_path", "tokenizer_name_or_path", "config_name",
                                                   "add_tokens", "add_special_tokens")]
    named += [("dataset_mixer_list", name) for name in d.dataset_mixer_list[0::2]]
    named += [("eval_dataset_mixer_list", name) for name in d.eval_dataset_mixer_list[0::2]]
    named.append(("chat_template_path", d.chat_template_path))
    problems = []
    for flag, value in named:  # a model's directory: its own files (what from_pretrained reads); data: all
        why = (unreadable(Path(value), recursive="dataset_mixer" in flag) if value and _is_local_path(value)
               else None)
        if why:
            problems.append(f"--{flag} {value}: {why}")
    return problems + _deepspeed_file_problems()


def _deepspeed_file_problems(env: typing.Mapping[str, str] = os.environ) -> list[str]:
    """`accelerate launch --deepspeed_config_file PATH` (or a YAML's deepspeed_config_file) naming no file this user
    can read, said with the flags' problems (the file is read when the launch is planned, after them): open-instruct's
    command lines name its configs/ds_configs/ files, so the one of ours that does the same is named."""
    path = env.get(ENV_CONFIG_FILE) if uses_deepspeed(env) else None
    if not path:
        return []
    if not os.path.isfile(path):
        return [f"--deepspeed_config_file {path}: no such file{missing_config_hint(path)}"]
    why = unreadable(Path(path))
    return [f"--deepspeed_config_file {path}: {why}"] if why else []


def _share_problems(d: DataArguments) -> list[str]:
    """--dataset_mixer_unit share: every amount a share above 0 (an amount that is not a number is named by the
    mixer list's own parse)."""
    if d.dataset_mixer_unit != "share":
        return []
    problems = []
    for name, raw in zip(d.dataset_mixer_list[0::2], d.dataset_mixer_list[1::2]):
        try:
            share = float(raw)
        except ValueError:
            continue
        if not (math.isfinite(share) and share > 0):
            problems.append(f"--dataset_mixer_list: share {raw} for {name} must be a number above 0 under "
                            "--dataset_mixer_unit share (shares are normalised to sum 1, e.g. a.jsonl 0.7 "
                            "b.jsonl 0.3); leave out a source you want none of")
    return problems


def _amount_problems(d: DataArguments) -> list[str]:
    """Each AMOUNT of the mixer lists as the data phase reads it (open_sft.data.sources.amount_problem), said with
    the flags' problems rather than after the model is probed; under --dataset_mixer_unit share the training list's
    values above 0 are judged as shares (_share_problems)."""
    from open_sft.data.sources import amount_problem

    problems = []
    for flag in ("dataset_mixer_list", "eval_dataset_mixer_list"):
        values = getattr(d, flag)
        shares = flag == "dataset_mixer_list" and d.dataset_mixer_unit == "share"
        problems += [problem for name, raw in zip(values[0::2], values[1::2])
                     if (problem := amount_problem(f"--{flag}", name, raw, positive=not shares))]
    return problems


def _finished(config: FinetuneConfig) -> bool:
    """The output directory holds the run, completed: a relaunch reads no data (it says so, or uploads the export)."""
    from open_sft.training.completion import MARKER

    return not config.checkpoint.overwrite_output_dir and (Path(config.train.output_dir or ".") / MARKER).is_file()


def _missing_data_files(d: DataArguments) -> list[str]:
    """Local data files (by their suffix, as open_sft.data.sources reads them) that do not exist."""
    from open_sft.data.sources import missing_file_problem

    return [problem for flag in ("dataset_mixer_list", "eval_dataset_mixer_list") for name in getattr(d, flag)[0::2]
            if (problem := missing_file_problem(f"--{flag}", name))]


def _unpaired_problem(flag: str, values: list[str]) -> str:
    """A mixer list of an odd number of values, naming the first NAME that no AMOUNT follows (reading the list as
    NAME AMOUNT pairs from the start, an AMOUNT being a number) and the fix."""
    index = 0
    while index + 1 < len(values) and _is_number(values[index + 1]):
        index += 2
    name = values[min(index, len(values) - 1)]
    return (f"{flag} takes NAME AMOUNT pairs; got {len(values)} value(s) ({' '.join(values)}): {name} has no AMOUNT "
            f"after it; give one, e.g. {flag} {name} 1.0 for all its rows")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _data_problems(d: DataArguments) -> list[str]:
    problems = []
    if not d.dataset_mixer_list:
        problems.append("--dataset_mixer_list is required, e.g. --dataset_mixer_list data.jsonl 1.0")
    elif len(d.dataset_mixer_list) % 2:
        problems.append(_unpaired_problem("--dataset_mixer_list", d.dataset_mixer_list))
    problems += _share_problems(d) + _amount_problems(d)
    if d.preprocessing_num_workers is not None and d.preprocessing_num_workers < 1:
        problems.append(f"--preprocessing_num_workers {d.preprocessing_num_workers}: give 1 or more processes, "
                        "or leave it unset for one per usable core")
    n_sources = len(d.dataset_mixer_list) // 2
    if len(d.dataset_mixer_list_splits) not in (1, n_sources):
        problems.append(
            f"--dataset_mixer_list_splits has {len(d.dataset_mixer_list_splits)} values; give one for all "
            f"sources or one per source ({n_sources})"
        )
    if d.eval_dataset_mixer_list and len(d.eval_dataset_mixer_list) % 2:
        problems.append(_unpaired_problem("--eval_dataset_mixer_list", d.eval_dataset_mixer_list))
    n_eval = len(d.eval_dataset_mixer_list) // 2
    if d.eval_dataset_mixer_list and len(d.eval_dataset_mixer_list_splits) not in (1, n_eval):
        problems.append(f"--eval_dataset_mixer_list_splits has {len(d.eval_dataset_mixer_list_splits)} values; give "
                        f"one for all evaluation sources or one per source ({n_eval})")
    if d.eval_split_ratio and d.eval_dataset_mixer_list:
        problems.append("give --eval_dataset_mixer_list or --eval_split_ratio, not both")
    if d.cache_dataset_only and d.dataset_skip_cache:  # it tokenized, kept nothing and printed "None"
        problems.append("--cache_dataset_only builds the cache, which --dataset_skip_cache skips: drop one of them")
    problems += template_kwargs_problems(d.chat_template_kwargs)
    per_source = d.dataset_mixer_list_chat_template_kwargs
    if per_source and len(per_source) not in (1, n_sources):
        problems.append(f"--dataset_mixer_list_chat_template_kwargs has {len(per_source)} values; give one for all "
                        f"sources or one per source ({n_sources})")
    for value in per_source:
        problems += [p.replace("--chat_template_kwargs", "--dataset_mixer_list_chat_template_kwargs", 1)
                     for p in template_kwargs_problems(value)]
    return problems


def _environment_problems(config: FinetuneConfig) -> list[str]:
    """What this machine cannot do: found here, with the flags, not when the model loads (what the launch cannot do:
    open_sft.config.launch_check)."""
    m, lora, problems = config.model, config.lora, []
    cuda, flash = torch.cuda.is_available(), _installed("flash_attn")
    given, fix = flash_flag(config)
    if m.attn_implementation == "flash_attention_2" and not (cuda and flash):
        problems.append(f"{given} needs a CUDA GPU and the flash-attn package "
                        f"(CUDA available: {cuda}, flash-attn installed: {flash}); {fix}")
    elif m.attn_implementation == "flash_attention_2" and torch.cuda.get_device_capability() < (8, 0):
        problems.append(f"{given} needs a GPU of compute capability 8.0 or later "
                        "(Ampere: A100, A10, RTX 30xx, and newer); this one is "
                        f"{'.'.join(map(str, torch.cuda.get_device_capability()))} ({torch.cuda.get_device_name()}), "
                        f"which flash-attn 2 refuses; {fix}")
    if m.use_liger_kernel and not cuda:
        problems.append("--use_liger_kernel needs a CUDA GPU (Liger's kernels are written in Triton); this machine "
                        "has no CUDA device. Drop --use_liger_kernel: open_sft's own loss path already avoids full "
                        "logits on CPU")
    elif m.use_liger_kernel and not _installed("liger_kernel"):
        problems.append("--use_liger_kernel needs the liger-kernel package: pip install -e '.[liger]' in the open_sft "
                        "checkout")
    if m.fp8 and not _installed("torchao"):  # the hardware and what --fp8 runs with: open_sft.model.fp8
        problems.append("--fp8 needs torchao>=0.18 (its float8 training): pip install -e '.[fp8]' in the open_sft "
                        "checkout")
    if not m.fp8 and {"fp8_recipe", "fp8_layers"} & config.explicit:
        given = " and ".join(f"--{f}" for f in ("fp8_recipe", "fp8_layers") if f in config.explicit)
        problems.append(f"{given} choose how --fp8 trains, and --fp8 is not given: add --fp8 or drop {given}")
    if lora.use_qlora and not _installed("bitsandbytes"):  # QLoRA under DeepSpeed: open_sft.config.launch_check
        problems.append("--use_qlora needs bitsandbytes>=0.50 (it has a CPU backend): pip install -e '.[qlora]' in the "
                        "open_sft checkout")
    return problems + chat_template_problems(config.data.chat_template_name, config.data.chat_template_path)


def flash_flag(config: FinetuneConfig) -> tuple[str, str]:
    """The flag that asked for flash_attention_2 as the user gave it, and its fix: open-instruct's --use_flash_attn
    (translated onto --attn_implementation, which it contradicts when also given otherwise), ours, or both."""
    if "use_flash_attn" not in config.explicit:
        return "--attn_implementation flash_attention_2", "use --attn_implementation sdpa"
    if "attn_implementation" not in config.explicit:
        return "--use_flash_attn", "drop --use_flash_attn (or give --use_flash_attn false): attention is then sdpa"
    return ("--use_flash_attn (and --attn_implementation flash_attention_2)",
            "drop --use_flash_attn and use --attn_implementation sdpa")


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def _checkpoint_problems(c: CheckpointArguments, output_dir: str) -> list[str]:
    problems = []
    steps = c.checkpointing_steps
    if steps is not None and steps != "epoch" and not (steps.isdigit() and int(steps) > 0):
        problems.append(f"--checkpointing_steps {steps!r} must be a positive number of steps or 'epoch'")
    if c.overwrite_output_dir and c.resume_from_checkpoint not in ("auto", "none"):
        problems.append(f"--overwrite_output_dir starts over from step 0 but --resume_from_checkpoint "
                        f"{c.resume_from_checkpoint} continues that checkpoint; give one of the two")
    elif (c.resume_from_checkpoint not in ("auto", "none") and not Path(c.resume_from_checkpoint).expanduser().is_dir()
          and continued(c.resume_from_checkpoint, Path(output_dir)) is None):  # a requeue goes on where it was
        what = "a file, not a directory" if Path(c.resume_from_checkpoint).expanduser().is_file() else \
            "no such directory"
        problems.append(f"--resume_from_checkpoint {c.resume_from_checkpoint}: {what}; pass a complete "
                        "checkpoint directory (OUTPUT_DIR/checkpoints/step_N), auto (the newest in --output_dir), or "
                        "none (start over)")
    return problems


def _cache_dir_problems(d: DataArguments) -> list[str]:
    """The tokenization cache's directory must be, or be creatable as, a directory this process can write: said
    before the model loads, not as an OSError from the cache. An existing directory it can only read is not refused
    here: it may hold the run's entry, built ahead (open_sft.data.cache reads it, or says it is not there)."""
    if d.dataset_skip_cache:
        return []
    where, path = cache_dir_flag(), resolve_cache_dir(d.dataset_local_cache_dir)
    why = writable_dir_problem(path)
    if why and os.path.isdir(path) and permitted(path, os.R_OK | os.X_OK):  # (isdir: False where it cannot look)
        return []
    return [f"{where}: {why}; give a directory you can write, or --dataset_skip_cache to tokenize without a "
            "cache"] if why else []


def _shard_size_problems(c: CheckpointArguments) -> list[str]:
    """--max_shard_size is read when the model is written, after all the training: judged here instead."""
    why = shard_size_problem(c.max_shard_size)
    return [f"--max_shard_size {why}"] if why else []


def _online_problems(config: FinetuneConfig) -> list[str]:
    """Services the run will need at its end (the Hub) or its start (W&B), checked before any work; --dry_run is
    refused alike (it shows what the run would refuse), --cache_dataset_only starts no tracker."""
    problems, t = [], config.train
    if t.with_tracking and not config.data.cache_dataset_only and t.report_to and \
            set(t.report_to) <= set(REPORT_TO_CHOICES) and "wandb" in trackers_for(t.report_to):
        problem = wandb_login_problem()
        if problem:
            problems.append(problem)
    if config.hub.push_to_hub and hub_offline():
        problems.append("--push_to_hub cannot upload with HF_HUB_OFFLINE set: unset it for this run (a local model "
                        "and local data load offline either way), or drop --push_to_hub and upload the export "
                        "later with python -m open_sft push OUTPUT_DIR --hub_model_id ID, HF_HUB_OFFLINE unset")
    return problems


def _hub_problems(h: HubArguments) -> list[str]:
    problems = []
    if h.push_to_hub and not h.hub_model_id:
        problems.append("--push_to_hub needs --hub_model_id (e.g. my-org/my-model)")
    elif h.push_to_hub and repo_id_problem(h.hub_model_id):
        problems.append(repo_id_problem(h.hub_model_id))
    if h.push_checkpoints and not h.push_to_hub:
        problems.append("--push_checkpoints needs --push_to_hub (and --hub_model_id)")
    return problems


def _open_instruct_problems(config: FinetuneConfig) -> list[str]:
    """The settings open_sft took over from open-instruct."""
    t, problems = config.train, []
    bad = [name for name in t.report_to if name not in REPORT_TO_CHOICES]
    if bad or not t.report_to:
        problems.append(f"--report_to {' '.join(t.report_to)}: give one or more of tensorboard, wandb, or all, none")
    elif len(t.report_to) > 1 and {"all", "none"} & set(t.report_to):
        problems.append(f"--report_to {' '.join(t.report_to)}: 'all' and 'none' stand alone")
    if t.final_lr_ratio is not None and t.lr_scheduler_type != "linear":
        problems.append(f"--final_lr_ratio applies to --lr_scheduler_type linear, not {t.lr_scheduler_type} "
                        "(as in open-instruct)")
    problems += pipeline_flag_problems(t)
    if t.use_8bit_optimizer and importlib.util.find_spec("bitsandbytes") is None:
        problems.append("--use_8bit_optimizer needs bitsandbytes>=0.50 (it runs on CPU too): "
                        "pip install -e '.[qlora]' in the open_sft checkout")
    if config.model.additional_model_arguments:
        try:
            overrides = yaml.safe_load(config.model.additional_model_arguments)
        except yaml.YAMLError:
            overrides = None
        if not isinstance(overrides, dict):
            problems.append(f"--additional_model_arguments {config.model.additional_model_arguments!r}: give a JSON "
                            "object of model config settings, e.g. '{\"max_position_embeddings\": 8192}'")
    return problems


def _lora_and_model_problems(config: FinetuneConfig) -> list[str]:
    m, lora = config.model, config.lora
    problems = []
    for flag in ("add_tokens", "add_special_tokens"):
        value = getattr(m, flag)
        if value and not Path(value).expanduser().is_file():
            problems.append(f"--{flag} {value}: no such file; give a text file with one token per line")
    if not lora.lora_target_modules:
        problems.append("--lora_target_modules needs at least one module name, or all-linear")
    if lora.merge_lora_on_save and not (lora.use_lora or lora.use_qlora):
        problems.append("--merge_lora_on_save needs --use_lora or --use_qlora")
    return problems
