"""The exceptions the entrypoint turns into a message and an exit code instead of a traceback.

    exit 2   UserError (and ConfigError, every problem of a configuration at once): input the user can fix
             (a flag, a file, a row); the message names it and the fix
    exit 3   open_sft.export.hub.PushFailed (a StopRun): the Hub upload failed, the local export is intact
    exit 4   open_sft.distributed.lifeline: the launcher or a peer rank is gone; no checkpoint written
    exit 75  open_sft.training.preemption.Preempted (a StopRun): stopped on a signal, checkpoint saved;
             relaunching resumes (75 is EX_TEMPFAIL, which schedulers read as "retry")
Anything else is a bug and keeps its traceback.

`accelerate launch` (torchrun) exits 1 whatever its workers' codes were. A launcher that wants them (scripts/
launch_multinode.sh, and so the container) sets OPEN_SFT_EXIT_CODE_DIR: each rank leaves its code there, and its
closing message beside it (`rankR.message`), which the script prints after torchrun's summary, last.

Under torchrun (and so `accelerate launch`) the launcher prints, last, a summary of the failed ranks whose "Root
Cause" is read from each rank's error file (TORCHELASTIC_ERROR_FILE, torch elastic's mechanism): every rank that
stops with one of the codes above writes its one-line message there (`report_to_launcher`), so the summary names
it instead of "To enable traceback see ...", with the rank's exit code beside it; a bug keeps its traceback there
(`torch.distributed.elastic.multiprocessing.errors.record` on the entrypoint).
"""

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Callable, Optional

EXIT_CODE_DIR_ENV = "OPEN_SFT_EXIT_CODE_DIR"
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"


def record_exit_code(code: Optional[int]) -> int:
    """Leave this rank's exit code where the launcher looks (when it asked for it); returns the code (None, as
    torch elastic's `record` returns for `--help`'s exit 0, is 0)."""
    code = code or 0
    _leave_for_launch_script("", f"{code}\n")
    return code


def _leave_for_launch_script(suffix: str, text: str) -> None:
    """`text` as this rank's file in OPEN_SFT_EXIT_CODE_DIR (`rankR` + suffix); nothing when no launcher asked."""
    directory = os.environ.get(EXIT_CODE_DIR_ENV)
    if directory:
        try:
            (Path(directory) / f"rank{os.environ.get('RANK', '0')}{suffix}").write_text(text)
        except OSError:  # the launcher's directory is gone: it exits with torchrun's code and output then
            pass


def exit_rank(code: int) -> None:
    """Ends the process with `code`. A rank started by a launcher (WORLD_SIZE > 1) that finished (code 0) runs
    Python's exit handlers (logging's flush among them) and then leaves without tearing the interpreter down: at
    that teardown a thread of the collectives' C++ libraries was sometimes destroyed while still joinable
    ('terminate called without an active exception', SIGABRT) after the run had finished and written everything,
    and the launcher then reported the finished run as failed (seen under ZeRO-3 and FSDP2 on gloo). A rank that
    stops on an error leaves as before (sys.exit): a faster exit there would let the launcher stop the main
    process before it printed the error. Any other process: sys.exit."""
    if code != 0 or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        sys.exit(code)
    import atexit

    atexit._run_exitfuncs()  # what sys.exit would run; the interpreter's own teardown is what is skipped
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def report_to_launcher(message: str) -> None:
    """This rank's closing message as its torch elastic error file, in the layout the launcher's summary reads (it
    shows `py_callstack`), and beside its exit code for a launch script; nothing without a launcher that asked."""
    _leave_for_launch_script(".message", f"{message}\n")
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return
    record = {"message": {"message": message, "extraInfo": {"py_callstack": message,
                                                            "timestamp": str(int(time.time()))}}}
    try:
        Path(path).write_text(json.dumps(record))
    except OSError:  # the launcher's directory is gone: its summary says what it can
        pass


class UserError(Exception):
    """A problem with the user's input. The message names the input and the fix."""


class ConfigError(UserError):
    """One or more invalid settings; the message lists every problem found."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"invalid configuration ({len(problems)} problem(s)):\n{lines}")


class StopRun(Exception):
    """Not a failure of the user's input: the run stopped on purpose or an external service failed
    (preemption, Hub upload). The entrypoint prints the message and exits with `exit_code`."""

    exit_code = 1


def stop_while_starting() -> Callable[[], None]:
    """SIGTERM and SIGUSR1 while the entrypoint imports (torch, transformers, DeepSpeed: seconds), before `main`
    installs its own handlers (open_sft.training.preemption): exit 75 with a line, as outside the training loop,
    not 143 and no word. Torch-free. Returns what puts the previous handlers back."""
    def handle(signum: int, frame: object) -> None:
        message = (f"open_sft: stopped by {signal.Signals(signum).name} while starting (importing); nothing was "
                   "written: the same command starts the run again")
        if os.environ.get("RANK", "0") == "0":
            print(message, file=sys.stderr, flush=True)
        report_to_launcher(message)
        raise SystemExit(record_exit_code(75))

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGTERM, signal.SIGUSR1)}

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    return restore
