"""A LoRA run that adds tokens on a model whose LM head has a bias (Phi, GPT-J, CodeGen) under a peft before 0.22,
which computes that head without its bias: refused before the data are tokenized, from config.json and the
tokenizer (the refusal came at model load, after the tokenization)."""

from __future__ import annotations

import re

import pytest
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from conftest import SAMPLE
from open_sft.config.parse import parse_config
from open_sft.errors import UserError
from open_sft.model.head_bias import refuse_dropped_head_bias
from open_sft.model.tokenizer import load_tokenizer
from open_sft.run import main

REFUSAL = (r"LoRA with tokens this run adds \({count}; their embedding rows train as peft trainable tokens\) on a "
           r"model whose LM head has a bias needs peft >= 0\.22: peft 0\.21\.2 leaves the bias out")


@pytest.fixture
def phi_dir(tiny_model_dir, tmp_path):
    """A tiny Phi (its LM head has a bias) with the tiny model's tokenizer, one row per token."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = AutoConfig.for_model("phi", vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "phi")
    tokenizer.save_pretrained(tmp_path / "phi")
    return tmp_path / "phi"


@pytest.fixture
def old_peft(monkeypatch):
    import peft

    monkeypatch.setattr(peft, "__version__", "0.21.2")


def test_the_refusal_comes_before_the_data_are_tokenized(phi_dir, tmp_path, monkeypatch, capsys, old_peft) -> None:
    monkeypatch.setenv("OPEN_SFT_CACHE", str(tmp_path / "cache"))
    (tmp_path / "tokens.txt").write_text("<extra_a>\n<extra_b>\n")
    code = main(["--model_name_or_path", str(phi_dir), "--dataset_mixer_list", str(SAMPLE), "16", "--use_lora",
                 "--add_special_tokens", str(tmp_path / "tokens.txt"), "--max_seq_length", "128",
                 "--output_dir", str(tmp_path / "out"), "--max_train_steps", "1", "--report_to", "none"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert re.search(REFUSAL.format(count=2), err), err
    cache = tmp_path / "cache"
    assert not cache.exists() or not [p for p in cache.iterdir() if not p.name.endswith(".lock")], "tokenized"


def flags(model_dir, *more: str):
    return parse_config(["--model_name_or_path", str(model_dir), "--dataset_mixer_list", str(SAMPLE), "1.0",
                         "--use_lora", *more])


def test_which_runs_are_refused(phi_dir, tiny_model_dir, tmp_path, monkeypatch, old_peft) -> None:
    """Tokens past the model's rows count as added (their rows are trainable tokens too); a head without a bias
    (the tiny Llama-like model), a run that adds no token, no LoRA, peft 0.22, --cache_dataset_only: no refusal."""
    config = flags(phi_dir)
    tokenizer = load_tokenizer(config.model)
    refuse_dropped_head_bias(config, tokenizer)  # nothing added
    tokenizer.add_tokens(["<one>", "<two>", "<three>"])  # past the model's rows, not through the run's own adding
    with pytest.raises(UserError, match=REFUSAL.format(count=3)):
        refuse_dropped_head_bias(config, tokenizer)
    refuse_dropped_head_bias(flags(phi_dir, "--cache_dataset_only"), tokenizer)
    refuse_dropped_head_bias(parse_config(["--model_name_or_path", str(phi_dir), "--dataset_mixer_list",
                                           str(SAMPLE), "1.0"]), tokenizer)
    plain = flags(tiny_model_dir)
    llama_tokenizer = load_tokenizer(plain.model)
    llama_tokenizer.add_tokens(["<one>"])
    refuse_dropped_head_bias(plain, llama_tokenizer)
    import peft

    monkeypatch.setattr(peft, "__version__", "0.22.0")
    refuse_dropped_head_bias(config, tokenizer)
