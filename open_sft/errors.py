"""The one exception type for problems a user can fix (bad flag, file, row).

The entrypoint turns it into a clean message and exit code 2 instead of a traceback;
anything else is a bug and keeps its traceback.
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
