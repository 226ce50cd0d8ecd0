"""How a rank process ends (open_sft.errors.exit_rank), in real processes."""

from __future__ import annotations

import os
import subprocess
import sys


def test_a_launched_rank_exits_with_its_code_after_the_exit_handlers(tmp_path) -> None:
    """exit_rank: a launched rank that finished (WORLD_SIZE > 1, code 0) leaves without the interpreter's teardown
    after its exit handlers (a file written by one, a log line flushed); an error's code, or a process alone,
    leaves through sys.exit, with the same handlers and code."""
    script = ("import atexit, logging, pathlib, sys\n"
              "from open_sft.errors import exit_rank\n"
              "logging.basicConfig(stream=sys.stdout, level=logging.INFO)\n"
              f"atexit.register(lambda: pathlib.Path({str(tmp_path / 'ran')!r}).write_text('yes'))\n"
              "logging.getLogger('x').info('last line')\n"
              "exit_rank(int(sys.argv[1]))\n")
    for world, code in (("2", 0), ("2", 3), ("1", 0)):
        (tmp_path / "ran").unlink(missing_ok=True)
        result = subprocess.run([sys.executable, "-c", script, str(code)], capture_output=True, text=True, timeout=60,
                                env={**os.environ, "WORLD_SIZE": world})
        assert result.returncode == code and "last line" in result.stdout + result.stderr
        assert (tmp_path / "ran").read_text() == "yes"
