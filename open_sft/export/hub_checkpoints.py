"""--push_checkpoints: upload each complete checkpoint to the Hub in the background.

The main process submits OUTPUT_DIR/checkpoints/step_N right after its COMPLETE marker is written; one
daemon thread uploads the submitted checkpoints in order, each as one commit to checkpoints/step_N/ on
the --hub_revision branch (so a checkpoint appears on the Hub whole, COMPLETE included, or not at all),
with push.py's retry/backoff policy. Training never waits for it and other ranks never see it.

Pruning and uploads: a checkpoint stays in `pending()` from submission until its upload ended, and
checkpoint.prune skips pending ones (they are deleted by a later prune, or by `close`). Nothing is
copied. Only the main thread submits and prunes, so a checkpoint that is not pending when pruning looks
at it is never read by the uploader again.

A failed upload logs a warning with the command that retries just that upload; training goes on.
`close` waits at most OPEN_SFT_HUB_CHECKPOINT_WAIT_S [900] seconds for the uploads still queued.
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

from open_sft.export.hub import describe, push_checkpoint, resolve_token, retry_command
from open_sft.redaction import scrub

logger = logging.getLogger(__name__)


class CheckpointUploader:
    """Background uploads of complete checkpoints (main process only). `hub`: the HubArguments."""

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
        self.thread = threading.Thread(target=self._work, name="open_sft-checkpoint-upload", daemon=True)
        self.thread.start()

    def submit(self, checkpoint: Path) -> None:
        with self.lock:
            self._pending.add(checkpoint)
        self.queue.put(checkpoint)

    def pending(self) -> frozenset[Path]:
        """Checkpoints queued or being uploaded: pruning must not delete these."""
        with self.lock:
            return frozenset(self._pending)

    def retry_command(self, checkpoint: Path) -> str:
        return retry_command(checkpoint, self.repo_id, self.revision, self.private)

    def _work(self) -> None:
        while (checkpoint := self.queue.get()) is not None:
            started = time.perf_counter()
            try:
                url = push_checkpoint(checkpoint, self.repo_id, self.revision, self.private, self.token)
                self.uploaded.append(checkpoint)
                logger.info("uploaded checkpoint %s to %s (%.1fs)", checkpoint.name, url,
                            time.perf_counter() - started)
            except Exception as exc:  # never fatal: the checkpoint is safe on disk
                self.failed.append(checkpoint)
                logger.warning("upload of checkpoint %s to %s failed: %s; training goes on. Retry it (token from "
                               "HF_TOKEN or --hub_token) while it is on disk with:\n  %s", checkpoint,
                               self.repo_id, scrub(describe(exc), self.token), self.retry_command(checkpoint))
            finally:
                with self.lock:
                    self._pending.discard(checkpoint)

    def close(self, timeout: Optional[float] = None) -> None:
        """Wait (bounded) for the queued uploads; what is left is named with its retry command."""
        if timeout is None:
            timeout = float(os.environ.get("OPEN_SFT_HUB_CHECKPOINT_WAIT_S", 900))
        if self.pending():
            logger.info("waiting up to %.0fs for %d checkpoint upload(s)", timeout, len(self.pending()))
        self.queue.put(None)
        self.thread.join(timeout)
        for checkpoint in sorted(self.pending()):
            logger.warning("checkpoint %s was not uploaded within %.0fs; retry it with:\n  %s", checkpoint,
                           timeout, self.retry_command(checkpoint))
