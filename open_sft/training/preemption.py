"""Graceful stop on SIGTERM, SIGINT and SIGUSR1 (SLURM's `--signal`): finish the optimizer step, save a
checkpoint, exit with PREEMPTED_EXIT_CODE.

A handler only sets a flag; the training loop all-reduces it after every optimizer step, so every rank
stops after the same step even when the signal reached only some of them.

Under `accelerate launch` (torchrun) the launcher also handles SIGTERM/SIGINT: it forwards the signal to
the workers, gives them 30 s, and then exits non-zero itself (its own exit code, not ours). Send the
signal to the workers too (e.g. the whole process group, or `srun --signal`) so the checkpoint is written
inside that grace period. It handles the signals of torchrun's --signals_to_handle, which `accelerate launch` does
not pass: PET_SIGNALS_TO_HANDLE's, else SIGTERM,SIGINT,SIGHUP,SIGQUIT (TORCHELASTIC_SIGNALS_TO_HANDLE is what it
writes from them, replaced if set by hand; open_sft sets and reads neither). A SIGUSR1 ends it; the ranks, signalled
too, finish their stop without it (open_sft.distributed.lifeline.note_stop).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from types import FrameType
from typing import Callable, Iterator, Optional

import torch

from open_sft.distributed import lifeline
from open_sft.errors import StopRun

logger = logging.getLogger(__name__)

#: Exit code of a process that stopped on a signal after saving its checkpoint (EX_TEMPFAIL: "try again").
PREEMPTED_EXIT_CODE = 75
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class Preempted(StopRun):
    """Raised after the preemption checkpoint is saved; `finetune.py` exits with PREEMPTED_EXIT_CODE."""

    exit_code = PREEMPTED_EXIT_CODE
    signal_name = "a signal"  # the one that stopped the run, where known


MARK = "_open_sft_signal_handler"  # on the handlers installed here, which a forked child puts back to the default


def _default_in_child() -> None:
    for sig in SIGNALS:
        if getattr(signal.getsignal(sig), MARK, False):
            signal.signal(sig, signal.SIG_DFL)


os.register_at_fork(after_in_child=_default_in_child)


def _in_owner(owner: int, signum: int) -> bool:
    """Whether a handler runs in the process that installed it. A process forked from it (the cache build's render
    workers) inherits the handler: there the signal takes its default action, as multiprocessing's Pool.terminate
    expects (the inherited handler raised in idle workers, which printed tracebacks or held a queue lock).
    _default_in_child puts the default back at the fork; this covers a signal that arrives before that hook."""
    if os.getpid() == owner:
        return True
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    return False


_unraised: list[Preempted] = []  # the stop outside the training loop, once its handler ran (see raise_unraised)


def raise_unraised() -> None:
    """Raise the stop whose handler ran but whose exception went nowhere. Python drops an exception raised where
    nothing can catch it, printing "Exception ignored": in the hooks around a fork (logging's lock release after
    it) a signal that arrived while the process forked runs its handler. A SIGTERM during the cache build, which
    forks its render workers for each chunk, was so dropped one time in three: the build went on, and under
    `accelerate launch` the rank was killed 30 s later. Called after such places: nothing when no stop came."""
    if _unraised:
        raise _unraised[0]


def stop_outside_training() -> Callable[[], None]:
    """SIGTERM and SIGUSR1 outside the training loop (loading data or the model, building the cache, the export),
    where there is no step to finish: the process stops at once with PREEMPTED_EXIT_CODE, a scheduler's "retry",
    and says what the same command does (they ended it with 143 and no word). StopRequest takes them over inside
    the loop and hands them back after it. Returns what puts the previous handlers back."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    owner = os.getpid()

    def handle(signum: int, frame: Optional[FrameType]) -> None:
        if not _in_owner(owner, signum):
            return
        stop = Preempted(f"stopped by {signal.Signals(signum).name} outside the training loop (loading, tokenizing "
                         "or exporting); the same command starts again from where it can: a cache build from its "
                         "last complete chunk, training from the newest complete checkpoint, then the export")
        stop.signal_name = signal.Signals(signum).name
        lifeline.note_stop(stop.signal_name)  # a launcher that the same signal ended does not end this rank first
        _unraised.append(stop)  # dropped where it is raised (a fork's hooks): raise_unraised raises it again
        raise stop

    setattr(handle, MARK, True)
    _unraised.clear()  # a stop of an earlier run in this process (open_sft called twice) is not this run's
    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGTERM, signal.SIGUSR1)}

    def restore() -> None:
        _unraised.clear()
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    return restore


@contextlib.contextmanager
def finish_first(what: str) -> Iterator[list[str]]:
    """SIGTERM and SIGUSR1 while `what` is written after the last step (the export, whose trained model is only in
    memory): noted, not raised; `what` is finished first, then a line says so. Stopping there promised a resume
    from a checkpoint the run may not have (without --checkpointing_steps its relaunch trained again from step 0);
    a checkpoint of the last step (weights, optimizer state) takes longer to write than the export. Yields the
    list of the signals noted (what comes after `what`, an upload, may then stop: hub_checkpoints.end_of_run)."""
    if threading.current_thread() is not threading.main_thread():
        yield []
        return
    noted: list[str] = []
    owner = os.getpid()

    def note(signum: int, frame: Optional[FrameType]) -> None:
        if _in_owner(owner, signum):
            noted.append(signal.Signals(signum).name)
            lifeline.note_stop(noted[-1])

    setattr(note, MARK, True)
    previous = {sig: signal.signal(sig, note) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        yield noted
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if noted:
        logger.warning("%s received after the last step: finished %s first (the trained model was only in memory), "
                       "so the run is complete", noted[0], what)


class StopRequest:
    """Set by a signal handler in this process; `agreed` makes all ranks see the same answer."""

    def __init__(self) -> None:
        self.signal_name: Optional[str] = None
        self._previous: dict[int, object] = {}
        self._owner = os.getpid()

    def install(self) -> "StopRequest":
        if threading.current_thread() is not threading.main_thread():
            logger.warning("not on the main thread: SIGTERM/SIGINT/SIGUSR1 will not stop training gracefully")
            return self
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        if _unraised and self.signal_name is None:  # a stop before the loop that Python dropped where it was raised
            self.signal_name = _unraised[0].signal_name  # (a weakref callback, a __del__): the first step stops
            logger.warning("%s came before training and was lost where it landed: the run stops after its first "
                           "step, with its checkpoint", self.signal_name)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        if not _in_owner(self._owner, signum):
            return
        if self.signal_name is None:  # only a flag: I/O inside a handler can hit a reentrant write
            self.signal_name = signal.Signals(signum).name
            lifeline.note_stop(self.signal_name)  # its checkpoint is written even if the signal ended the launcher

    setattr(_handle, MARK, True)

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def agreed(self, reduce_sum: Callable[[torch.Tensor], torch.Tensor]) -> bool:
        """True on every rank if any rank was signalled. Collective: call on every rank, every step."""
        flag = torch.tensor([1.0 if self.requested else 0.0], dtype=torch.float64)
        return bool(reduce_sum(flag)[0] > 0)
