"""Abandoned partial builds of other keys are removed when a build starts; a live one (its key's lock held, here
by another process) or one a relaunch may still resume is kept (open_sft.data.partials)."""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

import open_sft.data.prepare as prepare
from conftest import SAMPLE
from open_sft.config.args import DataArguments
from open_sft.data import partials
from open_sft.data.cache import load_or_build, lock_path, open_lock
from open_sft.errors import UserError

OTHER = "a" * 64


def a_partial(cache_dir: Path, key: str, source: Path, age_s: float = 0.0) -> Path:
    """A partial of `key` as a killed build leaves it: spilled rows and the record of its data file."""
    partial = partials.partial_dir(cache_dir, key)
    partials.record_sources(partial, [source])
    (partial / "source0").mkdir()
    (partial / "source0" / "chat.ids").write_bytes(b"\0" * (3 << 20))
    if age_s:
        stamp = time.time() - age_s
        for path in [partial, *partial.rglob("*")]:
            os.utime(path, (stamp, stamp))
    return partial


def holding_lock(path: Path) -> int:
    """Another process that holds the lock at `path` (as a live build holds its key's) until it is killed; its
    pid. Forked, not launched: it opens and locks the file itself, as another process would."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: lock, say so, wait to be killed
        try:
            handle = path.open("a")
            fcntl.flock(handle, fcntl.LOCK_EX)
            os.write(write_end, b"1")
            time.sleep(600)
        finally:
            os._exit(0)
    os.close(write_end)
    assert os.read(read_end, 1) == b"1"
    os.close(read_end)
    return pid


def ended(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


@pytest.fixture()
def source(tmp_path) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text('{"messages": []}\n')
    return path


def test_an_old_partial_nobody_builds_is_removed_and_logged_with_its_size(tmp_path, source, caplog) -> None:
    cache_dir = tmp_path / "cache"
    kept = a_partial(cache_dir, "b" * 64, source, age_s=partials.ABANDONED_AFTER - 600)  # a relaunch may resume it
    old = a_partial(cache_dir, OTHER, source, age_s=partials.ABANDONED_AFTER + 600)
    own = a_partial(cache_dir, "c" * 64, source, age_s=partials.ABANDONED_AFTER + 600)  # the build's own: resumed
    with caplog.at_level(logging.INFO, logger="open_sft.data.partials"):
        partials.remove_abandoned(cache_dir, building="c" * 64)
    assert not old.exists() and kept.exists() and own.exists()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and str(old) in lines[0] and "3.0 MiB" in lines[0] and "not written to for" in lines[0]


def test_a_partial_whose_data_file_changed_is_removed_at_once(tmp_path, source) -> None:
    cache_dir = tmp_path / "cache"
    partial = a_partial(cache_dir, OTHER, source)
    partials.remove_abandoned(cache_dir, building="c" * 64)
    assert partial.exists()  # fresh, its data unchanged: a relaunch resumes it
    source.write_text('{"messages": [1]}\n')
    partials.remove_abandoned(cache_dir, building="c" * 64)
    assert not partial.exists()


def test_a_gone_data_file_is_not_a_change(tmp_path, source) -> None:
    """It may be mounted elsewhere, on the node that will relaunch the build."""
    cache_dir = tmp_path / "cache"
    partial = a_partial(cache_dir, OTHER, source)
    source.unlink()
    partials.remove_abandoned(cache_dir, building="c" * 64)
    assert partial.exists()


def test_a_partial_another_process_is_building_is_never_removed(tmp_path, source) -> None:
    """Two runs building different datasets in one cache directory: each one's build holds its key's lock."""
    cache_dir = tmp_path / "cache"
    partial = a_partial(cache_dir, OTHER, source, age_s=partials.ABANDONED_AFTER + 600)
    staging = cache_dir / f"{OTHER}.tmp-12345"
    staging.mkdir()
    source.write_text("changed\n")
    builder = holding_lock(lock_path(cache_dir, OTHER))
    try:
        partials.remove_abandoned(cache_dir, building="c" * 64)
        assert partial.exists() and staging.exists()
    finally:
        ended(builder)
    partials.remove_abandoned(cache_dir, building="c" * 64)  # that builder was killed: its leftovers are abandoned
    assert not partial.exists() and not staging.exists()


def test_a_build_of_changed_data_removes_the_partial_of_the_killed_build_before(tiny_model_dir, tmp_path,
                                                                               monkeypatch) -> None:
    """The issue: a build is killed, the data is edited (a new key) and the run relaunched; the old partial
    stayed for ever."""
    monkeypatch.setenv("OPEN_SFT_CACHE", str(tmp_path / "cache"))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    data = tmp_path / "data.jsonl"
    shutil.copy(SAMPLE, data)
    args = DataArguments(dataset_mixer_list=[str(data), "20"], max_seq_length=256)
    real_build = prepare.build_dataset

    def killed(*build_args):
        (build_args[5] / "source0").mkdir(parents=True)  # the partial: rows spilled, then the process is killed
        (build_args[5] / "source0" / "chat.ids").write_bytes(b"\0" * 1024)
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare, "build_dataset", killed)
    with pytest.raises(KeyboardInterrupt):
        prepare.prepare_data(args, tokenizer, 1)
    [left] = (tmp_path / "cache").glob("*.partial")
    monkeypatch.setattr(prepare, "build_dataset", real_build)
    with data.open("a") as handle:
        handle.write(SAMPLE.read_text().splitlines()[0] + "\n")
    prepare.prepare_data(args, tokenizer, 1)
    assert not left.exists()
    assert not list((tmp_path / "cache").glob("*.partial"))


def test_a_failed_build_leaves_no_lock_file_and_a_build_removes_the_idle_ones_of_other_keys(tmp_path) -> None:
    """Each failed build left a 0-byte `<key>.lock` behind for good (hunt: one per bad-data run)."""
    cache_dir = tmp_path / "cache"

    def bad_data(staging):
        raise UserError("data.jsonl line 2: not valid JSON")

    with pytest.raises(UserError):
        load_or_build(cache_dir, OTHER, {}, bad_data)
    assert list(cache_dir.iterdir()) == []
    # left by a killed build, or by a version that kept them: removed when no process holds them and the key has
    # nothing else in the cache; kept beside an entry, a partial, the key being built, and while a process holds it
    idle, entry, partial, own, held, other = (lock_path(cache_dir, key * 64) for key in "abcdef")
    for lock in (idle, entry, partial, own, held, other):
        lock.touch()
    (cache_dir / ("b" * 64)).mkdir()
    (cache_dir / ("c" * 64 + ".partial")).mkdir()
    (cache_dir / "dtype_probe.lock").touch()
    builder = holding_lock(held)
    try:
        partials.remove_abandoned(cache_dir, building="d" * 64)
    finally:
        ended(builder)
    assert sorted(p.name for p in cache_dir.glob("*.lock")) == sorted(
        p.name for p in (entry, partial, own, held, cache_dir / "dtype_probe.lock"))


def test_a_process_that_waited_on_a_removed_lock_file_takes_the_lock_again(tmp_path) -> None:
    """A lock file is removed by the process holding it: one that waited on that file must not then count as
    holding the key's lock while another holds the new file at the same path (flock locks the file, not the
    path)."""
    path = tmp_path / "k.lock"
    first = open_lock(path)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the waiter: takes the lock, says so, holds it until killed
        try:
            first.close()  # (the forked copy of the parent's: it holds the parent's lock too)
            held = open_lock(path)
            os.write(write_end, b"1")
            time.sleep(600)
            held.close()
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        deadline = time.monotonic() + 30
        while f" {os.stat(path).st_ino} " not in " ".join(
                line.replace(":", " ") for line in open("/proc/locks") if "->" in line):
            assert time.monotonic() < deadline, "the waiter never waited on the lock"
            time.sleep(0.05)  # (the waiter's blocked flock is listed with '->')
        path.unlink()
        second = open_lock(path, wait=False)  # the new file at the path: free
        assert second is not None
        first.close()  # the waiter gets the old file's lock, which is no longer the key's
        os.set_blocking(read_end, False)
        time.sleep(0.5)
        with pytest.raises(BlockingIOError):
            os.read(read_end, 1)
        second.close()
        os.set_blocking(read_end, True)
        assert os.read(read_end, 1) == b"1"  # then it holds the new file's
        assert open_lock(path, wait=False) is None
    finally:
        ended(pid)
        os.close(read_end)
