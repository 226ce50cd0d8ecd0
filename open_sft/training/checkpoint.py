"""Resumable training state: atomic checkpoints, choosing one to resume from, pruning.

Layout of OUTPUT_DIR/checkpoints/step_N/ (N = optimizer steps done):
    accelerate's save_state: model + optimizer (DeepSpeed's own per-rank files under ZeRO, else
        model.safetensors + optimizer.bin) and random_states_<rank>.pkl (python, numpy, torch RNGs per rank)
    trainer_state.json: the step (our data order is a pure function of (seed, epoch, step), and so is the
        learning rate, so the step *is* the exact data and schedule position), token counters, the open logging
        window, the settings a resume must share (cache key, batch layout, seed), the resolved config
    COMPLETE: written last; a manifest of every file with its size

A checkpoint is written to step_N.tmp/, fsynced, renamed to step_N/, then COMPLETE is written and
fsynced. A directory without COMPLETE, or whose files do not match the manifest, is never resumed from
and never pruned.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Collection, Optional

import torch

from open_sft.durable import fsync_path, fsync_tree, set_aside, write_json
from open_sft.errors import UserError
from open_sft.file_modes import share_as_umask
from open_sft.training.steps import balances
from open_sft.training.preemption import PREEMPTED_EXIT_CODE, Preempted, StopRequest

if TYPE_CHECKING:
    from open_sft.distributed.parallelism import Parallelism

logger = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
COMPLETE = "COMPLETE"
STATE_FILE = "trainer_state.json"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")

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
    "engine": "the training engine (DeepSpeed, FSDP2, or neither: each writes its own checkpoint format)",
    "sequence_parallel_size": "--sequence_parallel_size (it sets DeepSpeed's data-parallel partitioning)",
    "tensor_parallel_size": "accelerate's --parallelism_config_tp_size (it sets how each parameter is sharded)",
    "pipeline_parallel_size": "--pipeline_parallel_size and its stages (each writes its own part)",
    "adapters": "what trains: the full model, or LoRA adapters (--use_lora / --use_qlora, --lora_rank, "
                "--lora_alpha, --lora_target_modules)",
}
# What a checkpoint written before a setting was recorded ran with (packing and its budget, recorded since
# the same version, are not compared with such a checkpoint).
IDENTITY_BEFORE_RECORDED = {"balanced": False, "sequence_parallel_size": 1, "tensor_parallel_size": 1,
                            "pipeline_parallel_size": 1}
ENGINES = {"deepspeed": "deepspeed", "fsdp2": "fsdp2"}  # the run's engine → checkpoint format; else torch


@dataclass(frozen=True)
class ResumePoint:
    path: Path
    state: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.state["step"])


# ----------------------------------------------------------------------------------------------
# Reading checkpoints
# ----------------------------------------------------------------------------------------------
def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """step_N directories under root (not .tmp ones), newest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return sorted(found, reverse=True)


def problem_with(path: Path) -> Optional[str]:
    """Why `path` is not a usable checkpoint, or None if it is."""
    if not path.is_dir():
        return "no such directory"
    complete = path / COMPLETE
    if not complete.is_file():
        return "no COMPLETE marker (interrupted while being written)"
    try:
        manifest = json.loads(complete.read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return "unreadable COMPLETE manifest"
    for name, size in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, the manifest says {size}"
    try:
        json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError):
        return f"{STATE_FILE} is unreadable"
    return None


def newest_complete(root: Path) -> Optional[Path]:
    """The newest usable checkpoint; every newer unusable one is skipped with a warning naming it.
    A step_N.tmp left by a crash is deleted: only this run writes into its output dir, and no save is
    under way before it starts (left in place, nothing would ever remove one past the last step)."""
    for partial in sorted(root.glob("step_*.tmp")) if root.is_dir() else []:
        logger.warning("removing partial checkpoint %s (interrupted while being written)", partial)
        shutil.rmtree(partial, ignore_errors=True)
    for _, path in step_dirs(root):
        problem = problem_with(path)
        if problem is None:
            return path
        logger.warning("skipping checkpoint %s: %s", path, problem)
    return None


def _choose(setting: str, output_dir: Path) -> Optional[Path]:
    if setting == "none":
        return None
    if setting == "auto":
        return newest_complete(output_dir / CHECKPOINTS)
    path = Path(setting).expanduser()
    problem = problem_with(path)
    if problem is not None:
        raise UserError(f"--resume_from_checkpoint {setting}: not a usable checkpoint ({problem}); pass a "
                        f"complete checkpoint directory (checkpoints/step_N), auto, or none")
    return path


