"""Resumable training state: atomic checkpoints, which are usable, pruning (choosing one to resume from and
what it must share with the run: open_sft.training.resume).

Layout of OUTPUT_DIR/checkpoints/step_N/ (N = optimizer steps done):
    accelerate's save_state: model + optimizer (DeepSpeed's own per-rank files under ZeRO, else
        model.safetensors + optimizer.bin; under QLoRA model.safetensors holds the trained weights only, not the
        4-bit base: open_sft.training.trained_state) and random_states_<rank>.pkl (python, numpy, torch RNGs per rank)
    model/: everything of the run's export but its weights (config.json, tokenizer, generation config; under LoRA
        adapter_config.json too), so that `open_sft export` makes a model of the checkpoint alone
    trainer_state.json: the step (our data order is a pure function of (seed, epoch, step), and so is the
        learning rate, so the step *is* the exact data and schedule position), token counters, the open logging
        window, the settings a resume must share (cache key, batch layout, seed), the resolved config
    COMPLETE: written last; a manifest of every file with its size

A checkpoint is written to step_N.tmp/, fsynced, renamed to step_N/, then metrics.jsonl (whose lines up to
step N a resume keeps) is fsynced, then COMPLETE is written and fsynced. A directory without COMPLETE, or whose
files do not match the manifest (or whose tensor files' headers do not read: damage_in), is never resumed from and
never pruned (but one without COMPLETE older than a usable one: what a kill while pruning left). Pruning follows
COMPLETE; a kill between the two leaves one checkpoint too many, which the next start
deletes (`Checkpointer.restore`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Collection, Iterator, Optional

import torch

from open_sft.distributed import lifeline
from open_sft.durable import FREE_SPACE, fsync_path, fsync_tree, human_size, refused_write, write_json
from open_sft.errors import UserError
from open_sft.file_modes import share_as_umask
from open_sft.training.damage import damage_in
from open_sft.training.preemption import PREEMPTED_EXIT_CODE, Preempted, StopRequest


logger = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
COMPLETE = "COMPLETE"
STATE_FILE = "trainer_state.json"
MODEL_FILES = "model"
METRICS_FILE = "metrics.jsonl"
FORMAT_VERSION = 1
TIMELINE_KEY = "timeline_from"  # in trainer_state.json: timeline_of
PEEKED_PATH = "peeked_from"  # added by elastic.peek to the trainer state it read (never written): which checkpoint
_STEP_DIR = re.compile(r"^step_(\d+)$")



@dataclass(frozen=True)
class ResumePoint:
    path: Path
    state: dict[str, Any]
    timeline: Optional[str] = None  # the named checkpoint the run continues from (timeline_of)

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
        return "a file, not a directory" if path.is_file() else "no such directory"
    complete = path / COMPLETE
    if not complete.is_file():
        return what_else(path) or "no COMPLETE marker (interrupted while being written)"
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
    return damage_in(path, files)


def what_else(path: Path) -> Optional[str]:
    """What `path`, a directory with no COMPLETE marker, is when it is no interrupted checkpoint: a run's output
    directory or its checkpoints/ (with the newest complete checkpoint to pass instead), or no step_N at all."""
    root = path / CHECKPOINTS if (path / CHECKPOINTS).is_dir() else path
    newest = newest_usable(root)
    pass_newest = f"pass its newest complete checkpoint, {newest}" if newest else "it holds no complete checkpoint"
    if root != path or (path / "run.json").is_file():
        return f"it is a run's output directory, not a checkpoint; {pass_newest}"
    if step_dirs(path):
        return f"it is a run's {CHECKPOINTS}/ directory, not a checkpoint; {pass_newest}"
    return None if _STEP_DIR.match(path.name) else "no COMPLETE marker and not named step_N: no checkpoint"


def continued(setting: str, output_dir: Path) -> Optional[Path]:
    """The newest complete checkpoint of OUTPUT_DIR when a run resumed from the named checkpoint `setting` wrote
    it (a requeue of that command resumes there, as open-instruct's: the output dir's newest checkpoint wins;
    the named one may have been pruned since), else None. Reads only."""
    named = str(Path(setting).expanduser().resolve())
    newest = newest_usable(output_dir / CHECKPOINTS)
    return newest if newest is not None and timeline_of(newest) == named else None


def newest_usable(root: Path) -> Optional[Path]:
    """The newest checkpoint under `root` that problem_with finds nothing wrong with, or None. Reads only (a resume
    moves a damaged one aside: open_sft.training.resume.newest_complete)."""
    return next((path for _, path in step_dirs(root) if problem_with(path) is None), None)


@contextmanager
def rerun_after_full_disk(disk: Path, root: Path, what: str | Callable[[BaseException], str], room: str = "",
                          needs: str = "") -> Iterator[None]:
    """A write under the block that the disk holding `disk` refuses for want of space (durable.out_of_space: torch's
    and the Rust writers' errors, a DCP CheckpointException's too, a BaseException), or as read-only or not this
    user's (durable.refused_write), becomes a UserError saying `what` failed (a callable: told the exception), the
    fix (`room`: a way to need less space) and where the rerun of the same command resumes: the newest complete
    checkpoint under `root` (the run's checkpoints/), and what the rerun needs (`needs`; by default one more
    checkpoint: as much as the newest). Other errors pass through."""
    try:
        yield
    except BaseException as exc:
        refused = None if isinstance(exc, (KeyboardInterrupt, SystemExit)) else refused_write(exc, disk)
        if refused is None:
            raise
        reason, fix = refused
        newest = newest_usable(root)
        full = fix == FREE_SPACE  # what the rerun needs and a way to need less: said of a full disk
        size = f" ({needs or human_size(_size(newest)) + ': about what one more needs'})" if full and newest else ""
        where = (f"from the newest complete checkpoint, {newest.name}{size}" if newest is not None
                 else f"from step 0 (no complete checkpoint yet{f'; {needs}' if needs and full else ''})")
        what = what(exc) if callable(what) else what
        room = f" ({room})" if room and full else ""
        raise UserError(f"{reason}: {what}; {fix}{room} and rerun the same command: it resumes {where}") from exc


def timeline_of(checkpoint: Optional[Path]) -> Optional[str]:
    """The named checkpoint (resolved path) the run that wrote `checkpoint` started from, None for a run trained
    from step 0 or one whose checkpoints predate the record: checkpoints of one timeline carry the same one."""
    if checkpoint is None:
        return None
    return json.loads((checkpoint / STATE_FILE).read_text()).get(TIMELINE_KEY)


# ----------------------------------------------------------------------------------------------
# Writing checkpoints
# ----------------------------------------------------------------------------------------------
def _manifest(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


def _size(root: Path) -> int:
    return sum(_manifest(root).values())


def publish(tmp: Path, final: Path, step: int, covers: Collection[Path] = ()) -> None:
    """step_N.tmp → step_N, then the files it `covers` (metrics.jsonl up to step N) on disk, then COMPLETE (the
    manifest) written, flushed and renamed into place."""
    if final.exists():  # an unusable leftover of an earlier attempt at this step
        shutil.rmtree(final)
    share_as_umask(tmp)  # safetensors writes 0600 whatever the umask
    os.rename(tmp, final)
    fsync_path(final.parent)
    for path in covers:
        if path.is_file():
            fsync_path(path)
    write_json(final / COMPLETE, {"step": step, "files": _manifest(final), "format": FORMAT_VERSION})


def prune(root: Path, keep: int, busy: Collection[Path] = ()) -> list[Path]:
    """Delete complete checkpoints beyond the newest `keep` usable ones (COMPLETE first: a kill part-way leaves an
    incomplete one, never resumed from), nor one in `busy` (under --push_checkpoints: not recorded as uploaded; a
    later prune deletes it). An incomplete one is never touched unless it is older than a usable one: then it can
    only be what a kill during an earlier prune left (a kill while one is written leaves the newest), and it is
    deleted, with a line.
    keep -1: keep all."""
    if keep < 0:
        return []
    usable, newest, removed = 0, None, []
    for _, path in step_dirs(root):
        if not (path / COMPLETE).is_file():
            if newest is not None:
                shutil.rmtree(path)
                logger.info("deleted %s: it has no COMPLETE and is older than %s, a usable checkpoint: what a kill "
                            "while pruning it left", path, newest.name)
            continue
        if usable < keep:
            if problem_with(path) is None:
                usable, newest = usable + 1, newest or path
            continue
        if path in busy:
            logger.info("keeping old checkpoint %s until it is uploaded", path)
        else:
            (path / COMPLETE).unlink()
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
                 uploader: Any = None, state_io: Any = None,
                 model_files: Optional[Callable[[Path], None]] = None):
        """`args`: the CheckpointArguments; `config`: the resolved config (token already scrubbed);
        `uploader`: an export.hub_checkpoints.CheckpointUploader on the main process with --push_checkpoints;
        `state_io`: what saves and loads model, optimizer and RNG states (`save(dir)`, `load(dir)`) where
        accelerate's save_state does not (pipeline stages: training.pipeline_state.PipelineState).
        `model_files(directory)` writes the export's files but its weights (main process).
        Constructing a checkpointer touches no signal handler: `stop` is installed by the caller."""
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
        self.model_files = model_files
        self.save_seconds: list[float] = []  # each save's of this launch (the time estimate's)
        self.timeline: Optional[str] = None  # the resume point's, recorded in each checkpoint

    def restore(self, resume: Optional[ResumePoint]) -> int:
        """Load model, optimizer and RNG states, and the trainer's own; returns the step to start at."""
        if self.uploader is not None:  # --push_checkpoints: what the last launch left un-uploaded goes first
            self.uploader.resubmit(self.root)
        if resume is None:
            return 0
        self.timeline = resume.timeline
        self.state_io.load(str(resume.path))
        self.trainer.load_state_dict(resume.state)
        if self.accelerator.is_main_process:
            self._finish_pruning(resume)
        return resume.step

    def _finish_pruning(self, resumed: ResumePoint) -> None:
        """The pruning a kill between a checkpoint's COMPLETE and its pruning left undone, or a lowered
        --keep_last_n_checkpoints asks for: when resuming from the newest checkpoint of this run (a named older one
        had the newer ones moved aside: resume.set_aside_other_timeline)."""
        newest = step_dirs(self.root)[:1]
        if not newest or newest[0][1].resolve() != resumed.path.resolve():
            return
        earlier = ((resumed.state.get("config") or {}).get("checkpoint") or {}).get("keep_last_n_checkpoints")
        lowered = isinstance(earlier, int) and (earlier < 0 or earlier > self.keep >= 0)
        why = (f"lowered from {earlier} since the checkpoints were written" if lowered
               else "the pruning the last run was stopped before")
        for path in prune(self.root, self.keep, self._unpushed()):
            logger.info("deleted old checkpoint %s (--keep_last_n_checkpoints %d): %s", path, self.keep, why)

    def _unpushed(self) -> Collection[Path]:
        """What pruning keeps under --push_checkpoints: the checkpoints not recorded as uploaded (none once the Hub
        refused the token: CheckpointUploader.kept)."""
        return self.uploader.kept(self.root) if self.uploader is not None else ()

    def finish_uploads(self, timeout: Optional[float] = None) -> bool:
        """Main process, after the other ranks are released: wait (bounded) for the checkpoint uploads,
        then prune what pruning skipped while they ran. True when none is left un-uploaded."""
        if self.uploader is None:
            return True
        self.uploader.close(timeout)
        for path in prune(self.root, self.keep, self._unpushed()):
            logger.info("deleted old checkpoint %s", path)
        left = self.uploader.unpushed(self.root)
        self.uploader = None
        return not left

    def raise_if_preempted(self, metrics: Any) -> None:
        """After a stop on a signal: release everything and raise Preempted (exit PREEMPTED_EXIT_CODE). The stop's
        handler, which only notes a signal, stays until the process exits: a repeat (a launcher forwarding the
        Ctrl-C the terminal already sent) must not turn the saved stop into an interruption."""
        if self.preempted_at is None:
            self.stop.uninstall()
            return
        if metrics is not None:
            metrics.close()
        self.accelerator.end_training()
        lifeline.release()  # the collectives are over: the other ranks exit while this one waits for its uploads
        if self.uploader is not None:  # bounded by the grace a scheduler leaves; the relaunch uploads the rest
            self.finish_uploads(self.uploader.stop_wait_s)
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
            lifeline.note_stop(self.stop.signal_name or "another rank's signal")
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
            TIMELINE_KEY: self.timeline,
            "saved_at": time.time(),
        }

    def save(self, step: int, preempted: bool = False) -> Path:
        """Collective: every rank writes its part into step_N.tmp; the main rank publishes it. A disk that is full
        is a UserError on the rank that found it (saying where the rerun resumes); its exit stops the others
        (the launcher ends the run, a peer's lifeline notices), none waits at a barrier."""
        what = f"checkpoint step_{step} could not be written (its unfinished step_{step}.tmp is never resumed from)"
        with rerun_after_full_disk(self.root, self.root, what, "fewer --keep_last_n_checkpoints keeps less"):
            return self._save(step, preempted)

    def _save(self, step: int, preempted: bool) -> Path:
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
            if self.model_files is not None:
                self.model_files(tmp / MODEL_FILES)
        fsync_tree(tmp)
        acc.wait_for_everyone()
        if acc.is_main_process:
            publish(tmp, final, step, covers=(self.output_dir / METRICS_FILE,))
            for path in prune(self.root, self.keep, self._unpushed()):
                logger.info("deleted old checkpoint %s", path)
            logger.info("saved checkpoint %s (%.1fs)", final, time.perf_counter() - started)
            if self.uploader is not None:
                self.uploader.submit(final)
        acc.wait_for_everyone()
        self.save_seconds.append(time.perf_counter() - started)
        return final


class _AccelerateState:
    def __init__(self, accelerator):
        self.save, self.load = accelerator.save_state, accelerator.load_state
