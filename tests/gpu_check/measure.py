"""What the probes share: the device they measure on, timing, relative error, their sizes (CPU-sized in the smoke
run), and the figures they hand to the GPU check's report.

A probe is a pytest file (test_fused_ce.py, test_packed.py, test_attention.py): a module fixture measures, hands
its figures on (`record`), and the tests hold them to their tolerances. The GPU check runs each file in a pytest
process of its own, with context.py's FIGURES, SMOKE and MODEL set; the suite runs them as they are (CPU-sized
without CUDA).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable

import torch

from tests.gpu_check.context import FIGURES, SMOKE

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def smoke() -> bool:
    return os.environ.get(SMOKE, "0" if DEVICE == "cuda" else "1") == "1"


def record(figures: dict) -> dict:
    """The probe's figures, written where the GPU check reads them (before the tests hold them to anything, so
    a probe that fails is reported with what it measured)."""
    if os.environ.get(FIGURES):
        Path(os.environ[FIGURES]).write_text(json.dumps(figures))
    return figures


def short(tolerance: float) -> str:
    """A tolerance as the report writes it: 1e-5, 4e-3."""
    return f"{tolerance:.0e}".replace("e-0", "e-")


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], repeat: int) -> float:
    """Median seconds of `repeat` calls after one warm-up."""
    fn()
    times = []
    for _ in range(repeat):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))
