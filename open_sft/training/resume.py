"""Resuming a run: the checkpoint to resume from (the newest complete one under --resume_from_checkpoint auto),
the settings it must share with this run (run_identity, check_compatible), and metrics.jsonl cut back to its step.
A fresh start moves earlier checkpoints aside."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional


from open_sft.data.template_date import dates_of
from open_sft.distributed.collectives import broadcast_object
from open_sft.durable import first_previous, next_previous, set_aside
from open_sft.errors import UserError
from open_sft.training.checkpoint import (CHECKPOINTS, PEEKED_PATH, STATE_FILE, ResumePoint, continued, newest_usable,
                                         problem_with, step_dirs, timeline_of)
from open_sft.training.damage import DAMAGED
from open_sft.training.elastic import convertible, keeps_global_batch, rescalable, split_is_free
from open_sft.training.input_identity import INPUTS_KEY, MODEL_FLAGS, identities
from open_sft.training.steps import balances
from open_sft.training.trained_state import base_fingerprint

if TYPE_CHECKING:
    from open_sft.distributed.parallelism import Parallelism

logger = logging.getLogger(__name__)

#: What a resumed run must share with the checkpoint, and the flag that sets each.
IDENTITY_FLAGS = {
    "dataset_cache_key": "the tokenized data (cache key of --dataset_mixer_list, tokenizer, chat template, "
                         "--max_seq_length, ...)",
    "micro_batch_size": "--per_device_train_batch_size",
    "gradient_accumulation_steps": "--gradient_accumulation_steps",
    "world_size": "the number of processes (world size)",
    "seed": "--seed",
    "packing": "--packing",
    "max_tokens_per_batch": "--max_tokens_per_batch",
    "balanced": "--balance_micro_batches (its default is off under --loss_normalization mean)",
    "engine": "the training engine (DeepSpeed, FSDP2 and neither resume each other's checkpoints; pipeline stages "
              "only under pipeline parallelism)",
    "sequence_parallel_size": "--sequence_parallel_size (it sets DeepSpeed's data-parallel partitioning)",
    "tensor_parallel_size": "accelerate's --parallelism_config_tp_size (it sets how each parameter is sharded)",
    "pipeline_parallel_size": "--pipeline_parallel_size and its stages (each writes its own part)",
    "adapters": "what trains: the full model, or LoRA adapters (--use_lora / --use_qlora, --lora_rank, "
                "--lora_alpha, --lora_target_modules)",
    "base": "the QLoRA base's weights (--model_name_or_path: each start quantizes it again, the checkpoint holds the "
            "adapter alone; pin the checkpoint's Hub revision with --model_revision, or restore its files)",
}
# What a checkpoint written before a setting was recorded ran with (packing and its budget, recorded since
# the same version, are not compared with such a checkpoint).
IDENTITY_BEFORE_RECORDED = {"balanced": False, "sequence_parallel_size": 1, "tensor_parallel_size": 1,
                            "pipeline_parallel_size": 1}
ENGINES = {"deepspeed": "deepspeed", "fsdp2": "fsdp2"}  # the run's engine → checkpoint format; else torch
# The flags that shape the tokenized data (open_sft.data.cache_inputs.key_inputs), by their names in the settings
# a checkpoint records: the ones a resume's changed data are named by.
DATA_FLAGS = frozenset({
    "dataset_mixer_list", "dataset_mixer_list_splits", "dataset_config_name", "dataset_mixer_unit", "dataset_format",
    "chat_template_name", "chat_template_path", "chat_template_kwargs", "dataset_mixer_list_chat_template_kwargs",
    "reasoning_loss", "reasoning_history", "add_bos", "sft_messages_key", "dataset_text_field", "on_bad_row",
    "eval_split_ratio", "max_seq_length", "truncation", "train_on", "model_name_or_path", "tokenizer_name_or_path",
    "tokenizer_revision", "model_revision", "add_tokens", "add_special_tokens", "seed"})


def remove_partials(root: Path) -> None:
    """A step_N.tmp left by a crash mid-save (and a load's step_N.universal.tmp/.portable.tmp scratch) is deleted:
    only this run writes into its output dir (its lock), and no save or load is under way before it starts (left in
    place, nothing would ever remove one: pruning counts step_N alone)."""
    for partial in sorted(root.glob("step_*.tmp")) if root.is_dir() else []:
        logger.warning("removing partial checkpoint %s (interrupted while being written)", partial)
        shutil.rmtree(partial, ignore_errors=True)


def newest_complete(root: Path) -> Optional[Path]:
    """The newest usable checkpoint; every newer unusable one is skipped with a warning naming it."""
    for _, path in step_dirs(root):
        problem = problem_with(path)
        if problem is None:
            return path
        if DAMAGED in problem:  # moved aside, kept: never resumed from nor pruned, and said once
            target = next_damaged(path)
            path.rename(target)
            logger.warning("checkpoint %s: %s; moved to %s, resuming from an older one", path, problem, target.name)
            continue
        logger.warning("skipping checkpoint %s: %s", path, problem)
    return None


def next_damaged(path: Path) -> Path:
    """step_N.damaged beside `path` (step_N.damaged-K when taken)."""
    target, k = path.with_name(f"{path.name}.damaged"), 1
    while target.exists():
        k += 1
        target = path.with_name(f"{path.name}.damaged-{k}")
    return target


def _choose(setting: str, output_dir: Path) -> tuple[Optional[Path], Optional[str]]:
    """The checkpoint to resume from and the timeline it continues (see `timeline_of`)."""
    if setting == "none":
        return None, None
    root = output_dir / CHECKPOINTS
    remove_partials(root)  # under none the whole directory is moved aside
    if setting == "auto":
        newest = newest_complete(root)
        return newest, timeline_of(newest)
    path = Path(setting).expanduser()
    named, own = str(path.resolve()), continued(setting, output_dir)
    if own is not None:  # a requeue: this timeline's own checkpoint wins
        if own.resolve() != path.resolve():
            logger.info("--resume_from_checkpoint %s: resuming from %s instead, the newest checkpoint this command "
                        "wrote after it (as open-instruct, the output dir's newest checkpoint wins)", setting, own)
        return own, named
    problem = problem_with(path)
    if problem is not None:
        raise UserError(f"--resume_from_checkpoint {setting}: not a usable checkpoint ({problem}); pass a "
                        f"complete checkpoint directory (checkpoints/step_N), auto, or none")
    return path, named


def relaunch_point(setting: str, output_dir: Path) -> Optional[Path]:
    """The checkpoint a relaunch under `setting` (as the run applies it: completion.resume_setting) resumes from, as
    `_choose` picks it but reading only (a rank that lost its run names it as it exits: lifeline.resume_from):
    None under none (a fresh start); under auto the newest checkpoint problem_with finds nothing wrong with (None:
    step 0); a named one's newest continuation in OUTPUT_DIR (a requeue), else the named checkpoint."""
    if setting == "none":
        return None
    if setting == "auto":
        return newest_usable(output_dir / CHECKPOINTS)
    return continued(setting, output_dir) or Path(setting).expanduser()


def set_aside_other_timeline(resume: Optional[ResumePoint], output_dir: Path) -> None:
    """A run restarted from a named checkpoint must not mix its checkpoints with another timeline's (pruning would
    count them, auto would resume from them): the newer checkpoints of its output dir when the named one is
    there (a rewind), else all of them (a warm start from another run), move to checkpoints.previous-K (a symlinked
    checkpoints/: previous-K inside its target). Main process, once the resume is accepted (a refused launch
    changes nothing)."""
    if resume is None or resume.timeline is None or resume.path.resolve() != Path(resume.timeline):
        return  # a fresh start, an auto resume, or a requeue resuming this timeline's own checkpoint
    root = output_dir / CHECKPOINTS
    inside = resume.path.resolve().parent == root.resolve()
    other = [path for number, path in step_dirs(root) if not inside or number > resume.step]
    if not other:
        return
    # a symlinked checkpoints/: inside its target (durable.set_aside), where a rename crosses no disk
    target = first_previous(root.resolve()) if root.is_symlink() else next_previous(root)
    target.mkdir()
    for path in other:
        path.rename(target / path.name)
    logger.warning("resuming from %s: the checkpoints of another timeline (%s) were moved to %s", resume.path,
                   ", ".join(path.name for path in reversed(other)), target)


def _differences(saved: dict[str, Any], current: dict[str, Any], free_split: bool = False) -> list[str]:
    """The identity settings a resume may not change, each as `what: checkpoint X, now Y` (of those `current`
    holds). `free_split`: this run's micro-batch is a performance choice (elastic.split_is_free): another split of
    the checkpoint's global batch goes on (unpacked: the same examples at every step, the same loss sum)."""
    saved = {**IDENTITY_BEFORE_RECORDED, **saved}
    # another number of ranks goes on when the global batch is kept (open_sft.training.elastic fitted the
    # accumulation, or refused, before the model was built)
    rescaled = saved.get("world_size") != current.get("world_size") and rescalable(saved, current)
    # another engine goes on when both engines' formats convert (open_sft.training.portable; what it refuses was
    # refused with the reason before the model was built: elastic.fit_to_checkpoint)
    allowed = ({"gradient_accumulation_steps"} if rescaled else set()) | (
        {"engine"} if convertible(saved, current) else set())
    if keeps_global_batch(saved, current):
        allowed.add("world_size")  # the ranks alone would resume (the same global batch): another line is refused
    if free_split and not saved.get("packing") and keeps_global_batch(saved, current):
        allowed |= {"micro_batch_size", "gradient_accumulation_steps", "world_size"}
    if saved.get("pipeline_parallel_size") != current.get("pipeline_parallel_size"):
        allowed.add("engine")  # the pipeline's own line names the reason (stages, not another engine's format)
    return [f"{IDENTITY_FLAGS[key]}: checkpoint {saved.get(key)!r}, now {current[key]!r}"
            for key in IDENTITY_FLAGS if key in saved and key in current and saved[key] != current[key]
            and key not in allowed]


def _refusal(path: Any, differences: list[str]) -> UserError:
    lines = "\n".join(f"  - {d}" for d in differences)
    return UserError(
        f"cannot resume from {path}: it was written with different settings:\n{lines}\n"
        "Relaunch with the checkpoint's settings to continue that run, or start over with "
        "--resume_from_checkpoint none (earlier checkpoints are moved aside) or another --output_dir."
    )


def check_compatible(path: Path, saved: dict[str, Any], current: dict[str, Any], free_split: bool = False) -> None:
    """Refuse to resume when the data or the batch layout differ: the run would silently not be the same."""
    differences = _differences(saved, current, free_split)
    if differences:
        raise _refusal(path, differences)


def changed_data_refusal(state: dict[str, Any], now: dict[str, Any], current: dict[str, Any]) -> UserError:
    """check_compatible's refusal of a resume whose tokenized data are not its checkpoint's, said before they are
    tokenized and the model loaded (`state`: the checkpoint's trainer state as elastic.peek read it; `now`: this
    launch's settings; `current`: its run_identity, with the data's key): the cache keys' line names in their place
    each flag that shapes the data, with its value in the checkpoint and now, where one changed (else a source
    file's contents, the tokenizer's files or the chat template did, and the keys stay)."""
    from open_sft.training.run_settings import checkpoint_settings, differences

    then = {k: v for k, v in checkpoint_settings(state).items() if k in DATA_FLAGS}
    named = differences(then, {k: v for k, v in now.items() if k in DATA_FLAGS}, "in the checkpoint")
    lines, flags = [], {line.split(":")[0] for line in named}
    for line in _differences(state.get("identity") or {}, current):
        if line.split(":")[0] in flags:  # --seed: named once
            continue
        if line.startswith(IDENTITY_FLAGS["dataset_cache_key"]):
            lines += named or [f"{line} (no flag that shapes them changed: a source file's contents, the tokenizer's "
                               "files or the chat template did, or open_sft's tokenized data changed with an upgrade "
                               "(its cache format, or a text-only mixture's key without the chat template: since "
                               "cache format 43 for .txt and JSON Lines sources, since a later upgrade for parquet "
                               "files and save_to_disk directories))"]
        else:
            lines.append(line)
    return _refusal(state.get(PEEKED_PATH, "the checkpoint"), lines)


def resolve_resume(setting: str, output_dir: Path, identity: dict[str, Any], is_main: bool,
                   train: Any = None) -> Optional[ResumePoint]:
    """Pick the checkpoint to resume from (main rank decides, every rank gets the same answer) and check
    it matches this run (`train`: its training arguments, whose micro-batch split may be free:
    elastic.split_is_free). Collective when distributed. Raises UserError on a mismatch."""
    chosen = timeline = error = None
    if is_main:
        try:
            chosen, timeline = _choose(setting, output_dir)
        except UserError as exc:
            error = str(exc)
    chosen, timeline, error = broadcast_object((str(chosen) if chosen else None, timeline, error))
    if error:
        raise UserError(error)
    if chosen is None:
        if is_main:
            _move_aside(output_dir / CHECKPOINTS)
        return None
    path = Path(chosen)
    state = json.loads((path / STATE_FILE).read_text())
    check_compatible(path, state.get("identity", {}), identity, train is not None and split_is_free(train))
    logger.info("resuming from %s (step %d)", path, state["step"])
    return ResumePoint(path, state, timeline)


def _move_aside(root: Path) -> None:
    """A fresh start must not mix its checkpoints with an earlier run's: move those out of the way."""
    target = set_aside(root)
    if target is not None:
        logger.warning("starting over: the earlier checkpoints were moved to %s", target)


def metrics_up_to(path: Path, step: int) -> str:
    """metrics.jsonl's lines of the steps up to `step`, each ending in a newline; a line cut short (by a kill, or
    being written by a live run) is left out."""
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("step", 0) <= step:
            kept.append(line + "\n")
    return "".join(kept)


def continued_step(resume: Optional[ResumePoint], output_dir: Path) -> int:
    """The step after which the run continues the metrics.jsonl and trackers (TensorBoard events, the W&B run) of
    output_dir: the checkpoint's when it is one of OUTPUT_DIR/checkpoints. 0 for a fresh start and a warm start (a
    checkpoint outside them: another run's, or one moved aside), which begin them anew: what is there is another
    timeline's (TensorBoard drew its steps before the warm start's, a W&B run went on with them)."""
    own = resume is not None and resume.path.resolve().parent == (output_dir / CHECKPOINTS).resolve()
    return resume.step if own else 0


def prepare_metrics_file(path: Path, resume: Optional[ResumePoint]) -> None:
    """Fresh run: no metrics.jsonl. Resumed: keep the lines up to the checkpoint's step, drop later ones
    (they are logged again) and any line a kill cut short. A warm start begins anew (`continued_step`)."""
    if not continued_step(resume, path.parent) or not path.exists():
        path.unlink(missing_ok=True)
        return
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text(metrics_up_to(path, resume.step))
    os.replace(tmp, path)


def run_identity(config: Any, cache_key: str, parallelism: Parallelism, model_config: Any = None) -> dict[str, Any]:
    """The settings a checkpoint records and a resume must match (see IDENTITY_FLAGS); the run's engine decides
    the checkpoint format (ENGINES). `model_config`: the loaded model's, from which a QLoRA run's base is named
    (trained_state.base_fingerprint; before the model loads, not compared); with it, the model's and config's
    identities (input_identity: a resume lets their paths differ where they match, completion.check_resume_point)."""
    t, pipeline = config.train, parallelism.pp_enabled
    qlora = config.lora.use_qlora and model_config is not None
    return {"engine": "pipeline" if pipeline else ENGINES.get(parallelism.engine, "torch"),
            "pipeline_parallel_size": f"{t.pipeline_parallel_size} ({t.pipeline_virtual_stages} per rank, layers "
                                      f"{t.pipeline_layers or 'balanced'}{', FSDP2' * parallelism.fsdp})"
                                      if pipeline else 1, "dataset_cache_key": cache_key,
            "micro_batch_size": t.per_device_train_batch_size, "gradient_accumulation_steps":
            t.gradient_accumulation_steps, "world_size": parallelism.world_size, "seed": t.seed, "packing": t.packing,
            "max_tokens_per_batch": t.max_tokens_per_batch, "balanced": balances(t),
            "sequence_parallel_size": t.sequence_parallel_size, "tensor_parallel_size": parallelism.tp,
            "adapters": adapters(config.lora),
            **({"base": base_fingerprint(config.model.model_name_or_path, model_config)} if qlora else {}),
            **({INPUTS_KEY: identities(config, MODEL_FLAGS)} if model_config is not None else {}),  # not compared
            **({"template_date": dated} if (dated := dates_of(cache_key)) else {})}  # not compared: data/prepare.py


def adapters(lora: Any) -> str:
    """What a run trains, as its checkpoint records it: a checkpoint of adapters does not load into the full
    model nor into adapters of another rank or other modules, and another alpha scales every update otherwise."""
    if not (lora.use_lora or lora.use_qlora):
        return "full model"
    return (f"{'QLoRA' if lora.use_qlora else 'LoRA'} rank {lora.lora_rank}, alpha {lora.lora_alpha:g}, on "
            f"{' '.join(sorted(lora.lora_target_modules))}")
