"""The settings a run trains with, and the steps each set of them trained.

The settings are every flag (as parsed, before the launch plan fills in what it decides) but those that change
neither the weights a run trains nor its export (NOT_SETTINGS: logging, trackers, checkpoint cadence, caches, the
Hub, how to resume).

One rule for a resume: a resume whose settings differ from the checkpoint's is refused, naming each difference
and the ways on, unless `--allow_changed_settings` is given. With it the change is recorded: the history of the
run's settings, a list of {"from_step": first step, "settings": {...}}, travels in every checkpoint (under
SETTINGS_KEY of the config it saves) and is written to run.json, RUN_COMPLETE and the model card as
`settings_by_steps`: [{"steps": [first, last], "changed": {flag: value}}, ...], where `changed` holds, for
each range, its values of the flags that differ between ranges. A relaunch of a completed run is answered
"already complete" when its settings match those of any recorded range (the command that trained steps 1-29 is
as much the run's command as the one that finished it), and refused otherwise, naming the differences from the
last range's (open_sft.training.completion).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any, Collection, Optional

from open_sft.errors import UserError
from open_sft.model.precision import COMPUTE_DTYPE_KEY, FLAG_DTYPES

logger = logging.getLogger(__name__)

# Flags that change neither the weights a run trains nor its export: a relaunch may differ in these.
# --max_memory_per_rank_gib: the memory of the rank a requeue lands on; --auto_micro_batch_size's split of it is
# checked by the identity (the same global batch: training.elastic). --gradient_checkpointing: the recomputed forward
# is the same computation (non-reentrant, RNG state restored: LoRA dropout's masks too; a run with and without it
# logs identical losses and grad norms), and a requeue after an out-of-memory crash is where it gets added.
NOT_SETTINGS = frozenset({
    "output_dir", "exp_name", "logging_steps", "report_to", "with_tracking", "wandb_project_name", "wandb_entity",
    "timeout", "preprocessing_num_workers", "dataset_local_cache_dir", "dataset_skip_cache", "cache_dataset_only",
    "dry_run", "eval_steps", "per_device_eval_batch_size", "checkpointing_steps", "keep_last_n_checkpoints",
    "clean_checkpoints_at_end", "resume_from_checkpoint", "overwrite_output_dir", "max_shard_size",
    "allow_changed_settings", "max_memory_per_rank_gib", "gradient_checkpointing"})
SECTIONS = ("model", "data", "train", "lora", "checkpoint")
# What a resume's identity check decides (open_sft.training.resume.check_compatible): another accumulation is
# accepted there where it keeps the global batch (a checkpoint resumed on another number of ranks), so it is no
# changed setting of a resume; a completed run's relaunch compares it by the global batch it trains (completion).
CHECKED_BY_IDENTITY = frozenset({"gradient_accumulation_steps"})
# Settings that became flags later, with the value every run trained with before: a record without them (a
# checkpoint's history, a completion record) is read with them (complete), so that every reader compares and
# records what such a run trained with (an OLMo-core command line now means --adam_beta2 0.95).
BEFORE_THE_FLAG = {"adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8}
SETTINGS_KEY = "settings_by_steps"  # in the config a checkpoint saves: the history (see above)
# Flags that name local files or directories (or Hub ids): an existing path is recorded and compared in its
# resolved form, so that the same file spelled otherwise (a trailing slash, relative from another working directory,
# through a symlink) is the same setting; anything else (a Hub id, an amount) as written.
PATH_FLAGS = frozenset({"model_name_or_path", "tokenizer_name_or_path", "config_name", "chat_template_path",
                        "dataset_mixer_list", "eval_dataset_mixer_list"})
# The paths whose files the tokenized data's cache key holds by content (the sources, the tokenizer's files, the
# template): where a resume's data have the checkpoint's key, these name the same inputs at another place (another
# node's mount), no changed setting.
DATA_PATH_FLAGS = frozenset({"dataset_mixer_list", "tokenizer_name_or_path", "chat_template_path"})


def settings(config: Any) -> dict[str, Any]:
    """The flags that define what a run trains and exports, as JSON values."""
    return _flat({name: dataclasses.asdict(getattr(config, name)) for name in SECTIONS})


def given_settings(config: Any) -> dict[str, Any]:
    """The settings the user's command line gave (flags and run-YAML keys), not those it left to their default
    or that a command line implies (FinetuneConfig.implied)."""
    return {k: v for k, v in settings(config).items() if k in config.explicit and k not in config.implied}


def _flat(sections: dict[str, Any]) -> dict[str, Any]:
    flat = {}
    for name in SECTIONS:
        flat.update({k: _resolved(k, v) for k, v in (sections.get(name) or {}).items() if k not in NOT_SETTINGS})
    return json.loads(json.dumps(flat, default=str))


def _resolved(name: str, value: Any) -> Any:
    """A PATH_FLAGS value with each existing local path in its resolved form; others as they are."""
    if name not in PATH_FLAGS:
        return value
    if isinstance(value, list):
        return [_resolved(name, item) for item in value]
    if isinstance(value, str) and value and os.path.exists(os.path.expanduser(value)):
        return os.path.realpath(os.path.expanduser(value))
    return value


def _dtype_as_computed(value: Any, computed: Optional[str]) -> Any:
    """--torch_dtype as the dtype it trains in: an alias by its dtype's name (bf16 is bfloat16), and auto by the
    dtype the recorded run resolved it to, where known (a resume's auto keeps that dtype: model.precision)."""
    if value == "auto" and computed in FLAG_DTYPES:
        value = computed
    return str(FLAG_DTYPES[value]).removeprefix("torch.") if value in FLAG_DTYPES else value


def _same(name: str, then: Any, now: Any, computed: Optional[str]) -> bool:
    if name == "torch_dtype":
        return _dtype_as_computed(then, computed) == _dtype_as_computed(now, computed)
    return _resolved(name, then) == _resolved(name, now)


def complete(recorded: dict[str, Any]) -> dict[str, Any]:
    """Recorded settings as read: with the value it trained with for each BEFORE_THE_FLAG flag the record predates
    (an older record has no key for it; one whose history a later launch extended holds null there)."""
    return {**recorded, **{name: value for name, value in BEFORE_THE_FLAG.items() if recorded.get(name) is None}}


def differing(then: dict[str, Any], now: dict[str, Any], before: str = "then",
              computed: Optional[str] = None) -> dict[str, str]:
    """Each flag both hold with another value, by name, with its line `--flag: old {before}, new now` (paths
    compared resolved: a record written before they were recorded so; --torch_dtype by the dtype it trains in,
    `computed` being the dtype the recorded run computed in, so that an explicit dtype equal to what its auto
    resolved is the same). Records are read complete (`complete`)."""
    return {name: f"--{name}: {then[name]!r} {before}, {now[name]!r} now"
            for name in sorted(then.keys() & now.keys()) if not _same(name, then[name], now[name], computed)}


def differences(then: dict[str, Any], now: dict[str, Any], before: str = "then",
                computed: Optional[str] = None) -> list[str]:
    """The lines of `differing`, in the flags' order."""
    return list(differing(then, now, before, computed).values())


def compared(settings: dict[str, Any]) -> dict[str, Any]:
    """`settings` without those a resume's identity check decides (CHECKED_BY_IDENTITY)."""
    return {k: v for k, v in settings.items() if k not in CHECKED_BY_IDENTITY}


def _history_to(saved: dict[str, Any], step: int) -> list[dict[str, Any]]:
    """The step ranges of a checkpoint's saved config (its settings history) that began by `step`, each range's
    settings complete; [] for a checkpoint written before histories were kept."""
    return [{**segment, "settings": complete(segment["settings"])} for segment in saved.get(SETTINGS_KEY) or []
            if segment["from_step"] <= step]


def checkpoint_settings(state: dict[str, Any]) -> dict[str, Any]:
    """The settings the checkpoint whose trainer state is `state` trained its last step with: its history's last
    range up to its step, else (written before histories were kept) its resolved config's."""
    saved = state.get("config") or {}
    history = _history_to(saved, state.get("step", 0))
    return history[-1]["settings"] if history else complete(_flat(saved))


def history_on_resume(resume: Any, now: dict[str, Any], resolved: dict[str, Any], allow: bool,
                      is_main: bool, moved: Collection[str] = ()) -> list[dict[str, Any]]:
    """The settings history of this launch: the checkpoint's, up to its step, and this launch's settings `now`
    from the step after it when they differ (refused without `allow`). `resolved`: this launch's resolved config,
    compared with the resolved config a checkpoint written before histories were kept saved instead. `moved`: the
    path flags whose inputs are the checkpoint's by content (another place only: not compared)."""
    if resume is None:
        return [{"from_step": 1, "settings": now}]
    saved = resume.state.get("config") or {}
    computed = saved.get(COMPUTE_DTYPE_KEY)
    history = _history_to(saved, resume.step)
    if history:
        changed = differences(_without(history[-1]["settings"], moved), _without(compared(now), moved),
                              "in the checkpoint", computed)
    else:  # an older checkpoint: its resolved config against this launch's
        then, current = complete(_flat(saved)), _flat(resolved)
        changed = differences(_without(then, moved), _without(compared(current), moved), "in the checkpoint",
                              computed)
        history = [{"from_step": 1, "settings": {**now, **{k: then[k] for k in then.keys() & current.keys()
                                                            if then[k] != current[k]}}}]
    if not changed:
        return history
    lines = "\n".join(f"  - {line}" for line in changed)
    if not allow:
        raise UserError(
            f"cannot resume from {resume.path} (step {resume.step}) with settings other than it was trained with:\n"
            f"{lines}\nRelaunch with the checkpoint's settings; or pass --allow_changed_settings to train the steps "
            f"after {resume.step} with these (each step range and its settings are recorded in run.json, "
            "RUN_COMPLETE and the model card); or start over with --resume_from_checkpoint none (or another "
            "--output_dir)")
    if is_main:
        logger.warning("resuming at step %d with changed settings (--allow_changed_settings); steps 1-%d were "
                       "trained with the checkpoint's, the steps from here use these (recorded as settings_by_steps "
                       "in run.json, RUN_COMPLETE and the model card):\n%s", resume.step, resume.step, lines)
    return history + [{"from_step": resume.step + 1, "settings": now}]


def _without(settings: dict[str, Any], names: Collection[str]) -> dict[str, Any]:
    return {k: v for k, v in settings.items() if k not in names}


def by_steps(history: list[dict[str, Any]], last_step: int) -> list[dict[str, Any]]:
    """The history as recorded: each step range with its values of the flags that differ between ranges; [] for a
    run that never changed its settings."""
    if len(history) < 2:
        return []
    names = set().union(*(h["settings"].keys() for h in history))
    varying = sorted(n for n in names if len({json.dumps(h["settings"].get(n)) for h in history}) > 1)
    ends = [h["from_step"] - 1 for h in history[1:]] + [last_step]
    return [{"steps": [h["from_step"], end], "changed": {n: h["settings"].get(n) for n in varying}}
            for h, end in zip(history, ends)]


def recorded_settings(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The settings of each step range a completion record holds (the last one's alone where it has no ranges),
    each complete; [] for a record written before settings were kept."""
    last = record.get("settings")
    if not isinstance(last, dict):
        return []
    return [complete({**last, **segment.get("changed", {})}) for segment in record.get(SETTINGS_KEY) or []] \
        or [complete(last)]


def matching(recorded: list[dict[str, Any]], now: dict[str, Any],
             computed: Optional[str] = None) -> Optional[dict[str, Any]]:
    """The first recorded settings `now` matches (on the flags both know; `computed`: see differences), or None."""
    for then in recorded:
        if not differences(then, now, computed=computed):
            return then
    return None
