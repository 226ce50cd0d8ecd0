"""--dataset_mixer_unit share: the amounts are the mixture's shares of examples, and the mixture is the largest that
holds them without repeating a row: N = min_i rows_i / share_i, source i gives round(share_i × N) rows. Both builds
(every source read whole, and streamed a few rows at a time) select the same rows. And --eval_split_ratio's
evaluation mixture, whose shares follow the sources' sizes, is said beside the training mixture's."""

from __future__ import annotations

import json
import logging

import pytest

from open_sft.config.args import DataArguments
from open_sft.config.parse import parse_config
from open_sft.data import chunks
from open_sft.data.build import build_sources
from open_sft.data.in_memory import build_rows
from open_sft.data.prepare import prepare_data
from open_sft.data.summary import eval_split_note
from open_sft.errors import ConfigError, UserError
from unit.data.test_eval_split import _source, tokenizer  # noqa: F401 (a fixture): chat rows "<prefix> question i"




@pytest.fixture
def two(tmp_path) -> tuple[str, str]:
    """Two sources of unequal size: a has 40 rows, b 30."""
    return _source(tmp_path / "a.jsonl", "alpha", 40), _source(tmp_path / "b.jsonl", "beta", 30)


def _both_builds(args, tokenizer, tmp_path, monkeypatch, holdout=None):
    """(token ids of each example, reports) of the whole-file build and of the streaming build (chunks of 7 rows)."""
    rows, reports = build_rows(args, tokenizer, 3, holdout)
    whole = [rows.ids[rows.bounds[r]: rows.bounds[r + 1]].tolist() for r in range(len(rows))]
    monkeypatch.setattr(chunks, "CHUNK_ROWS", 7)
    writer, streamed_reports = build_sources(args, tokenizer, 3, holdout, tmp_path / "data", tmp_path / "spill")
    writer.finish("")
    import datasets

    streamed = [list(map(int, x)) for x in datasets.load_from_disk(str(tmp_path / "data"))["input_ids"]]
    return (whole, [r.to_dict() for r in reports]), (streamed, [r.to_dict() for r in streamed_reports])


@pytest.mark.parametrize("shares, counts", [
    (("0.7", "0.3"), (40, 17)),  # N = min(40 / 0.7, 30 / 0.3) = 57.14: a all 40, b round(0.3 × 57.14) = 17
    (("0.1", "0.9"), (3, 30)),   # N = min(400, 33.3): a round(3.33) = 3, b all 30
    (("7", "3"), (40, 17)),      # normalised to 0.7 and 0.3
])
def test_shares_give_the_largest_mixture_without_a_repeated_row(shares, counts, two, tokenizer, tmp_path,
                                                                monkeypatch) -> None:
    args = DataArguments(dataset_mixer_list=[two[0], shares[0], two[1], shares[1]], dataset_mixer_unit="share",
                         dataset_skip_cache=True)
    whole, streamed = _both_builds(args, tokenizer, tmp_path, monkeypatch)
    assert whole == streamed  # the same rows, the same examples, the same reports
    reports = whole[1]
    assert tuple(r["rows_selected"] for r in reports) == counts
    assert tuple(r["examples"] for r in reports) == counts
    assert all(r["upsample_factor"] == 1.0 for r in reports)  # no row repeated
    assert len(set(map(tuple, whole[0]))) == sum(counts)


