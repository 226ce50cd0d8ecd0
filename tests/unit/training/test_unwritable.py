"""A disk that refuses a write mid-run or at the start (full, or a mount gone read-only) at the run's other
writes: metrics.jsonl's append, a checkpoint's step_N.tmp, the output dir's lock. Each was a traceback (exit 1);
each is one error naming the path, what is wrong and the fix (hunt C F6, F7)."""

from __future__ import annotations

import errno
import pathlib
import shutil
from collections import namedtuple

import pytest

from open_sft.errors import UserError

from .test_checkpoint import _checkpointer

Usage = namedtuple("Usage", "total used free")


def _refuse(monkeypatch, target: pathlib.Path, code: int) -> None:
    """Opening `target` fails as the system fails it (the file named, as open() names it)."""
    real = pathlib.Path.open

    def refused(self, *args, **kwargs):
        if self == target:
            raise OSError(code, errno.errorcode[code], str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "open", refused)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(1 << 30, 1 << 30, 0))


@pytest.mark.parametrize("code", [errno.EROFS, errno.ENOSPC])
def test_a_metrics_append_the_disk_refuses_is_the_error_line(tmp_path, monkeypatch, code) -> None:
    from open_sft.monitor.metrics import MetricsWriter

    path = tmp_path / "metrics.jsonl"
    _refuse(monkeypatch, path, code)
    with pytest.raises(UserError) as info:
        MetricsWriter(path).write({"step": 9, "loss": 1.0})
    reason, fix = ((f"{path}: the file system is read-only", "remount it read-write (or move the run's files)")
                   if code == errno.EROFS else (f"{path}: the disk is full (0 bytes free)", "free space there"))
    assert str(info.value) == (f"{reason}: the metrics of step 9 could not be appended to {path}; {fix} and rerun "
                               "the same command: it resumes from the newest complete checkpoint (or step 0), "
                               "dropping the lines logged after it")


def test_a_metrics_line_the_disk_filled_within_is_dropped(tmp_path, monkeypatch) -> None:
    """The disk fills within a line: the kernel wrote its first bytes, then ENOSPC. The torn line is cut off, so the
    file stays JSON Lines for every reader (it kept `{"step": 9, "lo` until a resume rewrote the file)."""
    from open_sft.monitor.metrics import MetricsWriter
    from open_sft.monitor.report import read_records

    path = tmp_path / "metrics.jsonl"
    MetricsWriter(path).write({"step": 8, "loss": 2.0})
    before = path.read_bytes()
    real = pathlib.Path.open

    def filling(self, *args, **kwargs):
        handle = real(self, *args, **kwargs)
        if self != path:
            return handle

        class Full:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                handle.close()

            def write(self, text: str) -> None:
                handle.write(text[:12])
                handle.flush()
                raise OSError(errno.ENOSPC, "No space left on device", str(path))

        return Full()

    monkeypatch.setattr(pathlib.Path, "open", filling)
    monkeypatch.setattr(shutil, "disk_usage", lambda where: Usage(1 << 30, 1 << 30, 0))
    with pytest.raises(UserError, match="the disk is full"):
        MetricsWriter(path).write({"step": 9, "loss": 1.0})
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert [record["step"] for record in read_records(path)] == [8]


def test_another_failure_of_a_metrics_append_keeps_its_traceback(tmp_path, monkeypatch) -> None:
    from open_sft.monitor.metrics import MetricsWriter

    path = tmp_path / "metrics.jsonl"
    _refuse(monkeypatch, path, errno.EIO)
    with pytest.raises(OSError):
        MetricsWriter(path).write({"step": 9})


def test_a_read_only_checkpoints_dir_is_the_error_line(tmp_path) -> None:
    checkpointer = _checkpointer(tmp_path, keep=2)
    root = tmp_path / "checkpoints"

    class ReadOnly:
        def save(self, directory: str) -> None:
            raise OSError(errno.EROFS, "Read-only file system", directory)

    checkpointer.state_io = ReadOnly()
    with pytest.raises(UserError) as info:
        checkpointer.save(2)
    assert str(info.value) == (f"{root / 'step_2.tmp'}: the file system is read-only: checkpoint step_2 could not "
                               "be written (its unfinished step_2.tmp is never resumed from); remount it read-write "
                               "(or move the run's files) and rerun the same command: it resumes from step 0 (no "
                               "complete checkpoint yet)")


@pytest.mark.parametrize("fresh", [True, False])
def test_an_output_dir_lock_the_full_disk_refuses_is_the_error_line_and_leaves_nothing(tmp_path, monkeypatch,
                                                                                       fresh) -> None:
    from open_sft.training import output_lock

    out = tmp_path / "run"
    if not fresh:
        out.mkdir()
        (out / "metrics.jsonl").write_text("")

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(output_lock.os, "pwrite", full)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(1 << 30, 1 << 30, 0))
    with pytest.raises(UserError) as info:
        output_lock.OutputDirLock.acquire(out)
    assert str(info.value) == (f"{out}: the disk is full (0 bytes free): --output_dir {out} could not be written "
                               "(its lock file .open_sft.lock, the first thing a run writes there); free space "
                               "there and rerun the same command")
    assert out.exists() != fresh and not (out / ".open_sft.lock").exists()
