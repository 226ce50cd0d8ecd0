"""A tokenization cache directory that cannot be written (a read-only mount, a path under a file, no permission) is
named up front with --output_dir's checks, and the cache's own failure (it changed since) is an error, not an OSError."""

from __future__ import annotations

import os

import pytest

from open_sft.config.parse import parse_config
from open_sft.data import cache
from open_sft.errors import ConfigError, UserError


def _flags(tmp_path, *more: str) -> list[str]:
    return ["--model_name_or_path", "org/model", "--dataset_mixer_list", "a.jsonl", "1.0",
            "--output_dir", str(tmp_path / "out"), *more]


def test_a_cache_dir_under_a_file_is_named_up_front(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("OPEN_SFT_CACHE")
    (tmp_path / "data.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError) as info:
        parse_config(_flags(tmp_path, "--dataset_local_cache_dir", str(tmp_path / "data.jsonl" / "cache")))
    assert (f"--dataset_local_cache_dir: it lies under {tmp_path / 'data.jsonl'}, which is a file, not a directory; "
            "give a directory you can write, or --dataset_skip_cache") in str(info.value)
    parse_config(_flags(tmp_path, "--dataset_local_cache_dir", str(tmp_path / "data.jsonl" / "cache"),
                        "--dataset_skip_cache"))  # no cache: nothing to write there
    monkeypatch.setenv("OPEN_SFT_CACHE", str(tmp_path / "data.jsonl"))
    with pytest.raises(ConfigError, match=r"OPEN_SFT_CACHE=\S+data.jsonl \(it overrides --dataset_local_cache_dir\)"
                                          r": it is a file, not a directory"):
        parse_config(_flags(tmp_path))


def test_a_read_only_cache_dir_is_named_up_front(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("OPEN_SFT_CACHE", str(tmp_path / "ro" / "cache"))
    (tmp_path / "ro").mkdir()
    real = os.statvfs

    class ReadOnly:  # a read-only mount, as `mount -o ro` reports it to root, who may write any mode
        def __init__(self, path):
            self.f_flag = real(path).f_flag | (os.ST_RDONLY if str(path).startswith(str(tmp_path / "ro")) else 0)

    monkeypatch.setattr(os, "statvfs", ReadOnly)
    with pytest.raises(ConfigError, match=f"{tmp_path / 'ro'} is on a read-only filesystem"):
        parse_config(_flags(tmp_path))
    # an existing cache directory it can read may hold the run's entry, built ahead: read there (test_cache_hits)
    (tmp_path / "ro" / "cache").mkdir()
    parse_config(_flags(tmp_path))


def test_the_caches_own_failure_names_the_directory(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("OPEN_SFT_CACHE")
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError) as info:
        cache.load_or_build(tmp_path / "file" / "cache", "k" * 64, {}, lambda staging: {})
    message = str(info.value)
    assert message.startswith(f"--dataset_local_cache_dir: the tokenization cache {tmp_path / 'file' / 'cache'} "
                              "cannot be written (Not a directory)")
    assert "--dataset_skip_cache" in message


def test_a_full_disk_while_the_cache_is_written_says_so_and_that_the_rerun_resumes(tmp_path, monkeypatch) -> None:
    import errno
    import shutil
    from collections import namedtuple

    monkeypatch.delenv("OPEN_SFT_CACHE")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: namedtuple("Usage", "total used free")(10, 10, 0))

    def build(staging):
        (staging / "data-00000-of-00001.arrow").write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(UserError) as info:
        cache.load_or_build(tmp_path / "cache", "k" * 64, {}, build)
    assert str(info.value) == (f"{tmp_path / 'cache'}: the disk is full (0 bytes free) while writing the tokenization "
                               "cache; free space there, or move the cache (--dataset_local_cache_dir) to a disk with "
                               "room, and rerun the same command: the build resumes from its last complete chunk "
                               "(nothing partial is used: an entry counts once COMPLETE is written)")
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == []  # the staging removed, and the key's lock


def test_a_full_disk_under_dataset_skip_cache_names_the_temporary_directory_and_the_way_out(
        tiny_model_dir, tmp_path, monkeypatch) -> None:
    """--dataset_skip_cache builds in TMPDIR: a full one ended in a traceback; now one error, and nothing left there."""
    import errno
    import shutil
    from collections import namedtuple

    from transformers import AutoTokenizer

    from open_sft.config.args import DataArguments
    from open_sft.data import build, prepare
    from conftest import SAMPLE

    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(prepare.tempfile, "tempdir", None)  # tempfile reads TMPDIR once: read it again
    monkeypatch.setattr(shutil, "disk_usage", lambda path: namedtuple("Usage", "total used free")(10, 10, 0))
    build_dataset = build.build_dataset

    def fills_the_disk(*args, **kwargs):
        build_dataset(*args, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(prepare, "build_dataset", fills_the_disk)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    with pytest.raises(UserError) as info:
        prepare.prepare_data(DataArguments(dataset_mixer_list=[str(SAMPLE), "0.02"], dataset_skip_cache=True),
                             tokenizer, 0)
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'tmp'}/open_sft_build_") and message.endswith(
        ": the disk is full (0 bytes free) while tokenizing (--dataset_skip_cache builds in the temporary "
        "directory); set TMPDIR to a directory on a disk with room, or drop --dataset_skip_cache and give the cache "
        "room (--dataset_local_cache_dir)")
    assert list((tmp_path / "tmp").iterdir()) == []  # the half-built data removed at once


def test_a_cache_on_a_filesystem_without_locks_says_so(tmp_path, monkeypatch) -> None:
    """flock fails on Lustre mounted without -o flock (ENOSYS) and on NFS without its lock service (ENOLCK): the cache
    said it 'cannot be written', of a directory the user writes."""
    import errno
    import fcntl

    monkeypatch.delenv("OPEN_SFT_CACHE")

    def no_locks(handle, operation):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.raises(UserError) as info:
        cache.load_or_build(tmp_path / "cache", "k" * 64, {}, lambda staging: pytest.fail("built without a lock"))
    assert str(info.value) == (
        f"--dataset_local_cache_dir: the filesystem of the tokenization cache {tmp_path / 'cache'} has no file locks "
        "(flock: Function not implemented), which keep the builds of processes and jobs sharing the cache apart; "
        "mount it with locks (Lustre: -o flock), give a directory on another filesystem, or --dataset_skip_cache to "
        "tokenize without a cache")
