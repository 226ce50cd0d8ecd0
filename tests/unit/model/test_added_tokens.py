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


def test_another_models_tokenizer_is_warned_about_and_tokens_the_run_added_are_not(tiny_model_dir, caplog) -> None:
    """--tokenizer_name_or_path of another model (the hunter's 50,280-token OLMo tokenizer on a 1,536-row model)
    resized the embeddings with an INFO line only: ids below the model's rows trained on embeddings learned for
    other tokens. Tokens past the rows that the run did not add are warned about; the run's own additions are not."""
    import transformers
    from tokenizers import Tokenizer, models

    from open_sft.data.chat.templates import remember_new_tokens
    from open_sft.model.load import fit_embeddings_to_tokenizer

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    rows = model.get_input_embeddings().weight.shape[0]
    vocab = {f"w{i}": i for i in range(rows + 40)}
    foreign = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="w0")), eos_token="w1", name_or_path="other/tok")
    with caplog.at_level(logging.WARNING, logger="open_sft.model.load"):
        fit_embeddings_to_tokenizer(model, foreign, multiple=1)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert f"the tokenizer (other/tok, {rows + 40} tokens) has 40 tokens the model's embeddings ({rows} rows) have " \
           "no row for, which this run did not add: is it another model's tokenizer?" in said
    caplog.clear()
    own = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    added = own.add_special_tokens({"additional_special_tokens": [f"<t{i}>" for i in range(rows - len(own) + 3)]})
    remember_new_tokens(own, list(range(len(own) - added, len(own))))
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with caplog.at_level(logging.WARNING, logger="open_sft.model.load"):
        fit_embeddings_to_tokenizer(model, own, multiple=1)
    assert len(own) > rows and not [r for r in caplog.records if "another model's tokenizer" in r.getMessage()]
