"""LoRA and QLoRA: only adapters train, the saved adapter and the merged model agree, ZeRO-3 matches
one process, and QLoRA (bitsandbytes' CPU backend, NF4 + double quantization, bf16 compute) trains.

The tests of this subject that launch real processes are in tests/integration/test_lora.py.
"""

from __future__ import annotations

import pytest
import torch

from open_sft.config.parse import parse_config
from open_sft.config.args import LoraArguments
from open_sft.errors import ConfigError, UserError
from open_sft.model.loss import TokenLossModel
from open_sft.model.load import load_model
from open_sft.training.optim import build_optimizer
from unit.model.test_model_options import make_batch, model_args


def test_lora_flags_defaults_and_validation() -> None:
    base = ["--model_name_or_path", "org/model", "--dataset_mixer_list", "a.jsonl", "1.0"]
    lora = parse_config(base + ["--use_lora"]).lora
    assert (lora.lora_rank, lora.lora_alpha, lora.lora_dropout) == (64, 16, 0.1)
    assert lora.lora_target_modules == ["all-linear"]
    targets = parse_config(base + ["--lora_target_modules", "q_proj", "v_proj"]).lora.lora_target_modules
    assert targets == ["q_proj", "v_proj"]
    with pytest.raises(ConfigError) as info:
        parse_config(base + ["--merge_lora_on_save", "--lora_rank", "0", "--lora_dropout", "1.5"])
    assert len(info.value.problems) == 3
    assert "--merge_lora_on_save needs --use_lora or --use_qlora" in str(info.value)


def test_only_adapter_weights_train(tiny_model_dir) -> None:
    """In process: after three AdamW steps every adapter tensor changed everywhere, nothing else moved."""
    lora = LoraArguments(use_lora=True, lora_rank=4, lora_dropout=0.0)
    model = load_model(model_args(tiny_model_dir), lora=lora)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * 7 * 2  # A and B of 7 linear layers in each of 2 blocks; not lm_head
    wrapped = TokenLossModel(model).train()
    optimizer = build_optimizer(wrapped, 1e-2, 0.0)
    batch = make_batch()
    for _ in range(3):
        wrapped(**batch).backward()
        optimizer.step()
        optimizer.zero_grad()
    for name, param in model.named_parameters():
        if name in trainable:
            assert float((param != before[name]).float().mean()) > 0.99, name
        else:
            assert torch.equal(param, before[name]), name


def test_qlora_refuses_deepspeed(tiny_model_dir, monkeypatch) -> None:
    from conftest import DS_CONFIGS

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(DS_CONFIGS / "zero3.json"))
    with pytest.raises(UserError, match=r"--use_qlora does not work under DeepSpeed.*accelerate launch --multi_gpu"):
        parse_config(["--model_name_or_path", str(tiny_model_dir), "--dataset_mixer_list", "d.jsonl", "1.0",
                      "--use_qlora"])


@pytest.mark.parametrize("tied", [False, True])
def test_added_tokens_are_trainable_rows_under_lora(tied) -> None:
    """The rows of tokens the run added train under LoRA: the embedding's and an untied head's by name, a tied
    head through the embedding (peft wraps both); nothing is added without new tokens."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from open_sft.config.args import LoraArguments
    from open_sft.model.lora import apply_lora, trainable_token_rows

    config = AutoConfig.for_model("llama", vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    model = AutoModelForCausalLM.from_config(config)
    expected = {"embed_tokens": [90, 91]} if tied else {"embed_tokens": [90, 91], "lm_head": [90, 91]}
    assert trainable_token_rows(model, [90, 91]) == expected
    assert trainable_token_rows(model, []) == {}
    peft_model = apply_lora(model, LoraArguments(use_lora=True, lora_rank=4), False, [90, 91])
    trained = [n for n, p in peft_model.named_parameters() if p.requires_grad and "lora_" not in n]
    assert len(trained) == (1 if tied else 2) and all("trainable_tokens_delta" in n for n in trained)
    x = torch.tensor([[1, 90, 91, 5]])
    peft_model(input_ids=x, labels=x).loss.backward()
    assert all(float(p.grad.norm()) > 0 for n, p in peft_model.named_parameters() if n in trained)
