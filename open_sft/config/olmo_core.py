"""Flags of open-instruct's OLMo-core SFT entrypoint (open_instruct/olmo_core_finetune.py, where its deprecated
finetune.py now sends users; its OLMo 3 scripts use it): renames of ours, translated, and the rest accepted and
ignored or refused, each with the reason.

Its flags that share a name with finetune.py's (model_name_or_path, max_seq_length, learning_rate,
checkpointing_steps, ...) mean the same there and are ours already; --attn_implementation takes OLMo-core's names
too (flash_2, torch). The fields here default to None: a flag is translated only when given.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from open_sft.config.open_instruct import Translation
from open_sft.errors import UserError


def _help(text: str) -> Any:
    return field(default=None, metadata={"help": text})


@dataclass
class OlmoCoreArguments:
    """open-instruct's olmo_core_finetune.py flags (ExperimentConfig, ModelConfig, TrainingConfig, DatasetConfig,
    LoggingConfig, CheckpointConfig, SFTConfig) that finetune.py's FlatArguments does not have."""

    num_epochs: Optional[int] = _help("OLMo-core SFT: = --num_train_epochs.")
    mixer_list: Optional[list[str]] = _help("OLMo-core SFT: = --dataset_mixer_list.")
    mixer_list_splits: Optional[list[str]] = _help("OLMo-core SFT: = --dataset_mixer_list_splits.")
    transform_fn: Optional[list[str]] = _help("OLMo-core SFT: = --dataset_transform_fn.")
    target_columns: Optional[list[str]] = _help("OLMo-core SFT: = --dataset_target_columns.")
    local_cache_dir: Optional[str] = _help("OLMo-core SFT: = --dataset_local_cache_dir.")
    skip_cache: Optional[bool] = _help("OLMo-core SFT: = --dataset_skip_cache.")
    max_grad_norm: Optional[float] = _help("OLMo-core SFT: = --clip_grad_norm (it clips nothing unless given).")
    compile_model: Optional[bool] = _help("OLMo-core SFT: = --torch_compile (on there unless false).")
    wandb_project: Optional[str] = _help("OLMo-core SFT: = --wandb_project_name.")
    dist_timeout_hours: Optional[float] = _help("OLMo-core SFT: = --timeout, in hours.")
    cp_degree: Optional[int] = _help(
        "OLMo-core SFT's context parallelism = --sequence_parallel_size (Ulysses; every --cp_strategy computes the "
        "same attention).")
    activation_checkpointing_mode: Optional[str] = _help(
        "OLMo-core SFT: selected_modules (or budget with --activation_memory_budget below 1) = "
        "--gradient_checkpointing (whole decoder layers; the same gradients).")
    activation_memory_budget: Optional[float] = _help("OLMo-core SFT: below 1 = --gradient_checkpointing.")
    rope_scaling_factor: Optional[float] = _help(
        "OLMo-core SFT's YaRN RoPE scaling: refused (set the model config's rope_scaling with "
        "--additional_model_arguments).")
    rope_scaling_beta_fast: Optional[float] = _help("Refused, as --rope_scaling_factor.")
    rope_scaling_beta_slow: Optional[float] = _help("Refused, as --rope_scaling_factor.")
    rope_scaling_old_context_len: Optional[int] = _help("Refused, as --rope_scaling_factor.")
    # Accepted and ignored
    cp_strategy: Optional[str] = _help("Ignored (open_sft's sequence parallelism is Ulysses).")
    activation_checkpointing_modules: Optional[list[str]] = _help(
        "Ignored (--gradient_checkpointing recomputes whole decoder layers).")
    data_loader_seed: Optional[int] = _help("Ignored (the data order follows --seed).")
    ephemeral_save_interval: Optional[int] = _help(
        "OLMo-core SFT's checkpoint every N steps (there 250 unless given, 0 or less none, besides a kept one every "
        "500): --checkpointing_steps N (else 500) where that is not given (a run resumes from the newest; the newest "
        "--keep_last_n_checkpoints are kept).")
    save_async: Optional[bool] = _help("Ignored (checkpoints are written before training goes on).")
    cache_mode: Optional[str] = _help("Ignored (open_sft's cache is local: --dataset_local_cache_dir).")
    config_hash: Optional[str] = _help("Ignored (open_sft computes its cache key).")
    loss_implementation: Optional[str] = _help(
        "Ignored (the same cross-entropy; fused_linear is Liger's kernel: --use_liger_kernel).")
    wandb_group_name: Optional[str] = _help("Ignored (W&B runs are named by --exp_name).")


