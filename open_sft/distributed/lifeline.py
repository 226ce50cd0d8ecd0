"""A rank lives only while its launcher and its peers do.

torch's elastic agent (`accelerate launch`, torchrun) starts each worker in a session of its own, so when the
launcher is killed (OOM killer, kill -9, a dying login shell) nothing tells the workers: they train on, or hang
in a collective whose peer is gone, holding the memory the relaunch needs, while the relaunch trains beside them.

Here each rank started by a launcher
- asks the kernel for a signal when its parent dies (Linux `prctl(PR_SET_PDEATHSIG)`), and
- runs a watchdog thread that every POLL_S seconds checks that its parent is still the one it started under
  (it covers a parent that is not the direct launcher, and systems without prctl), and — while the run's
  collectives are under way — that the other ranks on its host are alive (a peer SIGKILLed mid-step would
  otherwise leave this rank waiting in a collective until the process-group timeout, --timeout).

On either it prints why and exits with LOST_EXIT_CODE (STOP_GRACE_S or GRACE_S after it first noticed), from the
watchdog thread (`os._exit`: the main thread may be blocked inside a collective, where no Python runs) and without
writing a checkpoint: its state may be torn between two steps; the line says where the same command starts again
(under --resume_from_checkpoint auto the step of the last complete checkpoint: `resume_from`). Peers on other hosts are
bounded by the process-group timeout (--timeout), after which the failed collective is reported the same way.

finetune.py installs it in its first lines, before anything imports torch (seconds): a launcher killed while its
ranks still import would otherwise leave them adopted before they record their parent, watching the adopter. A
launcher that is gone before a rank starts watching (whatever its pid was) is noticed too: the rank's parent is
then already init (pid 1) or a known adopter (a "child subreaper": systemd --user, tini, ...; the kernel keeps no
record of the original parent), and the rank stops at once the same way.

A rank carrying out a stop on a signal (note_stop: SIGTERM, SIGINT, SIGUSR1) outlives its launcher: it writes the
stop's checkpoint and exits 75 (its peers still watched). SLURM's `--signal=USR1@N` reaches every process of the job
step, and torchrun, which does not handle SIGUSR1, dies of it: the ranks stopped without a checkpoint (exit 4).

A process started by hand (`python finetune.py`, also under nohup) follows nobody: its parent is a shell.
OPEN_SFT_FOLLOW_LAUNCHER=0 turns the parent check off (=1 turns it on without a launcher).
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

#: Exit code of a rank that stopped because its launcher or a peer rank is gone (no checkpoint written).
LOST_EXIT_CODE = 4
POLL_S = 0.5
# A peer's exit is acted on only if it is still unexplained this long after: ranks that stop together (the same
# error on each, a preemption) leave one after another, and each stops watching as it starts to leave.
GRACE_S = 2.0
# A launcher found gone is acted on this long after, unless a stop signal came meanwhile (note_stop): one sent to every
# process (pkill, a job manager) ends torchrun, and may reach a rank just after its launcher's end. Short: the rank
# trains on meanwhile while its main thread is not in Python (the watchdog's wait).
STOP_GRACE_S = 0.5
PR_SET_PDEATHSIG = 1
#: Programs that adopt orphans (child subreapers, inits): a launched rank whose parent runs one lost its launcher.
ADOPTERS = ("systemd", "init", "tini", "dumb-init", "docker-init", "catatonit")


def parent_death_signal(signum: int) -> bool:
    """Ask Linux to send `signum` to this process when the thread that started it ends (prctl PR_SET_PDEATHSIG);
    False where it cannot (another OS, no libc)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


LAUNCHER_ENV = ("TORCHELASTIC_RUN_ID", "ACCELERATE_MIXED_PRECISION", "LOCAL_RANK")


def started_by_launcher(env=os.environ) -> bool:
    choice = env.get("OPEN_SFT_FOLLOW_LAUNCHER")
    if choice in ("0", "1"):
        return choice == "1"
    return any(name in env for name in LAUNCHER_ENV)


