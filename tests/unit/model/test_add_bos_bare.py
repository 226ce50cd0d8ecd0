"""--add_bos with a bare tokenizer.json (a directory holding no tokenizer_config.json naming its special tokens, as a
`tokenizers` file alone is): it names no bos and no class, so whether an example opens with its eos (GPT-NeoX's and
OLMo's, open-instruct's rule for a GPTNeoXTokenizer) or with nothing (Qwen's) cannot be told. It warned 'nothing to
add' and trained without the bos the user asked for (OLMo's tokenizer.json); it is refused with the
tokenizer_config.json key that settles it, and that fix opens every example with the token named."""

from __future__ import annotations

import json
import shutil

import pytest

from open_sft.config.args import ModelArguments
from open_sft.data.chat.templates import apply_chat_template_choice
from open_sft.errors import UserError
from open_sft.model.tokenizer import add_bos_to_template, load_tokenizer

CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


@pytest.fixture
def bare(tiny_model_dir, tmp_path):
    directory = tmp_path / "bare"
    directory.mkdir()
    shutil.copy(tiny_model_dir / "tokenizer.json", directory / "tokenizer.json")
    return directory


@pytest.mark.parametrize("template", ["tulu", None])  # chat rows, and text documents (no template)
def test_add_bos_with_a_bare_tokenizer_json_is_refused_with_the_key_that_settles_it(bare, template) -> None:
    tokenizer = load_tokenizer(ModelArguments(model_name_or_path=str(bare)))
    assert (tokenizer.bos_token, tokenizer.eos_token) == (None, "<|endoftext|>")
    if template:
        apply_chat_template_choice(tokenizer, template, None)
    with pytest.raises(UserError) as refused:
        add_bos_to_template(tokenizer)
    assert str(refused.value) == (
        f"--add_bos: the tokenizer of --model_name_or_path {bare} names no bos token, nor eos (its '<|endoftext|>' "
        "was taken from its vocabulary: a tokenizer.json without a tokenizer_config.json naming its special tokens), "
        "so the token that opens an example cannot be told: GPT-NeoX's and OLMo's open with their eos (open-instruct "
        "stands it in for a GPTNeoXTokenizer), Qwen's with none. Name it in a tokenizer_config.json beside the "
        "tokenizer.json, e.g. {\"bos_token\": \"<|endoftext|>\"} for GPT-NeoX/OLMo's, or drop --add_bos")


def test_the_fix_opens_every_example_with_the_bos_it_names(bare) -> None:
    (bare / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|endoftext|>"}))
    tokenizer = load_tokenizer(ModelArguments(model_name_or_path=str(bare)))
    apply_chat_template_choice(tokenizer, "tulu", None)
    add_bos_to_template(tokenizer)
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert tokenizer.bos_token_id == tokenizer.eos_token_id == eos
    assert tokenizer.apply_chat_template(CHAT, tokenize=False) == "<|endoftext|><|user|>\nhi\n<|assistant|>\nhello" \
                                                                  "<|endoftext|>"
    ids = tokenizer.apply_chat_template(CHAT, tokenize=True, return_dict=False)
    assert ids[0] == ids[-1] == eos and ids.count(eos) == 2


def test_a_tokenizer_that_names_its_eos_but_no_bos_is_left_as_open_instruct_leaves_it(bare, caplog) -> None:
    """Qwen's tokenizer_config.json names eos and no bos: open-instruct's `{{ bos_token }}` renders empty there."""
    (bare / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    tokenizer = load_tokenizer(ModelArguments(model_name_or_path=str(bare)))
    apply_chat_template_choice(tokenizer, "tulu", None)
    before = tokenizer.apply_chat_template(CHAT, tokenize=False)
    add_bos_to_template(tokenizer)
    assert tokenizer.bos_token is None and tokenizer.apply_chat_template(CHAT, tokenize=False) == before
    assert "--add_bos: the tokenizer has no bos token; nothing to add" in caplog.text
