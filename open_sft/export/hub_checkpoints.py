"""--push_checkpoints: upload each complete checkpoint to the Hub in the background.

The main process submits OUTPUT_DIR/checkpoints/step_N right after its COMPLETE marker is written; one
daemon thread uploads the submitted checkpoints in order, each as one commit to checkpoints/step_N/ on
the --hub_revision branch (so a checkpoint appears on the Hub whole, COMPLETE included, or not at all),
with push.py's retry/backoff policy. Training never waits for it and other ranks never see it.

"Pushed" is durable: once a checkpoint's commit landed, step_N/PUSHED records it (hub.CHECKPOINT_PUSHED). A
checkpoint without the record for this repo and revision is not on the Hub as far as the run knows: its upload is
queued or running, failed, or was cut off by a kill or a stop (or it predates the record). Pruning never deletes
such a one (`unpushed`), and a relaunch with --push_checkpoints submits each of them again, oldest first, before
its new ones (`resubmit`); one the Hub holds already costs the hashing of its files and no transfer
(huggingface_hub skips the files whose content the Hub has). Only the main thread submits and prunes.

A failed upload logs a warning with the command that retries just that upload; training goes on. A refused one
(HTTP 401/403: the token cannot write to the repository) is said once, naming the repository and the fix; the
training launch uploads no more checkpoints and prunes them as without --push_checkpoints (each one kept un-uploaded
filled the disk: 8 checkpoints kept under --keep_last_n_checkpoints 1 in 8 steps); the relaunch uploads those left.
The relaunch of a completed run that only uploads (`upload_left`) writes no checkpoint: it never prunes one that is
not uploaded.
`close` waits at most OPEN_SFT_HUB_CHECKPOINT_WAIT_S [900] seconds for the uploads still queued at the end of the
run, STOP_WAIT_S after a stop on a signal; what is left is named, and the relaunch uploads it.
The Hub keeps every uploaded checkpoint: pruning is local only.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any, Optional

from open_sft.export import hub as export_hub
from open_sft.export.hub import checkpoint_pushed, describe, push_checkpoint, refusal, resolve_token, retry_command
from open_sft.redaction import scrub
from open_sft.training.checkpoint import CHECKPOINTS, problem_with, prune, remove_all, step_dirs
from open_sft.training.preemption import Preempted

logger = logging.getLogger(__name__)

#: Seconds a stop on a signal waits for the checkpoint uploads in flight: the preemption checkpoint is written
#: already, and the grace left before a SIGKILL is short (docker stop 10 s, torchrun and SLURM's KillWait 30 s, both
#: counted from the signal, before the checkpoint was saved). A commit about to land lands; the rest is the
#: relaunch's (a cut-off upload commits nothing: the Hub holds the checkpoint whole or not at all).
STOP_WAIT_S = 5.0


class CheckpointUploader:
    """Background uploads of complete checkpoints (main process only). `hub`: the HubArguments."""

    stop_wait_s = STOP_WAIT_S  # after a stop on a signal (Checkpointer.raise_if_preempted)

    @classmethod
    def for_run(cls, hub: Any, is_main_process: bool) -> "CheckpointUploader | None":
        """The uploader of a run with --push_checkpoints, on its main process; None elsewhere."""
        return cls(hub) if hub.push_checkpoints and is_main_process else None

    def __init__(self, hub: Any):
        self.repo_id, self.revision, self.private = hub.hub_model_id, hub.hub_revision, hub.hub_private
        self.token = resolve_token(hub.hub_token)
        self.queue: "queue.Queue[Optional[Path]]" = queue.Queue()
        self.lock = threading.Lock()
        self._pending: set[Path] = set()
        self.uploaded: list[Path] = []
        self.failed: list[Path] = []
        self.refused: Optional[str] = None  # why the Hub refused this token (refusal): nothing more is uploaded
        self.thread = threading.Thread(target=self._work, name="open_sft-checkpoint-upload", daemon=True)
        self.thread.start()

    def submit(self, checkpoint: Path) -> None:
        with self.lock:
            self._pending.add(checkpoint)
        self.queue.put(checkpoint)

    def pending(self) -> frozenset[Path]:
        """Checkpoints queued or being uploaded."""
        with self.lock:
            return frozenset(self._pending)

    def kept(self, root: Path) -> frozenset[Path]:
        """What a training launch's pruning must keep: the checkpoints not recorded as uploaded, unless the Hub
        refused this launch's token (none of them would go up in this launch, and kept they filled the disk)."""
        return frozenset() if self.refused is not None else self.unpushed(root)

    def unpushed(self, root: Path) -> frozenset[Path]:
        """The checkpoints under `root` that pruning must keep: none of them is recorded as uploaded here."""
        return frozenset(path for _, path in step_dirs(root) if not checkpoint_pushed(path, self.repo_id,
                                                                                      self.revision))

    def resubmit(self, root: Path) -> list[Path]:
        """A relaunch: submit, oldest first, each complete checkpoint under `root` that is not recorded as uploaded
        (the run before was stopped or killed during its upload, or the upload failed)."""
        left = [path for _, path in reversed(step_dirs(root)) if path not in self.pending()
                and not checkpoint_pushed(path, self.repo_id, self.revision) and problem_with(path) is None]
        if left:
            logger.info("%d complete checkpoint(s) not recorded as uploaded to %s (%s): uploading them first: %s",
                        len(left), self.repo_id, self.revision, ", ".join(path.name for path in left))
        for path in left:
            self.submit(path)
        return left

    def retry_command(self, checkpoint: Path) -> str:
        return retry_command(checkpoint, self.repo_id, self.revision, self.private)

    def _work(self) -> None:
        while (checkpoint := self.queue.get()) is not None:
            started = time.perf_counter()
            try:
                if self.refused is not None:  # each would be refused too: said once, at the first
                    self.failed.append(checkpoint)
                    continue
                url = push_checkpoint(checkpoint, self.repo_id, self.revision, self.private, self.token)
                self.uploaded.append(checkpoint)
                logger.info("uploaded checkpoint %s to %s (%.1fs)", checkpoint.name, url,
                            time.perf_counter() - started)
            except Exception as exc:  # never fatal: the checkpoint is safe on disk
                self.failed.append(checkpoint)
                if refusal(exc) is not None:
                    self._refused(checkpoint, exc)
                    continue
                logger.warning("upload of checkpoint %s to %s failed: %s; training goes on, and the checkpoint "
                               "is kept on disk (never pruned) until it is uploaded: by a relaunch with "
                               "--push_checkpoints, or now (token from HF_TOKEN or --hub_token) with:\n  %s",
                               checkpoint, self.repo_id, scrub(describe(exc), self.token),
                               self.retry_command(checkpoint))
            finally:
                with self.lock:
                    self._pending.discard(checkpoint)

    def _refused(self, checkpoint: Path, exc: BaseException) -> None:
        """Said once. No retry command for `checkpoint` itself: under --keep_last_n_checkpoints the next save may
        prune it (a refused launch prunes as without --push_checkpoints), so the command names step_N."""
        self.refused = scrub(describe(exc), self.token)
        logger.error("the Hub refused the upload of checkpoint %s to %s (%s): this token cannot write there, which "
                     "retrying does not change. This launch uploads no more checkpoints and prunes them as without "
                     "--push_checkpoints: only the newest --keep_last_n_checkpoints stay on disk, the older ones are "
                     "deleted without being uploaded. Fix: a token with write access to %s (HF_TOKEN or --hub_token; "
                     "a fine-grained token needs write permission on it), or another --hub_model_id; then relaunch "
                     "the command: it uploads every complete checkpoint still in %s first (also once the run is "
                     "complete: RUN_COMPLETE notes the uploads left). Or upload one that is still there (step_N) "
                     "now with:\n  %s", checkpoint.name, self.repo_id, self.refused, self.repo_id, checkpoint.parent,
                     self.retry_command(checkpoint.parent / "step_N"))

    def close(self, timeout: Optional[float] = None) -> list[Path]:
        """Wait (bounded) for the queued uploads; what is left is named with its retry command and returned (a
        relaunch with --push_checkpoints uploads it)."""
        if timeout is None:
            timeout = float(os.environ.get("OPEN_SFT_HUB_CHECKPOINT_WAIT_S", 900))
        if self.pending():
            logger.info("waiting up to %.0fs for %d checkpoint upload(s)", timeout, len(self.pending()))
        self.queue.put(None)
        self.thread.join(timeout)
        left = sorted(self.pending(), key=lambda path: (len(path.name), path.name))  # step_10 after step_9
        for checkpoint in left:
            logger.warning("checkpoint %s was not uploaded within %.0fs; it is kept on disk, and a relaunch of the "
                           "same command (with --push_checkpoints) uploads it; or upload it now with:\n  %s",
                           checkpoint, timeout, self.retry_command(checkpoint))
        return left