RENAMES = {  # OLMo-core flag → (config section, our flag)
    "num_epochs": ("train", "num_train_epochs"), "mixer_list": ("data", "dataset_mixer_list"),
    "mixer_list_splits": ("data", "dataset_mixer_list_splits"),
    "local_cache_dir": ("data", "dataset_local_cache_dir"), "skip_cache": ("data", "dataset_skip_cache"),
    "max_grad_norm": ("train", "clip_grad_norm"), "compile_model": ("model", "torch_compile"),
    "wandb_project": ("train", "wandb_project_name"), "cp_degree": ("train", "sequence_parallel_size"),
}
IGNORED = ("cp_strategy", "activation_checkpointing_modules", "data_loader_seed", "save_async", "cache_mode",
           "config_hash", "loss_implementation", "wandb_group_name")
ROPE = ("rope_scaling_factor", "rope_scaling_beta_fast", "rope_scaling_beta_slow", "rope_scaling_old_context_len")
ATTENTION = {"flash_2": "flash_attention_2", "flash": "flash_attention_2", "torch": "sdpa", "te": "sdpa",  # OLMo-core's
             "flash_3": "auto", "flash_4": "auto"}  # (the same attention; auto: FlashAttention 2 where installed)
# open-instruct's docs/algorithms/finetune.md gives them as flash-2, flash-3 (its parser takes OLMo-core's flash_2)
ATTENTION.update({name.replace("_", "-"): ours for name, ours in ATTENTION.items() if "_" in name})
OLMO_CORE_BETA2 = 0.95  # olmo_core_finetune.py's SkipStepAdamWConfig betas=(0.9, 0.95), hard-coded
OLMO_CORE_EPHEMERAL = 250  # olmo_core_finetune.py's default --ephemeral_save_interval
OLMO_CORE_SAVE_INTERVAL = 500  # its CheckpointConfig.checkpointing_steps default (the checkpoints it keeps)
# what sets the flags an OLMo-core command line implies (FinetuneConfig.implied)
IMPLIED = {"packing": "the OLMo-core command line sets (it packs examples into --max_seq_length sequences)",
           "adam_beta2": f"the OLMo-core command line sets (olmo_core_finetune.py's AdamW has betas "
                         f"(0.9, {OLMO_CORE_BETA2}))",
           "checkpointing_steps": "the OLMo-core command line sets (olmo_core_finetune.py checkpoints every "
                                  "--ephemeral_save_interval steps, 250 unless given)"}
# olmo_core_finetune.py's defaults that change what is trained and differ from ours: (its flag, ours, its value)
DEFAULTS = (("num_epochs", "num_train_epochs", "3"), ("learning_rate", "learning_rate", "8e-05"),
            ("max_seq_length", "max_seq_length", "4096"), ("max_grad_norm", "clip_grad_norm", "none (no clipping)"))


