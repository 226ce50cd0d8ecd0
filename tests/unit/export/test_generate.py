"""`open_sft generate` in process: plain continuation's edge cases (the command's runs are in
tests/integration/test_generate_chat.py)."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from open_sft.errors import UserError
from open_sft.export.generate import generate_reply


@pytest.fixture()
def loaded(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), AutoTokenizer.from_pretrained(tiny_model_dir)


def test_an_empty_plain_prompt_starts_from_bos_else_eos(loaded) -> None:
    """--raw --prompt "" with a tokenizer that adds no bos encoded to no tokens and generate failed (cannot reshape
    a tensor of 0 elements): it starts from bos, else eos (GPT-2's and NeoX's unconditional start), else says so."""
    model, tokenizer = loaded
    empty = [{"role": "user", "content": ""}]
    assert tokenizer("")["input_ids"] == []
    reply = generate_reply(model, tokenizer, empty, 3, raw=True)
    assert reply.prompt_tokens == 1 and reply.new_tokens >= 1
    tokenizer.bos_token = None
    assert generate_reply(model, tokenizer, empty, 3, raw=True).prompt_tokens == 1
    tokenizer.eos_token = None
    with pytest.raises(UserError, match="neither a bos nor an eos token to start from: give --prompt some text"):
        generate_reply(model, tokenizer, empty, 3, raw=True)
