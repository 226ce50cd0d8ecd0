"""The demo's tasks: bundled as generated, held out for real (no held-out fact in training), each answer the rule's."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest

from open_sft.embedded import demo_tasks
from open_sft.embedded.demo_tasks import ANIMALS, COLORS, DEMO_HELD_OUT, DEMO_TRAIN, demo_splits, split_pairs


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _facts(prompt: str) -> set[str]:
    """What a prompt states: its 'X lives in Y.' / 'X has a Y.' sentence, or the phrase to translate."""
    if prompt.startswith("Translate to French: "):
        return {prompt}
    return {prompt.split(". ")[0] + "."}


def test_bundled_files_equal_regeneration(tmp_path: Path) -> None:
    assert demo_tasks.main(["data", str(tmp_path)]) == 0
    for bundled in (DEMO_TRAIN, DEMO_HELD_OUT):
        assert (tmp_path / bundled.name).read_bytes() == bundled.read_bytes(), f"regenerate {bundled.name}"


def test_sizes_and_task_shares() -> None:
    train, held_out = _read(DEMO_TRAIN), _read(DEMO_HELD_OUT)
    assert (len(train), len(held_out)) == (2400, 40)
    assert Counter(r["task"] for r in train) == {"translate": 600, "where": 600, "who": 600, "pet": 600}
    assert Counter(r["task"] for r in held_out) == {"translate": 10, "where": 10, "who": 10, "pet": 10}
    assert len({r["messages"][0]["content"] for r in held_out}) == 40  # no held-out task counted twice
    assert len({r["messages"][0]["content"] for r in train}) == 775  # distinct training prompts


def test_no_held_out_fact_or_prompt_is_in_training() -> None:
    train, held_out = _read(DEMO_TRAIN), _read(DEMO_HELD_OUT)
    train_text = "\n".join(r["messages"][0]["content"] for r in train)
    for row in held_out:
        prompt = row["messages"][0]["content"]
        for fact in _facts(prompt):
            assert fact not in train_text, f"held-out {row['id']} states {fact!r}, which training rows state too"


def test_every_held_out_answer_word_is_taught() -> None:
    """The rule is new for the combination, not for the words: each answer word is some training answer's word."""
    train_words = {w for r in _read(DEMO_TRAIN) for w in r["answer"].split()}
    assert {w for r in _read(DEMO_HELD_OUT) for w in r["answer"].split()} <= train_words


def test_pair_split_is_a_partition() -> None:
    split = split_pairs()
    assert {relation: (len(train), len(held)) for relation, (train, held) in split.items()} == {
        "color-animal": (102, 18), "name-city": (272, 48), "name-animal": (204, 36)}
    for train, held in split.values():
        assert not set(train) & set(held)


def test_answers_follow_the_rules() -> None:
    french = {f"{ANIMALS[a]} {COLORS[c]}": (c, a) for c in COLORS for a in ANIMALS}
    for row in _read(DEMO_TRAIN)[:200] + _read(DEMO_HELD_OUT):
        prompt, answer = row["messages"][0]["content"], row["answer"]
        assert row["messages"][-1] == {"role": "assistant", "content": answer}
        if row["task"] == "translate":
            assert prompt == "Translate to French: {} {}".format(*french[answer])
        else:
            subject, rest = re.match(r"(\w+) (?:lives in|has a) (\w+)\.", prompt).groups()
            assert answer == (subject if row["task"] == "who" else rest)


def test_splits_are_deterministic_and_checked() -> None:
    assert demo_splits(8, 4, seed=3) == demo_splits(8, 4, seed=3)
    assert demo_splits(8, 4, seed=3) != demo_splits(8, 4, seed=4)
    with pytest.raises(ValueError, match="n_train must be a non-negative int"):
        demo_splits(-1)
    with pytest.raises(ValueError, match="at most 72 distinct held-out tasks"):
        demo_splits(8, 73)


def test_demo_base_is_the_demo_shape(tmp_path: Path) -> None:
    assert demo_tasks.main(["base", str(tmp_path)]) == 0
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (128, 4, 512)
    tokenizer = json.loads((tmp_path / "tokenizer.json").read_text())
    assert "ĠDublin" in tokenizer["model"]["vocab"]  # trained on the demo's tasks: a city is one token
