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


def test_a_full_disk_once_the_checkpoint_is_renamed_names_the_step_dir_it_left(tmp_path, monkeypatch) -> None:
    """review ckpt 7a: a disk filling while COMPLETE was written (after step_N.tmp was renamed to step_N) was said to
    leave step_N.tmp, which no longer existed; the leftover is step_N without COMPLETE."""
    from open_sft.training import checkpoint

    def full(path, value, indent=1):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    checkpointer, root = _checkpointer(tmp_path, keep=2), tmp_path / "checkpoints"
    checkpointer.state_io = _Writes()
    _free(monkeypatch, 0)
    monkeypatch.setattr(checkpoint, "write_json", full)
    with pytest.raises(UserError) as info:
        checkpointer.save(2)
    assert str(info.value) == (f"{root}: the disk is full (0 bytes free): checkpoint step_2 could not be written (its "
                               "unfinished step_2, without COMPLETE, is never resumed from); free space there (fewer "
                               "--keep_last_n_checkpoints keeps less) and rerun the same command: it resumes from "
                               "step 0 (no complete checkpoint yet)")
    assert [p.name for p in root.iterdir()] == ["step_2"] and not (root / "step_2" / "COMPLETE").exists()


def test_other_failures_of_a_save_keep_their_traceback(tmp_path) -> None:
    checkpointer = _checkpointer(tmp_path, keep=2)

    class Broken:
        def save(self, directory: str) -> None:
            raise RuntimeError("a bug")

    checkpointer.state_io = Broken()
    with pytest.raises(RuntimeError, match="a bug"):
        checkpointer.save(2)


def _rust_full(quota: bool = False) -> Exception:
    """What safetensors' writer raises on a full disk (a SafetensorError, an Exception and no OSError: the errno
    is in its message only, as Rust prints an io::Error)."""
    from safetensors import SafetensorError

    reason = "Disk quota exceeded (os error 122)" if quota else "No space left on device (os error 28)"
    return SafetensorError(f"Error while serializing: I/O error: {reason}")


def _dcp_full() -> BaseException:
    """torch.distributed.checkpoint's save on a full disk (FSDP2): a CheckpointException, a BaseException holding
    each failed rank's exception with its traceback."""
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    try:
        raise OSError(errno.ENOSPC, "No space left on device")
    except OSError as exc:
        wrapped = _wrap_exception(exc)
    return CheckpointException("save failed", {1: wrapped})


def test_the_rust_writers_and_torch_distributed_checkpoints_full_disk_count(tmp_path, monkeypatch) -> None:
    """safetensors' SafetensorError, the tokenizers library's bare Exception (its save of tokenizer.json), a quota
    (os error 122) and a DCP CheckpointException were tracebacks (exit 1), not the full disk's error line."""
    _free(monkeypatch, 0)
    full = f"{tmp_path}: the disk is full (0 bytes free)"
    assert durable.out_of_space(_rust_full(), tmp_path) == full
    assert durable.out_of_space(Exception("No space left on device (os error 28)"), tmp_path) == full
    assert durable.out_of_space(_rust_full(quota=True), tmp_path) == \
        f"{tmp_path}: your disk quota there is used up (0 bytes free)"
    assert durable.out_of_space(_dcp_full(), tmp_path) == full
    assert durable.out_of_space(Exception("Permission denied (os error 13)"), tmp_path) is None


@pytest.mark.parametrize("failure", ["safetensors", "tokenizer", "dcp"])
def test_a_checkpoint_whose_weights_tokenizer_or_dcp_files_fill_the_disk_is_the_error_line(
        tmp_path, monkeypatch, failure) -> None:
    checkpointer = _checkpointer(tmp_path, keep=2)
    root = tmp_path / "checkpoints"
    raised = {"safetensors": _rust_full, "dcp": _dcp_full,
              "tokenizer": lambda: Exception("No space left on device (os error 28)")}[failure]

    class Fails:
        def save(self, directory: str) -> None:
            raise raised()

    def tokenizer_fails(directory: Path) -> None:
        raise raised()

    if failure == "tokenizer":  # the model/ files (tokenizer.save_pretrained) follow the weights
        checkpointer.model_files = tokenizer_fails
    else:
        checkpointer.state_io = Fails()
    _free(monkeypatch, 0)
    with pytest.raises(UserError) as info:
        checkpointer.save(2)
    assert str(info.value).startswith(f"{root}: the disk is full (0 bytes free): checkpoint step_2 could not be "
                                      "written")
    assert not (root / "step_2").exists()


def test_an_interrupt_during_a_save_on_a_full_disk_stays_an_interrupt(tmp_path, monkeypatch) -> None:
    checkpointer = _checkpointer(tmp_path, keep=2)

    class Interrupted:
        def save(self, directory: str) -> None:
            try:
                raise OSError(errno.ENOSPC, "No space left on device")
            except OSError:
                raise KeyboardInterrupt

    checkpointer.state_io = Interrupted()
    _free(monkeypatch, 0)
    with pytest.raises(KeyboardInterrupt):
        checkpointer.save(2)