def _broadcast(value: Any) -> Any:
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def check_compatible(path: Path, saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Refuse to resume when the data or the batch layout differ: the run would silently not be the same."""
    saved = {**IDENTITY_BEFORE_RECORDED, **saved}
    differences = [f"{IDENTITY_FLAGS[key]}: checkpoint {saved.get(key)!r}, now {current[key]!r}"
                   for key in IDENTITY_FLAGS if key in saved and saved[key] != current[key]]
    if differences:
        lines = "\n".join(f"  - {d}" for d in differences)
        raise UserError(
            f"cannot resume from {path}: it was written with different settings:\n{lines}\n"
            "Relaunch with the checkpoint's settings to continue that run, or start over with "
            "--resume_from_checkpoint none (earlier checkpoints are moved aside) or another --output_dir."
        )


def resolve_resume(setting: str, output_dir: Path, identity: dict[str, Any], is_main: bool) -> Optional[ResumePoint]:
    """Pick the checkpoint to resume from (main rank decides, every rank gets the same answer) and check
    it matches this run. Collective when distributed. Raises UserError on a mismatch."""
    chosen = None
    error = None
    if is_main:
        try:
            chosen = _choose(setting, output_dir)
        except UserError as exc:
            error = str(exc)
    chosen, error = _broadcast((str(chosen) if chosen else None, error))
    if error:
        raise UserError(error)
    if chosen is None:
        if is_main:
            _move_aside(output_dir / CHECKPOINTS)
        return None
    path = Path(chosen)
    state = json.loads((path / STATE_FILE).read_text())
    check_compatible(path, state.get("identity", {}), identity)
    logger.info("resuming from %s (step %d)", path, state["step"])
    return ResumePoint(path, state)


def _move_aside(root: Path) -> None:
    """A fresh start must not mix its checkpoints with an earlier run's: move those out of the way."""
    target = set_aside(root)
    if target is not None:
        logger.warning("starting over: the earlier checkpoints were moved to %s", target)


def prepare_metrics_file(path: Path, resume: Optional[ResumePoint]) -> None:
    """Fresh run: no metrics.jsonl. Resumed: keep the lines up to the checkpoint's step, drop later ones
    (they are logged again) and any line a kill cut short."""
    if resume is None or not path.exists():
        path.unlink(missing_ok=True)
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("step", 0) <= resume.step:
            kept.append(line)
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------
# Writing checkpoints
# ----------------------------------------------------------------------------------------------
def _manifest(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


def publish(tmp: Path, final: Path, step: int) -> None:
    """step_N.tmp → step_N, then COMPLETE (the manifest) written, flushed and renamed into place."""
    if final.exists():  # an unusable leftover of an earlier attempt at this step
        shutil.rmtree(final)
    share_as_umask(tmp)  # safetensors writes 0600 whatever the umask
    os.rename(tmp, final)
    fsync_path(final.parent)
    write_json(final / COMPLETE, {"step": step, "files": _manifest(final), "format": FORMAT_VERSION})


def prune(root: Path, keep: int, busy: Collection[Path] = ()) -> list[Path]:
    """Delete complete checkpoints beyond the newest `keep` usable ones; never an incomplete one, nor one
    in `busy` (its upload is queued or running: a later prune deletes it). keep -1: keep all."""
    if keep < 0:
        return []
    usable = 0
    removed = []
    for _, path in step_dirs(root):
        if usable < keep:
            usable += problem_with(path) is None
            continue
        if path in busy:
            logger.info("keeping old checkpoint %s until its upload ends", path)
        elif (path / COMPLETE).is_file():
            shutil.rmtree(path)
            removed.append(path)
    return removed


def remove_all(output_dir: Path) -> None:
    """--clean_checkpoints_at_end: the run is exported, its checkpoints are no longer needed."""
    root = output_dir / CHECKPOINTS
    if root.is_dir():
        shutil.rmtree(root)
        logger.info("deleted %s (--clean_checkpoints_at_end)", root)


class Checkpointer:
    """Saves at the configured steps and on preemption; restores a ResumePoint into the trainer."""

    def __init__(self, accelerator, trainer, output_dir: Path, args: Any, identity: dict[str, Any],
                 config: dict[str, Any], reduce_sum: Callable[[torch.Tensor], torch.Tensor], stop: StopRequest,
                 uploader: Any = None, state_io: Any = None):
        """`args`: the CheckpointArguments; `config`: the resolved config (token already scrubbed);
        `uploader`: an export.hub_checkpoints.CheckpointUploader on the main process with --push_checkpoints;
        `state_io`: what saves and loads model, optimizer and RNG states (`save(dir)`, `load(dir)`) where
        accelerate's save_state does not (pipeline stages: training.pipeline_step.PipelineState).
        Installs the SIGTERM/SIGINT/SIGUSR1 handlers of this process."""
        self.accelerator = accelerator
        self.trainer = trainer
        self.output_dir = output_dir
        self.root = output_dir / CHECKPOINTS
        self.every = args.checkpointing_steps
        self.keep = args.keep_last_n_checkpoints
        self.identity = identity
        self.config = config
        self.stop = stop  # installed by the caller: constructing a checkpointer touches no signal handler
        self.reduce_sum, self.uploader = reduce_sum, uploader
        self.preempted_at: Optional[int] = None
        self.state_io = state_io or _AccelerateState(accelerator)

    def restore(self, resume: Optional[ResumePoint]) -> int:
        """Load model, optimizer and RNG states, and the trainer's own; returns the step to start at."""
        if resume is None:
            return 0
        self.state_io.load(str(resume.path))
        self.trainer.load_state_dict(resume.state)
        return resume.step

    def finish_uploads(self) -> None:
        """Main process, after the other ranks are released: wait (bounded) for the checkpoint uploads,
        then prune what pruning skipped while they ran."""
        if self.uploader is None:
            return
        self.uploader.close()
        for path in prune(self.root, self.keep, self.uploader.pending()):
            logger.info("deleted old checkpoint %s", path)
        self.uploader = None

    def raise_if_preempted(self, metrics: Any) -> None:
        """After a stop on a signal: release everything and raise Preempted (exit PREEMPTED_EXIT_CODE)."""
        self.stop.uninstall()
        if self.preempted_at is None:
            return
        if metrics is not None:
            metrics.close()
        self.accelerator.end_training()
        self.finish_uploads()
        raise Preempted(f"stopped on a signal after step {self.preempted_at}; checkpoint saved in "
                        f"{self.root / f'step_{self.preempted_at}'}; relaunch the same command to resume "
                        f"(exit code {PREEMPTED_EXIT_CODE})")

    def _due(self, step: int) -> bool:
        if self.every is None:
            return False
        if self.every == "epoch":
            return self.trainer.steps.ends_epoch(step)
        return step % int(self.every) == 0

    def on_step_end(self, step: int, seconds: float = 0.0) -> bool:
        """The trainer's after-step hook (collective): save when due or asked to stop; True means stop now."""
        stop = self.stop.agreed(self.reduce_sum)
        if stop:
            where = f"{self.stop.signal_name} received here" if self.stop.requested else "signal received by another rank"
            logger.warning("stop requested (%s): saving a checkpoint at step %d and exiting", where, step)
        if stop or self._due(step):
            self.save(step, preempted=stop)
        if stop:
            self.preempted_at = step
        return stop

    def _state(self, step: int, preempted: bool) -> dict[str, Any]:
        steps = self.trainer.steps
        epoch, step_in_epoch = steps.position(step)
        return {
            "format": FORMAT_VERSION, "step": step, "epoch": steps.epochs_done(step),
            "data_position": {"epoch": epoch, "step_in_epoch": step_in_epoch, "seed": self.identity["seed"]},
            "preempted": preempted, **self.trainer.state_dict(),
            "identity": self.identity, "schedule": steps.to_dict(), "config": self.config,
            "saved_at": time.time(),
        }

    def save(self, step: int, preempted: bool = False) -> Path:
        """Collective: every rank writes its part into step_N.tmp; the main rank publishes it."""
        acc = self.accelerator
        tmp, final = self.root / f"step_{step}.tmp", self.root / f"step_{step}"
        started = time.perf_counter()
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        acc.wait_for_everyone()
        self.state_io.save(str(tmp))
        if acc.is_main_process:
            (tmp / STATE_FILE).write_text(json.dumps(self._state(step, preempted), indent=1,
                                                     default=str) + "\n")
        fsync_tree(tmp)
        acc.wait_for_everyone()
        if acc.is_main_process:
            publish(tmp, final, step)
            for path in prune(self.root, self.keep, self.uploader.pending() if self.uploader else ()):
                logger.info("deleted old checkpoint %s", path)
            logger.info("saved checkpoint %s (%.1fs)", final, time.perf_counter() - started)
            if self.uploader is not None:
                self.uploader.submit(final)
        acc.wait_for_everyone()
        return final


class _AccelerateState:
    def __init__(self, accelerator):
        self.save, self.load = accelerator.save_state, accelerator.load_state


def run_identity(config: Any, cache_key: str, parallelism: Parallelism) -> dict[str, Any]:
    """The settings a checkpoint records and a resume must match (see IDENTITY_FLAGS); the run's engine decides
    the checkpoint format (ENGINES)."""
    t, pipeline = config.train, parallelism.pp_enabled
    return {"engine": "pipeline" if pipeline else ENGINES.get(parallelism.engine, "torch"),
            "pipeline_parallel_size": f"{t.pipeline_parallel_size} ({t.pipeline_virtual_stages} per rank, layers "
                                      f"{t.pipeline_layers or 'balanced'}{', FSDP2' * parallelism.fsdp})"
                                      if pipeline else 1, "dataset_cache_key": cache_key,
            "micro_batch_size": t.per_device_train_batch_size, "gradient_accumulation_steps":
            t.gradient_accumulation_steps, "world_size": parallelism.world_size, "seed": t.seed, "packing": t.packing,
            "max_tokens_per_batch": t.max_tokens_per_batch, "balanced": balances(t),
            "sequence_parallel_size": t.sequence_parallel_size, "tensor_parallel_size": parallelism.tp,
            "adapters": adapters(config.lora)}


def adapters(lora: Any) -> str:
    """What a run trains, as its checkpoint records it: a checkpoint of adapters does not load into the full
    model nor into adapters of another rank or other modules, and another alpha scales every update otherwise."""
    if not (lora.use_lora or lora.use_qlora):
        return "full model"
    return (f"{'QLoRA' if lora.use_qlora else 'LoRA'} rank {lora.lora_rank}, alpha {lora.lora_alpha:g}, on "
            f"{' '.join(sorted(lora.lora_target_modules))}")
