"""--add_tokens warns when an added token occurs inside words of the vocabulary: the tokenizer matches it anywhere,
so those words are split around it (`def` made `default` `def` + `ault`, silently)."""

from __future__ import annotations

import logging

from open_sft.config.args import ModelArguments
from open_sft.model.added_tokens import words_split_by
from open_sft.model.tokenizer import load_tokenizer


def test_the_words_an_added_token_would_split_come_from_the_vocabulary_commonest_first() -> None:
    vocab = {"▁self": 1, "return": 2, "def": 3, "Ġreturned": 4, "Ġdefault": 5, "selfish": 7, "Ġundefined": 9,
             "##defs": 11, "Ġdefault_value": 12}
    assert words_split_by(["def", "self", "return", "<def>", "<|call|>", "qz"], vocab) == {
        "def": ["default", "undefined", "defs"], "self": ["selfish"], "return": ["returned"]}


def test_add_tokens_names_the_words_it_will_split(tiny_model_dir, tmp_path, caplog) -> None:
    tokens = tmp_path / "tokens.txt"
    tokens.write_text("hat\n<tool>\n")
    with caplog.at_level(logging.WARNING, logger="open_sft.model.added_tokens"):
        tokenizer = load_tokenizer(ModelArguments(model_name_or_path=str(tiny_model_dir), add_tokens=str(tokens)))
    warning = " ".join(r.getMessage() for r in caplog.records)
    assert f"--add_tokens {tokens}: 1 added token(s) occur inside words" in warning
    assert "'hat' inside What, that" in warning and "'<tool>'" not in warning and "e.g. '<def>'" in warning
    assert "hat" in tokenizer.tokenize("that")  # what it warns of: the word is split around the added token
    caplog.clear()
    tokens.write_text("<tool>\n</tool>\n")
    with caplog.at_level(logging.WARNING, logger="open_sft.model.added_tokens"):
        load_tokenizer(ModelArguments(model_name_or_path=str(tiny_model_dir), add_special_tokens=str(tokens)))
    assert not [r for r in caplog.records if "inside words" in r.getMessage()]