def upload_pending(config: Any) -> None:
    """A relaunch stopped at a completed run (open_sft.training.completion.already_complete): the checkpoints its
    --push_checkpoints left (the end was stopped or killed while it waited for them: completion.UPLOADS_KEY), then
    the export if its --push_to_hub upload never succeeded (hub.upload_pending)."""
    from open_sft.training.completion import UPLOADS_KEY, note_uploads_left, read_marker

    output_dir = Path(config.train.output_dir)
    record = read_marker(output_dir)
    if config.hub.push_checkpoints and record is not None and record.get(UPLOADS_KEY):
        note_uploads_left(output_dir, not upload_left(output_dir, config))
    export_hub.upload_pending(config)


def upload_left(output_dir: Path, config: Any) -> bool:
    """A relaunch of a completed run (open_sft.training.completion.already_complete) whose end was stopped or killed
    while it waited for its checkpoint uploads: uploads the complete checkpoints not recorded as uploaded, then
    prunes (or, with --clean_checkpoints_at_end, removes) them as the run's end would have. True when each
    upload succeeded. Nothing un-uploaded is pruned here, even when the Hub refuses the token (unlike `kept`, which
    serves a training launch, whose new checkpoints would fill the disk): this launch writes none, and deleting one
    would lose the very checkpoint it exists to upload."""
    root, keep = output_dir / CHECKPOINTS, config.checkpoint.keep_last_n_checkpoints
    uploader = CheckpointUploader(config.hub)
    uploader.resubmit(root)
    done = not uploader.close() and not uploader.failed
    unpushed = uploader.unpushed(root)
    if config.checkpoint.clean_checkpoints_at_end and not unpushed:
        remove_all(output_dir)
    for path in prune(root, keep, unpushed):
        logger.info("deleted old checkpoint %s", path)
    return done