def process_start(pid: int) -> Optional[str]:
    """The process's start time (field 22 of /proc/PID/stat), or None when it is gone or a zombie: a pid reused
    by another process, or one that exited and waits to be reaped, is not the peer."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def adopted(parent: int) -> Optional[str]:
    """Who adopted this process, when `parent` (its parent now) cannot be the launcher that started it: init
    (pid 1) or a process running one of ADOPTERS."""
    if parent == 1:
        return "init (pid 1)"
    try:
        with open(f"/proc/{parent}/comm") as handle:
            name = handle.read().strip()
    except OSError:
        return None
    return f"{name} (pid {parent})" if name in ADOPTERS else None


class Lifeline:
    """The watchdog of this rank (one per process: `install()`)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.parent = os.getppid()
        self.host = socket.gethostname()
        self.peers: dict[int, tuple[int, str]] = {}  # rank -> (pid, start time), ranks on this host only
        self.follow = started_by_launcher()
        self.stopping: Optional[str] = None  # the signal whose stop this rank carries out (note_stop)
        self.output_dir: Optional[Path] = None  # the run's, once known (resume_from): the lost line says where the
        self.resume_setting = "auto"  # relaunch starts, by the effective --resume_from_checkpoint and `_point`
        self._point: Optional[Callable[[str, Path], Optional[Path]]] = None
        self._said_stopping = False
        self._wake = threading.Event()
        self._lock = threading.Lock()

    def start(self) -> "Lifeline":
        if self.follow:
            self._ask_kernel()
            self._parent_died()  # it may have died before we asked
            adopter = adopted(self.parent)
            if adopter is not None:  # it died before this rank started watching: whatever its pid was
                self.exit_lost(f"its launcher is gone: this rank was adopted by {adopter} before it started watching")
        threading.Thread(target=self._watch, name="open_sft-lifeline", daemon=True).start()
        return self

    def _ask_kernel(self) -> None:
        """SIGUSR2 when the parent dies; its handler (_parent_signal) exits as the watchdog would (when the main
        thread is in Python; inside a collective the watchdog thread does it)."""
        if threading.current_thread() is not threading.main_thread() or not parent_death_signal(signal.SIGUSR2):
            return
        signal.signal(signal.SIGUSR2, self._parent_signal)

    def _parent_signal(self, *signal_args: object) -> None:
        """The launcher died: a stop signal sent with its end may land just after (a SIGUSR1 to every process ends
        torchrun): waited for STOP_GRACE_S here, in the main thread, so the run does not go on meanwhile (a signal
        interrupts the sleep and its handler runs); then the rank exits, unless it is stopping."""
        if self.stopping is None:
            time.sleep(STOP_GRACE_S)
        if self.stopping is None:
            self._parent_died()
        self._wake.set()  # the watchdog says, once, that the rank finishes its stop

    def _parent_gone(self) -> Optional[str]:
        # the kernel also signals when the *thread* that started this process exits: only a new parent counts
        return f"its launcher (pid {self.parent}) is gone" if self.follow and os.getppid() != self.parent else None

    def _parent_died(self, *signal_args: object) -> None:
        why = self._parent_gone()
        if why is not None:
            self.exit_lost(why)

    def watch_peers(self, table: list[tuple[str, int, Optional[str]]]) -> None:
        """`table[r]` = (host, pid, start time) of rank r (all-gathered once the process group is up): from now
        on a peer on this host that disappears stops this rank."""
        with self._lock:
            self.peers = {r: (pid, start) for r, (host, pid, start) in enumerate(table)
                          if r != self.rank and host == self.host and start is not None}

    def release_peers(self) -> None:
        """The run's collectives are over: a peer may finish and exit before this rank."""
        with self._lock:
            self.peers = {}

    def note_stop(self, signal_name: str) -> None:
        """This rank stops on `signal_name` (after the step, with a checkpoint): its launcher's end no longer ends it.
        Safe in a signal handler (a flag)."""
        if self.stopping is None:
            self.stopping = signal_name

    def gone(self) -> Optional[str]:
        """What is gone, if anything: the launcher (unless this rank is stopping on a signal), or peers on this
        host."""
        parent = self._parent_gone()
        if parent is not None and self.stopping is None:
            return parent
        if parent is not None and not self._said_stopping:
            self._said_stopping = True
            os.write(2, f"open_sft: rank {self.rank}: {parent} (torchrun ends on a SIGUSR1, which it does not handle); "
                        f"this rank got {self.stopping} and finishes its stop: a checkpoint after the current step, "
                        f"then exit 75\n".encode())
        with self._lock:
            lost = [f"rank {r} (pid {pid} on {self.host})" for r, (pid, start) in sorted(self.peers.items())
                    if process_start(pid) != start]
        if lost:
            return " and ".join(lost) + (" is" if len(lost) == 1 else " are") + " gone"
        return None

    def _watch(self) -> None:
        while True:
            self._wake.wait(POLL_S)
            self._wake.clear()
            if self.gone() is not None:
                time.sleep(STOP_GRACE_S if self._parent_gone() is not None else GRACE_S)
                why = self.gone()
                if why is not None:
                    self.exit_lost(why)

    def lost_message(self, why: str) -> str:
        return (f"error: rank {self.rank}: {why}; stopping this rank without writing a checkpoint (exit "
                f"{LOST_EXIT_CODE}). {self._relaunch()}\n")

    def _relaunch(self) -> str:
        """What the same command does when relaunched, by the run's --resume_from_checkpoint (the surviving ranks'
        line said only "the last complete checkpoint", where the launcher's summary says nothing of it)."""
        if self.output_dir is None or self._point is None:
            return ("Relaunch the same command: under --resume_from_checkpoint auto (the default) it resumes from the "
                    "last complete checkpoint in --output_dir")
        if self.resume_setting == "none":
            return ("A relaunch of the same command starts over from step 0 (--resume_from_checkpoint none or "
                    "--overwrite_output_dir); to resume from the last complete checkpoint instead, relaunch with "
                    "--resume_from_checkpoint auto and without --overwrite_output_dir")
        root, auto = self.output_dir / "checkpoints", self.resume_setting == "auto"
        try:
            point = self._point(self.resume_setting, self.output_dir)
        except Exception:  # this rank is exiting: a checkpoint that does not read must not keep it alive
            where = f"the last complete checkpoint in {root}" if auto else self.resume_setting
            return f"Relaunch the same command: it resumes from {where}"
        if not auto:  # a named checkpoint, or this run's newest continuation of it
            return f"Relaunch the same command: it resumes from {point}"
        if point is None:
            return f"Relaunch the same command: it resumes from step 0 (no complete checkpoint in {root} yet)"
        return f"Relaunch the same command: it resumes from step {point.name[5:]} ({point})"

    def exit_lost(self, why: str) -> None:
        message = self.lost_message(why)
        try:
            os.write(2, message.encode())
        finally:
            from open_sft.errors import record_exit_code, report_to_launcher

            report_to_launcher(message.strip())
            os._exit(record_exit_code(LOST_EXIT_CODE))


