"""Unit tests run in this process: one that starts a training process, a script or a launcher belongs in
tests/integration/. (Libraries may still run small helpers, such as platform's `uname -p`.)"""

from __future__ import annotations

import os
import subprocess

import pytest

LAUNCHES = ("python", "accelerate", "torchrun", "deepspeed", "finetune.py", ".sh", "docker", "podman", "hadolint")


@pytest.fixture(autouse=True)
def no_launches(monkeypatch) -> None:
    start = subprocess.Popen.__init__

    def guarded(self, args, *rest, **kwargs):
        words = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
        if any(mark in os.path.basename(os.fsdecode(word)) for word in words[:3] for mark in LAUNCHES):
            raise AssertionError(f"a unit test launched {words[:3]}; move it to tests/integration/")
        start(self, args, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", guarded)
