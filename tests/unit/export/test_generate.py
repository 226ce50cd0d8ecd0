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


def test_special_tokens_generated_before_the_end_are_reported(loaded, monkeypatch, capsys) -> None:
    """A model that generates a special token (here pad) and then eos printed "generation": "" with new_tokens 2
    and no word of the first: the JSON line names the special tokens the text leaves out."""
    import json

    import torch

    from open_sft.export import generate

    model, tokenizer = loaded
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id

    def emits_pad_then_eos(**kwargs):
        return torch.cat([kwargs["input_ids"], torch.tensor([[pad, eos]])], dim=1)

    monkeypatch.setattr(model, "generate", emits_pad_then_eos)
    reply = generate_reply(model, tokenizer, [{"role": "user", "content": "hi"}], 3)
    assert (reply.text, reply.new_tokens, reply.stop_token) == ("", 2, tokenizer.eos_token)
    assert reply.special_tokens == [tokenizer.pad_token]
    monkeypatch.setattr(generate, "load_or_exit", lambda args: type("Loaded", (), {"model": model,
                                                                                    "tokenizer": tokenizer}))
    assert generate.main(["somewhere", "--prompt", "hi"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["generation"] == "" and line["special_tokens"] == [tokenizer.pad_token]
