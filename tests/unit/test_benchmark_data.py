"""benchmark_data.py counts the tokens training makes: it loaded its tokenizer with AutoTokenizer alone, so a bare
tokenizer.json (no tokenizer_config.json naming eos, GPT-NeoX/OLMo's) had no eos and the chat template's turns ended
with nothing, ~0.5 % fewer tokens than training (181,609 against its 182,608 on 999 alpaca rows with OLMo's tokenizer);
it loads it as finetune.py does."""

from __future__ import annotations

import shutil

from conftest import load_script

from open_sft.config.args import ModelArguments
from open_sft.data.chat.templates import apply_chat_template_choice
from open_sft.model.tokenizer import load_tokenizer

CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def test_a_bare_tokenizer_json_is_benchmarked_with_the_eos_training_fills_in(tiny_model_dir, tmp_path) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(tiny_model_dir / "tokenizer.json", bare / "tokenizer.json")
    script = load_script("benchmark_data")
    benchmarked = script.training_tokenizer(str(bare), "tulu")
    trained = load_tokenizer(ModelArguments(model_name_or_path=str(bare)))
    apply_chat_template_choice(trained, "tulu", None)
    eos = trained.convert_tokens_to_ids("<|endoftext|>")
    assert benchmarked.eos_token_id == trained.eos_token_id == eos
    assert benchmarked.apply_chat_template(CHAT, tokenize=False) == "<|user|>\nhi\n<|assistant|>\nhello<|endoftext|>"
    ids = benchmarked.apply_chat_template(CHAT, tokenize=True, return_dict=False)
    assert ids == trained.apply_chat_template(CHAT, tokenize=True, return_dict=False) and ids[-1] == eos


def test_a_tokenizers_json_file_is_benchmarked_as_the_directory_holding_it(tiny_model_dir, tmp_path) -> None:
    """benchmark_data_scaling.py's --tokenizer may be a tokenizer.json file (finetune.py takes the directory holding
    it): it set bos to <|endoftext|> as well, which training does not; both scripts load it as training loads that
    directory."""
    scaling = load_script("benchmark_data_scaling")
    from_file = scaling.load_tokenizer(str(tiny_model_dir / "tokenizer.json"), "tulu")
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(tiny_model_dir / "tokenizer.json", bare / "tokenizer.json")
    trained = load_tokenizer(ModelArguments(model_name_or_path=str(bare)))
    assert (from_file.eos_token, from_file.pad_token, from_file.bos_token) == ("<|endoftext|>", "<|pad|>", None)
    assert (trained.eos_token, trained.pad_token, trained.bos_token) == ("<|endoftext|>", "<|pad|>", None)
    apply_chat_template_choice(trained, "tulu", None)
    ids = from_file.apply_chat_template(CHAT, tokenize=True, return_dict=False)
    assert ids == trained.apply_chat_template(CHAT, tokenize=True, return_dict=False)
    assert ids[-1] == trained.eos_token_id
