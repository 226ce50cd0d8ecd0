#!/usr/bin/env python
"""The GPU check's command (`python scripts/gpu_check.py --help` says what it checks): the runner is the package
tests/gpu_check, and this is `python -m tests.gpu_check` run from the repository root, whatever the working
directory, so the check imports tests/gpu_check and open_sft from this checkout, installed or not.

    python scripts/gpu_check.py OUT_DIR --data alpaca.json --tokenizer tokenizer.json   # on a GPU node
    python scripts/gpu_check.py OUT_DIR --smoke                                         # CPU: the suite's run
"""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

if __name__ == "__main__":  # Python puts scripts/ on the path, not the root: run the package as `-m` does there
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    os.execve(sys.executable, [sys.executable, "-m", "tests.gpu_check", *sys.argv[1:]],
              {**os.environ, "PYTHONPATH": path})

from tests.gpu_check.cli import PARTS, main  # noqa: E402  (imported: the suite, with the root on its path)

__all__ = ["PARTS", "main"]
