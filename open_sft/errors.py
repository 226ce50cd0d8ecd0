"""The exceptions the entrypoint turns into a message and an exit code instead of a traceback.

    exit 2   UserError (and ConfigError, every problem of a configuration at once): input the user can fix
             (a flag, a file, a row); the message names it and the fix
    exit 3   open_sft.export.hub.PushFailed (a StopRun): the Hub upload failed, the local export is intact
    exit 4   open_sft.distributed.lifeline: the launcher or a peer rank is gone; no checkpoint written
    exit 75  open_sft.training.preemption.Preempted (a StopRun): stopped on a signal, checkpoint saved;
             relaunching resumes (75 is EX_TEMPFAIL, which schedulers read as "retry")
Anything else is a bug and keeps its traceback.

`accelerate launch` (torchrun) exits 1 whatever its workers' codes were. A launcher that wants them (scripts/
launch_multinode.sh, and so the container) sets OPEN_SFT_EXIT_CODE_DIR: each rank leaves its code there.
"""

import os
from pathlib import Path

EXIT_CODE_DIR_ENV = "OPEN_SFT_EXIT_CODE_DIR"


def record_exit_code(code: int) -> int:
    """Leave this rank's exit code where the launcher looks (when it asked for it); returns the code."""
    directory = os.environ.get(EXIT_CODE_DIR_ENV)
    if directory:
        try:
            (Path(directory) / f"rank{os.environ.get('RANK', '0')}").write_text(f"{code}\n")
        except OSError:  # the launcher's directory is gone: it exits with torchrun's code then
            pass
    return code


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
