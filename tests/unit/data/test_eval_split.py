"""--eval_split_ratio holds rows out before the mixture takes its amounts: with an upsampled source, no copy of
an evaluation row is trained on (checked on the token ids), each held-out row is evaluated once, and the
training side takes its amount from the rows left."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from open_sft.config.args import DataArguments
from open_sft.data.prepare import prepare_data
from open_sft.errors import UserError


@pytest.fixture()
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _source(path, prefix: str, rows: int) -> str:
    with path.open("w") as handle:
        for i in range(rows):
            handle.write(json.dumps({"messages": [{"role": "user", "content": f"{prefix} question {i}"},
                                                  {"role": "assistant", "content": f"{prefix} answer {i}"}]}) + "\n")
    return str(path)


def _ids(data) -> list[tuple[int, ...]]:
    return [tuple(data.example(i).input_ids) for i in range(len(data))]


@pytest.mark.parametrize("unit", ["rows", "tokens"])
def test_an_upsampled_row_and_its_copies_fall_on_one_side(tmp_path, tokenizer, unit) -> None:
    a, b = _source(tmp_path / "a.jsonl", "alpha", 40), _source(tmp_path / "b.jsonl", "beta", 30)
    args = DataArguments(dataset_mixer_list=[a, "3.0", b, "0.5"], dataset_mixer_unit=unit,
                         dataset_local_cache_dir=str(tmp_path / "cache"))
    train = prepare_data(args, tokenizer, 7, holdout=("train", 0.25))
    held = prepare_data(args, tokenizer, 7, holdout=("eval", 0.25))
    whole = prepare_data(args, tokenizer, 7)
    assert len({train.cache_key, held.cache_key, whole.cache_key}) == 3  # each side its own cache entry

    train_ids, held_ids = _ids(train), _ids(held)
    assert not set(train_ids) & set(held_ids)  # no evaluation row, nor a copy of it, is trained on
    assert len(held_ids) == len(set(held_ids)) == 10 + 8  # round(0.25 × rows) of each source, once each
    assert [held.source(i) for i in range(len(held))] == [0] * 10 + [1] * 8
    alpha = [ids for i, ids in enumerate(train_ids) if train.source(i) == 0]
    assert len(set(alpha) | {ids for i, ids in enumerate(held_ids) if held.source(i) == 0}) == 40
    if unit == "rows":  # the amounts apply to the rows left: 3 × 30 copies, half of 22
        assert len(alpha) == 90 and len(set(alpha)) == 30
        assert len(train) - len(alpha) == 11
    again = prepare_data(args, tokenizer, 7, holdout=("eval", 0.25))
    assert _ids(again) == held_ids and again.cache_hit


def test_a_ratio_that_holds_out_everything_or_nothing_is_refused(tmp_path, tokenizer) -> None:
    a = _source(tmp_path / "a.jsonl", "alpha", 3)
    args = DataArguments(dataset_mixer_list=[a, "1.0"], dataset_skip_cache=True)
    with pytest.raises(UserError, match=r"--eval_split_ratio 0.1 holds out no example; raise it"):
        prepare_data(args, tokenizer, 0, holdout=("eval", 0.1))
    with pytest.raises(UserError, match=r"--eval_split_ratio 0.9 holds out all 3 rows of .*a.jsonl"):
        prepare_data(args, tokenizer, 0, holdout=("train", 0.9))
