"""Assistant-only labels on a three-row example, checked by decoding the trained spans."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from open_sft.data.pipeline import count_trained
from open_sft.data.tokenize import (IGNORE_INDEX, Example, special_markers, tokenize_conversations, trained_spans,
                                   trained_token_runs)
from open_sft.data.tokenize import truncate_example

ROWS = [
    [{"role": "user", "content": "What is 2 plus 3?"}, {"role": "assistant", "content": "5"}],
    [{"role": "user", "content": "Reverse the word cat."}, {"role": "assistant", "content": "tac"},
     {"role": "user", "content": "Now uppercase it."}, {"role": "assistant", "content": "TAC"}],
    [{"role": "system", "content": "Reply with a number."}, {"role": "user", "content": "How many m in 3 km?"},
     {"role": "assistant", "content": "3000 m"}],
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def label(tokenizer, rows, train_on="all_assistant") -> list[Example]:
    markers = special_markers(tokenizer)
    return tokenize_conversations(tokenizer, [trained_spans(tokenizer, r, train_on, markers) for r in rows])


def trained_runs(tokenizer, example: Example) -> list[str]:
    """Decoded contiguous runs of trained tokens (each trained label is its own token id)."""
    assert all(lab in (IGNORE_INDEX, token) for token, lab in zip(example.input_ids, example.labels))
    return [tokenizer.decode(run) for run in trained_token_runs(example.input_ids, example.labels)]


def test_only_assistant_content_and_eos_are_trained(tokenizer) -> None:
    examples = label(tokenizer, ROWS)
    eos = tokenizer.eos_token
    assert trained_runs(tokenizer, examples[0]) == ["5" + eos]
    assert trained_runs(tokenizer, examples[1]) == ["tac" + eos, "TAC" + eos]
    assert trained_runs(tokenizer, examples[2]) == ["3000 m" + eos]
    # The whole rendered conversation is tokenized: untrained tokens hold the headers and prompts.
    untrained = tokenizer.decode([t for t, l in zip(examples[2].input_ids, examples[2].labels) if l == IGNORE_INDEX])
    assert "<|system|>" in untrained and "Reply with a number." in untrained and "<|assistant|>" in untrained
    assert "3000" not in untrained


def test_train_on_last_assistant_and_all(tokenizer) -> None:
    last = label(tokenizer, ROWS[1:2], "last_assistant")[0]
    assert trained_runs(tokenizer, last) == ["TAC" + tokenizer.eos_token]
    everything = label(tokenizer, ROWS[1:2], "all")[0]
    assert everything.labels == everything.input_ids


def test_truncation(tokenizer) -> None:
    example = label(tokenizer, ROWS[2:3])[0]
    n = len(example.input_ids)
    kept, reason = truncate_example(example, n, "truncate")
    assert (kept, reason) == (example, "kept")
    assert truncate_example(example, n - 1, "drop") == (None, "too_long")
    cut, reason = truncate_example(example, n - 1, "truncate")
    assert reason == "truncated" and len(cut.input_ids) == n - 1 and count_trained(cut.labels) >= 1
    # A window the prompt fills alone keeps no trained token: the row is dropped, not kept useless.
    first_trained = next(i for i, l in enumerate(example.labels) if l != IGNORE_INDEX)
    assert truncate_example(example, first_trained, "truncate") == (None, "no_trained_tokens_after_truncation")
