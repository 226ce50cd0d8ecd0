"""A full disk while a checkpoint is written is an error naming the path, that the disk is full, what is free and
where the rerun resumes; torch's zip writer's failure (a RuntimeError without the errno) is read so when the disk
has nothing free."""

from __future__ import annotations

import errno
import shutil
from collections import namedtuple
from pathlib import Path

import pytest

from open_sft import durable
from open_sft.errors import UserError

from .test_checkpoint import _checkpointer

Usage = namedtuple("Usage", "total used free")
TORCH_FULL = "[enforce fail at inline_container.cc:672] . unexpected pos 551680 vs 551572"


def _free(monkeypatch, free: int) -> None:
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(1 << 30, (1 << 30) - free, free))


def test_what_counts_as_a_full_disk(tmp_path, monkeypatch) -> None:
    _free(monkeypatch, 4096)
    assert durable.out_of_space(OSError(errno.ENOSPC, "No space left on device"), tmp_path) == \
        f"{tmp_path}: the disk is full (4.0 KiB free)"
    assert "quota" in durable.out_of_space(OSError(errno.EDQUOT, "Disk quota exceeded"), tmp_path)
    try:  # behind another exception (datasets and pyarrow wrap it)
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as inner:
            raise ValueError("write failed") from inner
    except ValueError as outer:
        assert durable.out_of_space(outer, tmp_path) is not None
    assert durable.out_of_space(RuntimeError(TORCH_FULL), tmp_path) is not None
    assert durable.out_of_space(OSError(errno.EACCES, "Permission denied"), tmp_path) is None
    assert durable.out_of_space(RuntimeError("CUDA out of memory"), tmp_path) is None
    _free(monkeypatch, 10 << 30)
    assert durable.out_of_space(RuntimeError(TORCH_FULL), tmp_path) is None  # room left: another failure


class _Writes:
    def save(self, directory: str) -> None:
        import torch
        from safetensors.torch import save_file

        save_file({"w": torch.zeros(4)}, str(Path(directory) / "model.safetensors"))


class _FullDisk:
    def save(self, directory: str) -> None:
        (Path(directory) / "model.safetensors").write_bytes(b"half")
        raise RuntimeError(TORCH_FULL)


def test_a_checkpoint_on_a_full_disk_says_so_and_where_the_rerun_resumes(tmp_path, monkeypatch) -> None:
    checkpointer = _checkpointer(tmp_path, keep=2)
    root = tmp_path / "checkpoints"
    checkpointer.state_io = _FullDisk()
    _free(monkeypatch, 0)
    with pytest.raises(UserError) as info:
        checkpointer.save(2)
    assert str(info.value) == (f"{root}: the disk is full (0 bytes free): checkpoint step_2 could not be written (its "
                               "unfinished step_2.tmp is never resumed from); free space there (fewer "
                               "--keep_last_n_checkpoints keeps less) and rerun the same command: it resumes from "
                               "step 0 (no complete checkpoint yet)")
    assert not (root / "step_2").exists()
    checkpointer.state_io = _Writes()
    checkpointer.save(2)
    checkpointer.state_io = _FullDisk()
    with pytest.raises(UserError, match=r"it resumes from the newest complete checkpoint, step_2 \(\d+ bytes: about "
                                        r"what one more needs\)"):
        checkpointer.save(4)
    assert not (root / "step_4").exists()


def test_other_failures_of_a_save_keep_their_traceback(tmp_path) -> None:
    checkpointer = _checkpointer(tmp_path, keep=2)

    class Broken:
        def save(self, directory: str) -> None:
            raise RuntimeError("a bug")

    checkpointer.state_io = Broken()
    with pytest.raises(RuntimeError, match="a bug"):
        checkpointer.save(2)
