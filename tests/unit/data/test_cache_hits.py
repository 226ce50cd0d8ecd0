"""Hits of the tokenization cache a user expects: another --seed over whole copies of the sources (no row is drawn),
and an entry in a cache directory this process cannot write (a read-only mount of a cache built ahead)."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import threading
import time

import pytest
from transformers import AutoTokenizer

import open_sft.data.workers as workers
from conftest import SAMPLE
from open_sft.config.args import DataArguments
from open_sft.data import cache, cache_check
from open_sft.data.cache_inputs import key_inputs
from open_sft.data.prepare import prepare_data


@pytest.fixture()
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture()
def data_file(tmp_path, monkeypatch):
    monkeypatch.setenv("OPEN_SFT_CACHE", str(tmp_path / "cache"))  # this test's own cache
    path = tmp_path / "data.jsonl"
    shutil.copy(SAMPLE, path)
    return path


def _key(data_file, tokenizer, seed: int, *amounts: str, holdout=None, **flags) -> str:
    mixer = [item for amount in amounts for item in (str(data_file), amount)]
    args = DataArguments(dataset_mixer_list=mixer, max_seq_length=256, **flags)
    return cache.cache_key(key_inputs(args, tokenizer, seed, holdout))


def test_another_seed_over_whole_copies_of_the_sources_is_a_hit(tokenizer, data_file, monkeypatch) -> None:
    """--seed entered every key: a seed sweep over `data.jsonl 1.0` tokenized the corpus again for each seed, though
    a whole fraction draws no row. The seed is a key input only where it draws rows."""
    for amounts in (["1.0"], ["2.0"], ["1.0", "3.0"]):
        assert _key(data_file, tokenizer, 1, *amounts) == _key(data_file, tokenizer, 2, *amounts), amounts
    assert _key(data_file, tokenizer, 1, "1.0", dataset_mixer_unit="tokens") == \
        _key(data_file, tokenizer, 2, "1.0", dataset_mixer_unit="tokens")
    drawn = {"fraction": (["0.5"], {}), "upsampled": (["1.5"], {}), "count": (["2000"], {}),
             "one drawn of two": (["1.0", "0.5"], {}), "share": (["1.0"], {"dataset_mixer_unit": "share"}),
             "tokens": (["0.5"], {"dataset_mixer_unit": "tokens"})}
    for name, (amounts, flags) in drawn.items():
        assert _key(data_file, tokenizer, 1, *amounts, **flags) != _key(data_file, tokenizer, 2, *amounts, **flags), \
            name
    assert _key(data_file, tokenizer, 1, "1.0", holdout=("train", 0.1)) != \
        _key(data_file, tokenizer, 2, "1.0", holdout=("train", 0.1))  # the held-out rows are drawn

    args = DataArguments(dataset_mixer_list=[str(data_file), "2.0"], max_seq_length=256)
    built = prepare_data(args, tokenizer, 1)
    monkeypatch.setattr(workers, "label_batch", lambda *_, **__: pytest.fail("a hit must not tokenize"))
    hit = prepare_data(args, tokenizer, 2)
    assert hit.cache_hit and hit.cache_path == built.cache_path and len(hit) == 4000
    monkeypatch.undo()
    fresh = prepare_data(DataArguments(dataset_mixer_list=[str(data_file), "2.0"], max_seq_length=256,
                                       dataset_skip_cache=True), tokenizer, 2)
    assert fresh.dataset["input_ids"] == hit.dataset["input_ids"] and fresh.dataset["labels"] == hit.dataset["labels"]


def _read_only(monkeypatch) -> None:
    """The cache directory as a read-only mount shows it to the cache: opening the lock file to write fails with
    EROFS (root, who runs these tests, may write any mode, so permissions cannot make one)."""
    def refuse(path, *_, **__):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(cache, "wait_for_lock", refuse)


def test_an_entry_in_a_cache_this_process_cannot_write_is_a_hit(tokenizer, data_file, tmp_path, monkeypatch,
                                                                 caplog) -> None:
    """A cache built ahead (--cache_dataset_only on a CPU node) and mounted read-only where the training runs was
    refused (its lock could not be taken), though it held the entry: the entry is checked and read as it is, nothing
    is written there; one that is not there is refused naming the key and how to build it."""
    args = DataArguments(dataset_mixer_list=[str(data_file), "0.5"], max_seq_length=256)
    built = prepare_data(args, tokenizer, 1)
    files = sorted((tmp_path / "cache").rglob("*"))
    _read_only(monkeypatch)
    monkeypatch.setattr(workers, "label_batch", lambda *_, **__: pytest.fail("a hit must not tokenize"))
    with caplog.at_level(logging.INFO, logger="open_sft.data.cache"):
        hit = prepare_data(args, tokenizer, 1)
    assert hit.cache_hit and hit.cache_path == built.cache_path and len(hit) == 1000
    assert hit.dataset["input_ids"] == built.dataset["input_ids"] and hit.dataset["labels"] == built.dataset["labels"]
    assert f"the tokenization cache {tmp_path / 'cache'} cannot be written (Read-only file system): its entry is " \
           "read as it is" in caplog.text
    assert sorted((tmp_path / "cache").rglob("*")) == files

    other = DataArguments(dataset_mixer_list=[str(data_file), "0.25"], max_seq_length=256)
    key = cache.cache_key(key_inputs(other, tokenizer, 1))
    with pytest.raises(cache.UnwritableCache) as info:
        prepare_data(other, tokenizer, 1)
    assert str(info.value) == (
        f"OPEN_SFT_CACHE={tmp_path / 'cache'} (it overrides --dataset_local_cache_dir): the tokenization cache "
        f"{tmp_path / 'cache'} cannot be written (Read-only file system) and the entry of this data, {key}, is not "
        "there: build it where the cache can be written (this command with --cache_dataset_only), or give a "
        "directory you can write, or --dataset_skip_cache to tokenize without a cache")
    (built.cache_path / "COMPLETE").unlink()  # an interrupted build's: not read
    with pytest.raises(cache.UnwritableCache, match=r", is unusable \(no COMPLETE marker \(an interrupted build\)\)"):
        prepare_data(args, tokenizer, 1)


def test_a_read_only_hit_waits_for_the_build_holding_the_entrys_lock(tmp_path, monkeypatch) -> None:
    """A job reading the cache read-only while a job that can write it builds the entry: it takes the entry's lock
    shared, so it waits for the build and loads what it put in place, rather than finding no entry."""
    import fcntl

    key = "cd" * 32
    lock = cache.lock_path(tmp_path, key)
    builder = cache.open_lock(lock)  # another open file: flock conflicts as with another process
    _read_only(monkeypatch)
    got = []
    reader = threading.Thread(target=lambda: got.append(
        cache.load_or_build(tmp_path, key, {}, lambda staging: pytest.fail("a read-only cache builds nothing"))))
    reader.start()
    time.sleep(0.5)
    assert not got and reader.is_alive()  # waiting on the build
    import datasets

    datasets.Dataset.from_dict({"input_ids": [[1, 2, 3]], "labels": [[-100, 2, 3]]}).save_to_disk(tmp_path / "staged")
    (tmp_path / "staged" / "key.json").write_text("{}")
    (tmp_path / "staged" / "report.json").write_text('{"examples": 1}')
    (tmp_path / "staged" / "COMPLETE").write_text(json.dumps({"key": key, **cache_check.manifest(tmp_path / "staged")}))
    os.replace(tmp_path / "staged", tmp_path / key)
    fcntl.flock(builder, fcntl.LOCK_UN)
    builder.close()
    reader.join(timeout=30)
    dataset, report, entry, hit = got[0]
    assert hit and entry == tmp_path / key and report == {"examples": 1} and dataset["labels"] == [[-100, 2, 3]]


def test_a_checkpoint_whose_key_held_the_seed_resumes_on_the_same_rows(tokenizer, data_file) -> None:
    """A run checkpointed by a version that put the seed in every key resumes after the upgrade (its rows are these
    rows), known by its checkpoint's key; another seed, or other rows, are still refused."""
    from open_sft.data.prepare import ResumedDataDiffer

    args = DataArguments(dataset_mixer_list=[str(data_file), "1.0"], max_seq_length=256)
    inputs = key_inputs(args, tokenizer, 7)
    assert "seed" not in inputs
    legacy = cache.cache_key({**inputs, "seed": 7})

    def resuming(key: str) -> dict:
        return {"identity": {"dataset_cache_key": key}}

    resumed = prepare_data(args, tokenizer, 7, resuming=resuming(legacy))
    assert resumed.cache_key == legacy and len(resumed) == 2000
    with pytest.raises(ResumedDataDiffer):
        prepare_data(args, tokenizer, 8, resuming=resuming(legacy))
    with pytest.raises(ResumedDataDiffer):
        prepare_data(args, tokenizer, 7, resuming=resuming(cache.cache_key({**inputs, "seed": 7, "max_seq_length": 9})))


def test_cache_dataset_only_names_the_entry_by_its_absolute_path(tiny_model_dir, data_file, tmp_path, monkeypatch,
                                                                 capsys) -> None:
    """The default cache directory is relative (local_dataset_cache): --cache_dataset_only's last line, which
    scripts/prepare_data.sh hands on, was `local_dataset_cache/<key>`, of no use to a job started elsewhere."""
    from open_sft.run import main

    monkeypatch.delenv("OPEN_SFT_CACHE")
    monkeypatch.chdir(tmp_path)
    assert main(["--model_name_or_path", str(tiny_model_dir), "--dataset_mixer_list", "data.jsonl", "1.0",
                 "--cache_dataset_only", "--output_dir", str(tmp_path / "out")]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    entries = [p for p in (tmp_path / "local_dataset_cache").iterdir() if cache.is_key(p.name)]
    assert len(entries) == 1 and last == str(entries[0])
