"""Rows as flat arrays: selection, truncation and counting equal the row-by-row definitions; the
Arrow columns equal what `datasets.Dataset.from_dict` makes of the same rows (with int32 features)."""

from __future__ import annotations

import random
from collections import Counter

import datasets
import numpy as np
import pytest

from open_sft.data import token_rows
from open_sft.data.token_rows import IGNORE_INDEX, TokenRows, fit_rows
from open_sft.data.labels import Example, count_trained, truncate_example


def random_rows(seed: int, count: int = 300) -> list[Example]:
    rng = random.Random(seed)
    examples = []
    for _ in range(count):
        ids = [rng.randrange(1000) for _ in range(rng.randint(1, 40))]
        trained_from = rng.randint(0, len(ids) + 2)  # some rows train nothing, some only their first token
        labels = [t if k >= trained_from and rng.random() < 0.8 else IGNORE_INDEX for k, t in enumerate(ids)]
        examples.append(Example(ids, labels))
    return examples


def as_rows(examples: list[Example]) -> TokenRows:
    flat = lambda field: np.array([v for e in examples for v in getattr(e, field)], dtype=np.int32)  # noqa: E731
    return TokenRows.from_lengths(flat("input_ids"), flat("labels"), np.array([len(e.input_ids) for e in examples]))


@pytest.mark.parametrize("truncation", ["truncate", "drop"])
def test_fit_rows_equals_truncate_example_row_by_row(truncation) -> None:
    examples = random_rows(0)
    rng = random.Random(1)
    order = [rng.randrange(len(examples)) for _ in range(500)]  # repeats, as upsampling makes
    expected, reasons, truncated = [], Counter(), 0
    for r in order:
        kept, reason = truncate_example(examples[r], 12, truncation)
        if kept is not None and count_trained(kept.labels) == 0:
            kept, reason = None, "no_trained_tokens"
        if kept is None:
            reasons[reason] += 1
        else:
            expected.append(kept)
            truncated += reason == "truncated"
    rows, dropped, cut = fit_rows(as_rows(examples), np.array(order), 12, truncation)
    assert [Example(*rows.row(r)) for r in range(len(rows))] == expected
    assert (dropped, cut) == (reasons, truncated)
    assert rows.trained_counts().tolist() == [count_trained(e.labels) for e in expected]
    assert set(reasons) >= ({"too_long"} if truncation == "drop" else {"no_trained_tokens_after_truncation"})
    assert reasons["no_trained_tokens"] > 0 and (truncation == "drop" or truncated > 0)


def test_concat_and_take_keep_rows_whole() -> None:
    examples = random_rows(2, 50)
    rows = TokenRows.concat([as_rows(examples[:20]), TokenRows.empty(), as_rows(examples[20:])])
    assert [Example(*rows.row(r)) for r in range(len(rows))] == examples
    taken = rows.take(np.array([3, 3, 0, 49]))
    assert [Example(*taken.row(r)) for r in range(len(taken))] == [examples[i] for i in (3, 3, 0, 49)]


def test_arrow_columns_equal_from_dict_and_split_into_int32_chunks(monkeypatch) -> None:
    examples = random_rows(3, 100)
    features = datasets.Features({"input_ids": datasets.List(datasets.Value("int32")),
                                  "labels": datasets.List(datasets.Value("int32")), "length": datasets.Value("int64")})
    reference = datasets.Dataset.from_dict({"input_ids": [e.input_ids for e in examples],
                                            "labels": [e.labels for e in examples],
                                            "length": [len(e.input_ids) for e in examples]}, features=features)
    monkeypatch.setattr(token_rows, "_MAX_LIST_VALUES", 50)  # many chunks, some of a single row
    built = as_rows(examples).to_dataset(fingerprint="test")
    assert built.features == reference.features
    assert built.data.column("input_ids").num_chunks > 10
    assert built.to_dict() == reference.to_dict()
    empty = TokenRows.empty().to_dataset(fingerprint="empty")
    assert len(empty) == 0 and empty.features == reference.features
