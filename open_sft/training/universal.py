"""A DeepSpeed ZeRO checkpoint resumed on another number of ranks, through DeepSpeed's universal checkpoint.

Each rank's ZeRO file holds its slice of the flat fp32 master weights and optimizer moments, cut for the
checkpoint's number of ranks, so it loads only on that number. DeepSpeed's `ds_to_universal` rewrites the
slices as one whole tensor per parameter and state (zero/<name>/fp32.pt, exp_avg.pt, ...), and its engine,
told to load the universal format, cuts them again for the ranks it has. The conversion goes to a scratch
directory beside the checkpoint (step_N.universal.tmp: a crash leaves it where the next start deletes partial
checkpoints); the checkpoint itself is left as it was written, and the scratch is removed once loaded.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import shutil
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

TAG = "pytorch_model"  # the folder accelerate's save_state gives the (only) DeepSpeed engine's files
# The module's states: ZeRO-1/2 write one file (the whole module), ZeRO-3 one per rank (partitioned weights); the
# universal load reads rank 0's of its own stage.
MODEL_STATES, PARTITIONED_MODEL_STATES = "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"


def partitioned(checkpoint: Path) -> bool:
    """Whether a ZeRO checkpoint (step_N, or a universal folder) was written by ZeRO-3."""
    return (checkpoint / TAG / PARTITIONED_MODEL_STATES).is_file()


def convert(checkpoint: Path, target: Path) -> None:
    """`checkpoint` (a step_N written by accelerate's save_state under ZeRO) in the universal format under
    `target`, with the per-rank random states beside it, as accelerate's load_state reads a directory."""
    from deepspeed.checkpoint import ds_to_universal

    shutil.rmtree(target, ignore_errors=True)
    # inject_missing_state: the engine records universal_checkpoint_info only for Megatron-style clients; the
    # injected default (no tensor or pipeline parallelism) is ours
    args = argparse.Namespace(input_folder=str(checkpoint / TAG), output_folder=str(target / TAG),
                              num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                              inject_missing_state=True)
    with contextlib.redirect_stdout(io.StringIO()):  # its progress bars and prints, once per parameter
        ds_to_universal.main(args)
    for rng in checkpoint.glob("random_states_*.pkl"):
        shutil.copy2(rng, target / rng.name)


class UniversalResume:
    """What the Checkpointer saves and loads with (see Checkpointer's `state_io`) when it resumes a ZeRO checkpoint
    of another number of ranks: saves as accelerate does; loads the checkpoint converted by the main process."""

    def __init__(self, accelerator: Any, engine: Any, saved_world: int):
        self.accelerator, self.engine, self.saved_world = accelerator, engine, saved_world

    def save(self, directory: str) -> None:
        self.accelerator.save_state(directory)

    def load(self, directory: str) -> None:
        acc, checkpoint = self.accelerator, Path(directory)
        scratch = checkpoint.with_name(checkpoint.name + ".universal.tmp")
        if acc.is_main_process:
            convert(checkpoint, scratch)
            logger.info("converted the %d-rank ZeRO checkpoint %s to DeepSpeed's universal format, to load on %d "
                        "rank(s)", self.saved_world, checkpoint, acc.num_processes)
        acc.wait_for_everyone()
        load_universal(acc, self.engine, scratch)
        acc.wait_for_everyone()
        if acc.is_main_process:
            shutil.rmtree(scratch, ignore_errors=True)


def load_universal(accelerator: Any, engine: Any, folder: Path) -> None:
    """Collective: accelerate's load_state of `folder`, a checkpoint in DeepSpeed's universal format (the RNG states
    beside it). DeepSpeed reads the choice of format when it loads, not when it starts: the engine's own record of
    it is set for this load only (the run's later checkpoints are ordinary ZeRO ones, for its own number of ranks)."""
    config = engine._config
    config.load_universal_checkpoint = True
    try:
        accelerator.load_state(str(folder))
    finally:
        config.load_universal_checkpoint = False
    _unshare_steps(engine.optimizer)


def _unshare_steps(optimizer: Any) -> None:
    """ZeRO-3's universal load (DeepSpeed 0.19) gives every parameter group's Adam state one and the same step
    tensor, which torch's Adam then advances once per group and step: a second group's bias correction runs a
    step ahead, then both drift (measured: every weight 6e-5 off the uninterrupted run two steps on, the norms, in
    the second group, 2.7e-4). Each state gets its own copy."""
    inner = getattr(optimizer, "optimizer", optimizer)  # the torch optimizer inside DeepSpeed's ZeRO optimizer
    for state in inner.state.values():
        if isinstance(state.get("step"), torch.Tensor):
            state["step"] = state["step"].clone()