def fold(config: Any, oc: OlmoCoreArguments, oi: Any) -> tuple[Any, Any, list[str]]:
    """The config with the OLMo-core flags given put onto ours (`explicit` grows by the flags they set), and
    open-instruct's arguments `oi` with --transform_fn/--target_columns as its --dataset_transform_fn/
    --dataset_target_columns; translated on by open_instruct.translate."""
    given = [f.name for f in dataclasses.fields(OlmoCoreArguments) if f.name in config.explicit]
    attention = ATTENTION.get(config.model.attn_implementation)
    if not given and attention is None:
        return config, oi, []
    t = Translation(config)
    for name in given:
        if name in RENAMES:
            section, ours = RENAMES[name]
            t.set(section, ours, _renamed_value(name, getattr(oc, name)), f"--{name} {getattr(oc, name)}")
    if oc.dist_timeout_hours is not None:
        t.set("train", "timeout", round(oc.dist_timeout_hours * 3600), f"--dist_timeout_hours {oc.dist_timeout_hours}")
    if _checkpoints_activations(oc):
        t.set("model", "gradient_checkpointing", True, "--activation_checkpointing_mode/--activation_memory_budget")
    packs = bool(given) and "packing" not in config.explicit
    if packs:  # its per_device_train_batch_size counts max_seq_length sequences that examples are packed into
        t.changes.setdefault("train", {})["packing"] = True
        t.notes.append("OLMo-core SFT packs examples into --max_seq_length sequences, --per_device_train_batch_size "
                       "of them a micro-batch: --packing (a micro-batch of at most --max_tokens_per_batch, default "
                       "per_device_train_batch_size × max_seq_length, tokens)")
    if given and "adam_beta2" not in config.explicit:  # its SkipStepAdamWConfig(betas=(0.9, 0.95)), no flag there
        t.changes.setdefault("train", {})["adam_beta2"] = OLMO_CORE_BETA2
        t.notes.append(f"OLMo-core SFT's AdamW has betas (0.9, {OLMO_CORE_BETA2}): --adam_beta2 {OLMO_CORE_BETA2}")
    if given:
        _checkpoint_as_olmo_core(t, oc)
    if attention is not None:
        t.changes.setdefault("model", {})["attn_implementation"] = attention
        t.notes.append(f"--attn_implementation {config.model.attn_implementation} (OLMo-core's name) = {attention}")
    oi = _fold_transforms(config, oc, oi)
    _explain(t, given)
    result = t.result()
    added = {name for changes in t.changes.values() for name in changes}  # the flags the OLMo-core ones set
    implied = {**result.implied, **{name: IMPLIED[name] for name in added if name in IMPLIED and given}}
    return (dataclasses.replace(result, explicit=result.explicit | added, implied=implied), oi,
            refusals(config, given))


def _checkpoint_as_olmo_core(t: Translation, oc: OlmoCoreArguments) -> None:
    """OLMo-core SFT keeps a checkpoint every --checkpointing_steps steps (500 by default) and writes one every
    --ephemeral_save_interval steps between (250 unless given; 0 or less: none), each deleted when the next is written:
    a run of its command line killed after step 250 resumes there. The same command line here checkpoints at the
    shorter of the two (the newest --keep_last_n_checkpoints kept) rather than only when preempted (our default), so a
    kill -9 loses what it lost there. `--checkpointing_steps epoch` (ours; OLMo-core counts steps) is kept."""
    given = t.config.checkpoint.checkpointing_steps if t.given("checkpointing_steps") else None
    if given is not None and not str(given).isdigit():
        if oc.ephemeral_save_interval is not None:
            t.notes.append(f"--ephemeral_save_interval {oc.ephemeral_save_interval} ignored: --checkpointing_steps "
                           f"{given} chooses")
        return
    kept = OLMO_CORE_SAVE_INTERVAL if given is None else int(given)
    ephemeral = oc.ephemeral_save_interval if oc.ephemeral_save_interval is not None else OLMO_CORE_EPHEMERAL
    every = ephemeral if 0 < ephemeral < kept else kept
    if every == kept and given is not None:
        return  # the one given is the shorter
    t.changes.setdefault("checkpoint", {})["checkpointing_steps"] = str(every)
    because = ("its --ephemeral_save_interval" + ("" if oc.ephemeral_save_interval is not None else " default")
               if every == ephemeral else "its --checkpointing_steps default")
    t.notes.append(f"OLMo-core SFT checkpoints every {every} steps ({because}"
                   f"{f', between those of --checkpointing_steps {given}' if given is not None else ''}): "
                   f"--checkpointing_steps {every}, the newest --keep_last_n_checkpoints kept"
                   f"{' (give --checkpointing_steps to choose)' if given is None else ''}")


