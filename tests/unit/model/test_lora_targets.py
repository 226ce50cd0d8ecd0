"""LoRA on an MoE's weights held as parameters (gpt-oss's fused experts and router: no nn.Linear, peft's
target_parameters): all-linear adapts them (before, gpt-oss's adapters were on q/k/v/o alone, ~97 % of its decoder
weights without one, while the log said the experts were included), a user can name them, and the merge is the
adapted model."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from open_sft.config.args import LoraArguments
from open_sft.errors import UserError
from open_sft.model.lora import apply_lora
from open_sft.model.lora_targets import parameter_targets, split_targets
from unit.model.test_lora import merge_is_the_adapted_model

GPT_OSS = {"vocab_size": 96, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 32, "head_dim": 8, "num_local_experts": 4,
           "num_experts_per_tok": 2, "sliding_window": 8, "max_position_embeddings": 64}
HELD = ["experts.gate_up_proj", "experts.down_proj", "router.weight"]


def tiny_gpt_oss() -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt_oss", **GPT_OSS))


def test_the_weights_held_as_parameters_and_how_names_resolve() -> None:
    model = tiny_gpt_oss()
    held = parameter_targets(model)
    assert sorted(held) == sorted(f"model.layers.{i}.mlp.{w}" for i in range(2) for w in HELD)  # no biases
    assert split_targets(model, ["all-linear"]) == ("all-linear", HELD)
    assert split_targets(model, ["q_proj", "experts"]) == (["q_proj"], HELD[:2])
    assert split_targets(model, ["gate_up_proj", "mlp.router"]) == ([], ["gate_up_proj", "mlp.router.weight"])
    llama = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **{k: GPT_OSS[k] for k in list(GPT_OSS)[:7]}))
    assert split_targets(llama, ["all-linear"]) == ("all-linear", []) and not parameter_targets(llama)


def test_all_linear_adapts_every_decoder_weight_of_gpt_oss() -> None:
    """Every decoder weight of two or more dimensions (biases aside) carries an adapter, the experts' and the
    router's included; they take gradients; dropout yields to 0; a dropout the user gave is refused."""
    peft_model = apply_lora(tiny_gpt_oss(), LoraArguments(use_lora=True, lora_rank=2), False, dropout_given=False)
    config = peft_model.peft_config["default"]
    assert config.lora_dropout == 0.0 and set(config.target_parameters) == set(HELD)
    wrapped = {f"{n.replace('.base_layer', '')}.{m.parameter_name}" for n, m in peft_model.named_modules()
               if type(m).__name__ == "ParamWrapper"}
    linear = {n.removesuffix(".base_layer") for n, m in peft_model.named_modules()
              if type(m).__name__ == "Linear" and ".lora_" not in n and "lm_head" not in n}
    weights = {n.removesuffix(".weight").replace(".base_layer", "") for n, p in peft_model.named_parameters()
               if p.dim() >= 2 and "layers." in n and ".lora_" not in n and not n.endswith("bias")}
    assert weights == {w.removesuffix(".weight") for w in wrapped} | linear, weights ^ (wrapped | linear)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    peft_model(input_ids=ids, labels=ids).loss.backward()
    for name, param in peft_model.named_parameters():
        if "lora_A" in name and ("experts" in name or "router" in name):
            assert param.grad is not None, name
    with pytest.raises(UserError, match="pass --lora_dropout 0, or name the modules to adapt"):
        apply_lora(tiny_gpt_oss(), LoraArguments(use_lora=True, lora_rank=2), False, dropout_given=True)


def test_a_merge_of_gpt_oss_experts_adapters_is_the_adapted_model() -> None:
    peft_model = apply_lora(tiny_gpt_oss(), LoraArguments(use_lora=True, lora_rank=2, lora_dropout=0.0), False)
    ids, plain = merge_is_the_adapted_model(peft_model, tiny_gpt_oss)
    with torch.no_grad(), peft_model.disable_adapter():
        torch.testing.assert_close(peft_model(input_ids=ids).logits, plain)
