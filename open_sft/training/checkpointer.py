"""The trainer's checkpointer: saves at the configured steps and on preemption (collective: each rank writes its
part, the main rank publishes and prunes: open_sft.training.checkpoint), restores a resume point, and ends a
preempted run with the preemption's exit code."""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Collection, Optional

import torch

from open_sft.distributed import lifeline
from open_sft.durable import fsync_tree
from open_sft.training.checkpoint import (CHECKPOINTS, FORMAT_VERSION, METRICS_FILE, MODEL_FILES, STATE_FILE,
                                          TIMELINE_KEY, ResumePoint, prune, publish, rerun_after_full_disk, step_dirs)
from open_sft.training.preemption import PREEMPTED_EXIT_CODE, Preempted, StopRequest


logger = logging.getLogger(__name__)


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
        def what(exc: BaseException) -> str:  # what it left: step_N.tmp, or step_N once renamed (COMPLETE failed)
            renamed = not (self.root / f"step_{step}.tmp").exists() and (self.root / f"step_{step}").is_dir()
            left = f"step_{step}, without COMPLETE," if renamed else f"step_{step}.tmp"
            return f"checkpoint step_{step} could not be written (its unfinished {left} is never resumed from)"

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
