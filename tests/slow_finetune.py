"""finetune.py, each micro-batch's forward after the first SLOW_AFTER_CALLS [0] slept for SLOW_FORWARD_S [0]
seconds: what the interrupting tests launch (tests/integration/test_checkpoint.py `interrupt`), so that a signal
or a kill sent after step N lands before the run's last step. A tiny model's remaining steps can take less
time than the signal's way in on a busy machine (seen in CI: all 12 steps done before a SIGTERM sent after step
6). Nothing numeric changes: the sleep is outside the computation."""

import os
import time

from open_sft import run
from open_sft.distributed import pipeline
from open_sft.errors import exit_rank, record_exit_code
from open_sft.model import loss

SLEEP_S = float(os.environ.get("SLOW_FORWARD_S", "0"))
AFTER = int(os.environ.get("SLOW_AFTER_CALLS", "0"))
calls = [0]


def slowed(forward):
    """`forward`, each call after the first AFTER slept SLEEP_S first."""
    def slow(*args, **kwargs):
        calls[0] += 1
        if calls[0] > AFTER:
            time.sleep(SLEEP_S)
        return forward(*args, **kwargs)
    return slow


loss.TokenLossModel.forward = slowed(loss.TokenLossModel.forward)
pipeline.StageModule.forward = slowed(pipeline.StageModule.forward)  # under --pipeline_parallel_size
exit_rank(record_exit_code(run.main()))