def test_shares_that_do_not_sum_to_1_are_normalised_with_a_line(two, tokenizer, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="open_sft.data.shares"):
        build_rows(DataArguments(dataset_mixer_list=[two[0], "7", two[1], "3"], dataset_mixer_unit="share",
                                 dataset_skip_cache=True), tokenizer, 3)
    said = [r.getMessage() for r in caplog.records]
    assert "--dataset_mixer_unit share: the shares 7 and 3 sum to 10, not 1: normalised to 0.7 and 0.3" in said
    assert any(f"has 57 rows: {two[0]} 40 of its 40 rows (70.2%), {two[1]} 17 of its 30 rows (29.8%)" in line
               for line in said)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="open_sft.data.shares"):
        build_rows(DataArguments(dataset_mixer_list=[two[0], "0.7", two[1], "0.3"], dataset_mixer_unit="share",
                                 dataset_skip_cache=True), tokenizer, 3)
    assert not any("normalised" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("share", ["0", "0.0", "-0.5"])
def test_a_share_not_above_0_is_refused_naming_the_flag(share, two, tmp_path) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(["--model_name_or_path", str(tmp_path), "--dataset_mixer_unit", "share",
                      "--dataset_mixer_list", two[0], "0.5", two[1], share])
    assert f"--dataset_mixer_list: share {share} for {two[1]} must be a number above 0 under --dataset_mixer_unit " \
           "share" in str(info.value)


def test_a_share_too_small_for_one_row_is_refused(two, tokenizer) -> None:
    args = DataArguments(dataset_mixer_list=[two[0], "0.001", two[1], "0.999"], dataset_mixer_unit="share",
                         dataset_skip_cache=True)
    with pytest.raises(UserError, match=r"--dataset_mixer_list: the share 0.001 of .*a\.jsonl is no row of the largest "
                                        r"mixture the sources hold \(30 rows\); raise its share"):
        build_rows(args, tokenizer, 3)


def test_shares_of_bad_rows_dropped_count_the_usable_rows(tmp_path, tokenizer, monkeypatch) -> None:
    """Under --on_bad_row drop a source's rows are those that parse and convert: b's 30 less 4 bad ones."""
    a = _source(tmp_path / "a.jsonl", "alpha", 40)
    _source(tmp_path / "b.jsonl", "beta", 30)
    lines = (tmp_path / "b.jsonl").read_text().splitlines()
    lines[2], lines[9] = "{not json", json.dumps({"messages": "not a list"})
    lines[0], lines[20] = json.dumps({"messages": [{"role": "user", "content": "no answer"}]}), "[1, 2]"
    (tmp_path / "b.jsonl").write_text("\n".join(lines) + "\n")
    args = DataArguments(dataset_mixer_list=[a, "0.5", str(tmp_path / "b.jsonl"), "0.5"], dataset_mixer_unit="share",
                         on_bad_row="drop", dataset_skip_cache=True)
    whole, streamed = _both_builds(args, tokenizer, tmp_path, monkeypatch)
    assert whole == streamed
    assert [r["rows_selected"] for r in whole[1]] == [26, 26]  # N = min(40, 26) / 0.5


def test_the_training_side_of_an_eval_split_shares_the_rows_left(two, tokenizer, tmp_path, monkeypatch) -> None:
    """a 40 rows less 10 held out, b 30 less 8: N = min(30 / 0.7, 22 / 0.3) = 42.86, a 30 and b 13; the evaluation
    side is the held-out rows, once each, whatever the shares."""
    args = DataArguments(dataset_mixer_list=[two[0], "0.7", two[1], "0.3"], dataset_mixer_unit="share",
                         dataset_skip_cache=True)
    whole, streamed = _both_builds(args, tokenizer, tmp_path, monkeypatch, holdout=("train", 0.25))
    assert whole == streamed and [r["rows_selected"] for r in whole[1]] == [30, 13]
    held, streamed_held = _both_builds(args, tokenizer, tmp_path / "eval", monkeypatch, holdout=("eval", 0.25))
    assert held == streamed_held and [r["rows_selected"] for r in held[1]] == [10, 8]
    assert not set(map(tuple, whole[0])) & set(map(tuple, held[0]))


def test_the_eval_split_line_gives_both_mixtures_shares(two, tokenizer) -> None:
    args = DataArguments(dataset_mixer_list=[two[0], "0.7", two[1], "0.3"], dataset_mixer_unit="share",
                         dataset_skip_cache=True)
    train = prepare_data(args, tokenizer, 3, holdout=("train", 0.25))
    held = prepare_data(args, tokenizer, 3, holdout=("eval", 0.25))
    assert eval_split_note(train.report, held.report, 0.25) == (
        "eval split (--eval_split_ratio 0.25 of each source's rows, each evaluated once): a 55.6%, b 44.4% of "
        "examples; the training mixture: a 69.8%, b 30.2%")
    assert train.cache_key != prepare_data(DataArguments(**{**args.__dict__, "dataset_mixer_unit": "rows"}),
                                           tokenizer, 3, holdout=("train", 0.25)).cache_key
    one = DataArguments(dataset_mixer_list=[two[0], "1.0"], dataset_skip_cache=True)
    assert eval_split_note(prepare_data(one, tokenizer, 3).report, prepare_data(one, tokenizer, 3).report, 0.1) is None


@pytest.mark.parametrize("unit", ["share", "tokens"])
def test_the_eval_list_counts_rows_whatever_the_training_unit(unit, two, tokenizer) -> None:
    """--eval_dataset_mixer_list a 1.0 b 1.0 under --dataset_mixer_unit share was cut to the shares' mixture (a: 30 of
    its 40 rows), and `a 12` under tokens was 12 tokens (one row): the training mixture's unit decided the eval set."""
    args = DataArguments(dataset_mixer_list=[two[0], "1", two[1], "1"], dataset_mixer_unit=unit,
                         eval_dataset_mixer_list=[two[0], "1.0", two[1], "12"], dataset_skip_cache=True)
    _, reports = build_rows(args.evaluation_sources(), tokenizer, 3)
    assert [r.to_dict()["examples"] for r in reports] == [40, 12]
