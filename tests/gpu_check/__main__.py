"""`python -m tests.gpu_check OUT_DIR ...` from the repository root: the GPU check (scripts/gpu_check.py's command)."""

import sys

from tests.gpu_check.cli import main

sys.exit(main())
