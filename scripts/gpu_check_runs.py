"""Moved to tests/gpu_check/runs.py: kept for `import gpu_check_runs` with scripts/ on the path (the suite's
contract test of `together` does that), with the repository root on the path too."""

from tests.gpu_check.runs import together

__all__ = ["together"]
