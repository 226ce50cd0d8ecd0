"""Hits of the tokenization cache a user expects: another --seed over whole copies of the sources (no row is drawn),
and an entry in a cache directory this process cannot write (a read-only mount of a cache built ahead)."""

from __future__ import annotations

import shutil

import pytest
from transformers import AutoTokenizer

import open_sft.data.workers as workers
from conftest import SAMPLE
from open_sft.config.args import DataArguments
from open_sft.data import cache
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
