"""Each example knows its source: names for the metrics, the source of every example of the mixture, and of
every trained position of a collated batch (padded and packed), in the order the loss visits them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from open_sft.data.batching import collate, collate_packed, count_trained_batch, trained_sources
from open_sft.data.labels import IGNORE_INDEX, Example
from open_sft.data.mixer import source_names
from open_sft.data.prepare import PreparedData


def test_source_names_are_unique_and_safe_as_file_and_tag_names() -> None:
    assert source_names(["data/alpaca.jsonl", "allenai/tulu-3-sft-mixture", "other/alpaca.jsonl", "/srv/x y/",
                         "alpaca", "weird name!.parquet", "../..", "a.jsonl"]) == [
        "alpaca", "allenai_tulu-3-sft-mixture", "alpaca_2", "srv_x_y", "alpaca_3", "weird_name", "source", "a"]


def test_every_example_knows_its_source() -> None:
    import datasets

    dataset = datasets.Dataset.from_dict({"input_ids": [[i, i] for i in range(7)], "labels": [[i, i] for i in range(7)],
                                          "length": [2] * 7})
    report = {"sources": [{"name": "a.jsonl", "examples": 3}, {"name": "org/b", "examples": 0},
                          {"name": "c.jsonl", "examples": 4}]}
    data = PreparedData(dataset, report, "key", None, False)
    assert data.source_names == ["a", "org_b", "c"]
    assert [data.source(i) for i in range(7)] == [0, 0, 0, 2, 2, 2, 2]
    with pytest.raises(ValueError, match="the report counts 5 examples for a dataset of 7"):
        PreparedData(dataset, {"sources": [{"name": "x", "examples": 5}]}, "key", None, False)


EXAMPLES = [Example([1, 2, 3, 4], [IGNORE_INDEX, IGNORE_INDEX, 3, 4]), Example([5, 6], [5, 6]),
            Example([7, 8, 9], [IGNORE_INDEX, 8, 9])]


@pytest.mark.parametrize("packed", [False, True])
def test_trained_positions_carry_their_examples_source(packed) -> None:
    sources = [2, 0, 1]
    batch = collate_packed(EXAMPLES, 0, 6, sources) if packed else collate(EXAMPLES, 0, sources=sources)
    positions = trained_sources(batch)
    assert len(positions) == count_trained_batch(batch["labels"])
    # the label of each trained position (after the shift) says which example, so which source, it belongs to
    labels = batch["labels"][:, 1:][batch["labels"][:, 1:] != IGNORE_INDEX]
    owner = {3: 2, 4: 2, 6: 0, 8: 1, 9: 1}
    assert positions.tolist() == [owner[int(label)] for label in labels]
    assert np.bincount(positions.numpy(), minlength=3).tolist() == [1, 2, 2]
    assert "sources" not in (collate_packed(EXAMPLES, 0, 6) if packed else collate(EXAMPLES, 0))
    assert torch.equal(batch["input_ids"], (collate_packed(EXAMPLES, 0, 6) if packed else collate(EXAMPLES, 0))["input_ids"])