_installed: Optional[Lifeline] = None


def install() -> Lifeline:
    """This process's lifeline, started on the first call."""
    global _installed
    if _installed is None:
        _installed = Lifeline(int(os.environ.get("RANK", "0"))).start()
    return _installed


def release() -> None:
    """This rank's collectives are over (the run ended, or it is leaving on an error): peers may exit first."""
    if _installed is not None:
        _installed.release_peers()


#: What gloo's errors say when a peer's connection ended (a plain RuntimeError from gloo/transport/tcp/pair.cc,
#: measured on torch 2.13: "Read error [127.0.0.1]:P: Connection reset by peer"; also "Connection closed by peer").
CONNECTION_LOST = ("gloo/transport", "closed by peer", "reset by peer", "socket closed", "broken pipe")


def lost_connection(exc: BaseException) -> bool:
    """Whether `exc` (or what it was raised from) is a collective or rendezvous that failed with a peer's connection:
    torch.distributed's own errors (DistBackendError: NCCL's; DistNetworkError, DistStoreError) or gloo's
    RuntimeError. Read without importing torch (this module loads before it)."""
    dist = sys.modules.get("torch.distributed")
    own = getattr(dist, "DistError", None) if dist is not None else None
    error: Optional[BaseException] = exc
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if own is not None and isinstance(error, own):
            return True
        if isinstance(error, RuntimeError) and any(text in str(error).lower() for text in CONNECTION_LOST):
            return True
        error = error.__cause__ or error.__context__
    return False


def explain_failure(exc: BaseException) -> None:
    """An exception is leaving this rank: if its launcher or a peer on its host is gone (a failed collective),
    exit with that message instead of a traceback; else stop watching the peers and let it propagate. After a
    failed collective (`lost_connection`) a peer is asked after for GRACE_S: one that stops (a signal outside the
    training loop, an error of its own) closes its connections as it exits, and the collective here failed while it
    still lived (a gloo traceback, "Connection closed by peer", was printed instead of the line). Any other error is
    checked once: its traceback is the news, and waiting would only delay it (and could end it on a peer that exits
    meanwhile, for reasons of its own)."""
    why = gone()
    deadline = time.monotonic() + (GRACE_S if lost_connection(exc) else 0.0)
    while why is None and _installed is not None and _installed.peers and time.monotonic() < deadline:
        time.sleep(POLL_S / 5)
        why = gone()
    if why is not None:
        _installed.exit_lost(why)
    release()


def resume_from(output_dir: Path, setting: str, point: Callable[[str, Path], Optional[Path]]) -> None:
    """The run's output directory, its --resume_from_checkpoint as applied (`none` under --overwrite_output_dir) and
    the function that finds the checkpoint a relaunch resumes from (training.resume.relaunch_point: resume's own
    reading, problem_with's checks of damage and format included): a rank that loses its run says where the same
    command starts again. Passed in, not imported: this module loads before torch, and the checkpoint modules import
    torch and this one (an import circle)."""
    if _installed is not None:
        _installed.output_dir, _installed.resume_setting, _installed._point = Path(output_dir), setting, point


def note_stop(signal_name: str) -> None:
    """This rank stops on a signal, with a checkpoint: it outlives its launcher until then (Lifeline.note_stop)."""
    if _installed is not None:
        _installed.note_stop(signal_name)


def gone() -> Optional[str]:
    """Why this rank has lost its run (launcher or a peer on this host gone), if it has."""
    return _installed.gone() if _installed is not None else None


def watch_ranks() -> None:
    """Once the process group is up: every rank's (host, pid, start time), to notice a peer that disappears.
    Collective."""
    import torch.distributed as dist

    if _installed is None or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    table: list = [None] * dist.get_world_size()
    dist.all_gather_object(table, peer_entry())
    _installed.watch_peers(table)


def peer_entry() -> tuple[str, int, Optional[str]]:
    """This rank's row of the table `watch_peers` takes."""
    return socket.gethostname(), os.getpid(), process_start(os.getpid())