def refusals(config: Any, given: list[str]) -> list[str]:
    """The OLMo-core flags given that open_sft cannot honour, each with what to do (reported with the other
    problems of the configuration). In an OLMo-core command line --config_name names OLMo-core's architecture
    (olmo3_7B), which the model's own config.json describes here; ours takes a config directory or Hub id."""
    problems = []
    name = config.model.config_name
    if given and name and "/" not in name and not os.path.exists(name):
        problems.append(f"--config_name {name}: in olmo_core_finetune.py's command line this is OLMo-core's name "
                        "for the architecture; open_sft reads it from the model's config.json (a transformers "
                        "checkpoint in --model_name_or_path), so leave --config_name out (here it takes a config "
                        "directory or Hub id)")
    rope = [flag for flag in ROPE if flag in given]
    if rope:
        problems.append(f"--{rope[0]}: open_sft does not apply OLMo-core's YaRN RoPE scaling; a transformers model "
                        "takes it from its config, e.g. --additional_model_arguments '{\"rope_scaling\": "
                        "{\"rope_type\": \"yarn\", \"factor\": 8.0, \"original_max_position_embeddings\": 8192}}' "
                        "(check that the model supports it), or leave the flag out")
    return problems


def _renamed_value(name: str, value: Any) -> Any:
    if name == "cp_degree" and value < 1:
        raise UserError(f"--cp_degree {value}: give the number of ranks that share a sequence (1 or more)")
    return list(value) if isinstance(value, list) else value


def _checkpoints_activations(oc: OlmoCoreArguments) -> bool:
    mode = oc.activation_checkpointing_mode
    if mode not in (None, "budget", "selected_modules"):
        raise UserError(f"--activation_checkpointing_mode {mode!r}: expected budget or selected_modules")
    budget = oc.activation_memory_budget
    return mode == "selected_modules" or (budget is not None and budget < 1.0)


def _fold_transforms(config: Any, oc: OlmoCoreArguments, oi: Any) -> Any:
    pairs = (("transform_fn", "dataset_transform_fn"), ("target_columns", "dataset_target_columns"))
    for theirs, ours in pairs:
        value = getattr(oc, theirs)
        if value is None:
            continue
        if ours in config.explicit and getattr(oi, ours) != value:
            raise UserError(f"--{theirs} {' '.join(value)} contradicts --{ours} {' '.join(getattr(oi, ours))}; "
                            "give one of the two")
        oi = dataclasses.replace(oi, **{ours: list(value)})
    return oi


def _explain(t: Translation, given: list[str]) -> None:
    """One note naming the ignored flags with their reasons, and one warning naming the OLMo-core defaults that
    change training, differ from ours and were left to the default."""
    reasons = {f.name: f.metadata["help"] for f in dataclasses.fields(OlmoCoreArguments)}
    ignored = [name for name in IGNORED if name in given]
    if ignored:
        t.notes.append("OLMo-core SFT flags accepted and ignored: " +
                       "; ".join(f"--{name} ({reasons[name].removeprefix('Ignored (').removesuffix(').')})"
                                 for name in ignored))
    if not given:
        return
    t.warnings.append("OLMo-core SFT's AdamW skips a step whose loss or gradient norm spikes (SkipStepAdamW); "
                      "open_sft's takes every step (--clip_grad_norm bounds a spike)")
    left = [(theirs, ours, value) for theirs, ours, value in DEFAULTS
            if theirs not in t.config.explicit and ours not in t.config.explicit]
    if left:
        t.warnings.append(
            "OLMo-core SFT flags (--" + ", --".join(given) + ") given, but not " +
            ", ".join(f"--{theirs}" for theirs, _, _ in left) + ": olmo_core_finetune.py's defaults for those are " +
            ", ".join(f"{value}" for _, _, value in left) + "; open_sft's are " +
            ", ".join(f"--{ours} {_ours_default(t.config, ours)}" for _, ours, _ in left) +
            ". Give them to train as that command line did there")


def _ours_default(config: Any, name: str) -> Any:
    for section in ("model", "data", "train"):
        part = getattr(config, section)
        if hasattr(part, name):
            return getattr(part, name)
    raise KeyError(name)
