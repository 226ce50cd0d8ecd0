"""The exceptions the entrypoint turns into a message and an exit code instead of a traceback.

    exit 2   UserError (and ConfigError, every problem of a configuration at once): input the user can fix
             (a flag, a file, a row); the message names it and the fix
    exit 3   open_sft.export.hub.PushFailed (a StopRun): the Hub upload failed, the local export is intact
    exit 75  open_sft.training.preemption.Preempted (a StopRun): stopped on a signal, checkpoint saved;
             relaunching resumes (75 is EX_TEMPFAIL, which schedulers read as "retry")
Anything else is a bug and keeps its traceback.
"""


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
