"""How a rank process ends (open_sft.errors.exit_rank), in real processes."""

from __future__ import annotations

import os
import subprocess
import sys


def test_a_launched_rank_exits_with_its_code_after_the_exit_handlers(tmp_path) -> None:
    """exit_rank: under a launcher (WORLD_SIZE > 1) the exit handlers run (a file written by one, a log line
    flushed) and the code is the process's; alone, it is sys.exit."""
    script = ("import atexit, logging, pathlib, sys\n"
              "from open_sft.errors import exit_rank\n"
              "logging.basicConfig(stream=sys.stdout, level=logging.INFO)\n"
              f"atexit.register(lambda: pathlib.Path({str(tmp_path / 'ran')!r}).write_text('yes'))\n"
              "logging.getLogger('x').info('last line')\n"
              "exit_rank(3)\n")
    for world in ("2", "1"):
        (tmp_path / "ran").unlink(missing_ok=True)
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                                env={**os.environ, "WORLD_SIZE": world})
        assert result.returncode == 3 and "last line" in result.stdout + result.stderr
        assert (tmp_path / "ran").read_text() == "yes"