def end_of_run(checkpointer: Any, output_dir: Path, config: Any, noted: list[str], is_main: bool) -> None:
    """After the export and its RUN_COMPLETE (`noted`: the signals finish_first held during it): on the main process,
    the checkpoint uploads awaited (bounded), the checkpoints cleaned if asked (only once every one is uploaded: the
    uploads read them), the export pushed if asked. A stop noted during the export, or a SIGTERM or SIGUSR1 from
    here on, exits with the preemption's code instead of waiting (up to the 900 s wait and the push, past a
    scheduler's grace): the run is complete, and a relaunch of the same command does the uploads left without
    training (completion.UPLOADS_KEY, RUN_COMPLETE's "pushed")."""
    from open_sft.training.completion import note_uploads_left

    if not is_main:
        return
    if noted and checkpointer.uploader is not None:
        raise _stopped(noted[0], "after the last step", output_dir)
    try:
        done = checkpointer.finish_uploads()
    except Preempted as stop:
        raise _stopped(stop.signal_name, "while the checkpoint uploads were awaited", output_dir) from None
    note_uploads_left(output_dir, not done)
    if config.checkpoint.clean_checkpoints_at_end and done:
        remove_all(output_dir)
    elif config.checkpoint.clean_checkpoints_at_end:
        logger.warning("--clean_checkpoints_at_end: the checkpoints are kept until each is uploaded (a relaunch of "
                       "the same command uploads them, then deletes them)")
    if noted and config.hub.push_to_hub:
        raise _stopped(noted[0], "after the last step", output_dir)
    if config.hub.push_to_hub:
        export_hub.push_output_dir(output_dir, config.hub)


def _stopped(signal_name: str, when: str, output_dir: Path) -> Preempted:
    stop = Preempted(f"stopped by {signal_name} {when}; the run is complete (the export is in {output_dir}): the same "
                     "command uploads what is not on the Hub yet (checkpoints, the export), without training again")
    stop.signal_name = signal_name
    return stop
