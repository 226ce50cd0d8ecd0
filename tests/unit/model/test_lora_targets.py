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
    peft_model = apply_lora(tiny_gpt_oss(), LoraArguments(use_lora=True, lora_rank=2), dropout_given=False)
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
        apply_lora(tiny_gpt_oss(), LoraArguments(use_lora=True, lora_rank=2), dropout_given=True)


def test_a_merge_of_gpt_oss_experts_adapters_is_the_adapted_model() -> None:
    peft_model = apply_lora(tiny_gpt_oss(), LoraArguments(use_lora=True, lora_rank=2, lora_dropout=0.0))
    ids, plain = merge_is_the_adapted_model(peft_model, tiny_gpt_oss)
    with torch.no_grad(), peft_model.disable_adapter():
        torch.testing.assert_close(peft_model(input_ids=ids).logits, plain)


DEEPSEEK = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 8, "max_position_embeddings": 64,
            "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
            "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "kv_lora_rank": 8, "q_lora_rank": 16,
            "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8}
DENSE_AND_SHARED = [f"model.layers.0.mlp.{p}" for p in ("down_proj", "gate_proj", "up_proj")] + [
    f"model.layers.1.mlp.shared_experts.{p}" for p in ("down_proj", "gate_proj", "up_proj")]


def tiny_deepseek() -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model("deepseek_v3", **DEEPSEEK))


def adapted_layers(peft_model: torch.nn.Module) -> set[str]:
    return {name.split(".lora_")[0].removeprefix("base_model.model.").replace(".base_layer", "")
            for name, param in peft_model.named_parameters() if param.requires_grad and ".lora_A" in name}


def test_all_linear_on_deepseek_adapts_its_dense_layers_and_shared_experts(tmp_path) -> None:
    """peft's v4-to-v5 MoE conversion turns every target named gate_proj/up_proj/down_proj into the routed experts'
    fused parameters: all-linear on DeepSeek-V3 (GLM-4.5, Qwen3-Next, ERNIE-4.5-MoE, ...) left the dense first layers'
    MLP and every shared expert without an adapter (found by a family sweep). They are adapted now, and the saved
    adapter loads back whole where open_sft loads it (generate/chat/compare, merge-lora): same logits."""
    import peft
    from packaging.version import Version
    from peft import PeftModel

    from open_sft.model.lora_targets import linear_targets_kept

    model = apply_lora(tiny_deepseek(), LoraArguments(use_lora=True), dropout_given=False)
    adapted = adapted_layers(model)
    assert set(DENSE_AND_SHARED) <= adapted, sorted(adapted)
    assert {"model.layers.1.mlp.experts", "model.layers.1.self_attn.q_b_proj"} <= adapted
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    model.save_pretrained(tmp_path)
    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(0))
    expected = model.eval()(input_ids=ids).logits
    with linear_targets_kept():
        loaded = PeftModel.from_pretrained(tiny_deepseek(), str(tmp_path)).eval()
    assert {n.split(".lora_")[0] for n, _ in loaded.named_parameters() if ".lora_A" in n} >= {
        f"base_model.model.{name}" for name in DENSE_AND_SHARED}
    torch.testing.assert_close(loaded.eval()(input_ids=ids).logits, expected)
    # peft 0.21 alone drops them (why open_sft wraps its conversion); peft 0.22 keeps them itself (its PR #3945)
    without = PeftModel.from_pretrained(tiny_deepseek(), str(tmp_path)).eval()
    kept_by_peft = any("shared_experts" in n and ".lora_A" in n for n, _ in without.named_parameters())
    assert kept_by_peft == (Version(peft.__version__) >= Version("0.22")), peft.__version__
    if kept_by_peft:
        torch.testing.assert_close(without(input_ids=ids).logits, expected)


def test_all_linear_on_a_family_peft_does_not_convert_adapts_every_linear_layer() -> None:
    """The conversion kept as it was where peft does not convert: all-linear stays every linear layer of Llama."""
    config = AutoConfig.for_model("llama", **{k: GPT_OSS[k] for k in list(GPT_OSS)[:7]})
    torch.manual_seed(0)
    model = apply_lora(AutoModelForCausalLM.from_config(config), LoraArguments(use_lora=True))
    assert adapted_layers(model) == {f"model.layers.{i}.{part}" for i in range(2) for part in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
        "mlp.down_proj")}


def test_all_linear_on_llama4_adapts_its_router_as_a_weight() -> None:
    """Llama-4's router is an nn.Linear subclass whose forward returns a tuple: all-linear handed it to peft both as
    a weight (lora_targets.parameter_targets) and as a linear layer, and every Llama-4 LoRA run was refused ('not a
    valid target', with advice about Mamba blocks). It is adapted as a weight alone now, and trains."""
    from open_sft.model.lora_targets import adapted_parameters, linear_routers

    config = AutoConfig.for_model("llama4_text", vocab_size=96, hidden_size=32, intermediate_size=64,
                                  intermediate_size_mlp=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=8, num_local_experts=2)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config)
    assert linear_routers(base) == [f"model.layers.{i}.feed_forward.router" for i in range(2)]
    model = apply_lora(base, LoraArguments(use_lora=True), dropout_given=False)
    assert [p.removeprefix("base_model.model.") for p in adapted_parameters(model)] == sorted(
        f"model.layers.{i}.feed_forward.{w}" for i in range(2) for w in ("experts.down_proj", "experts.gate_up_proj",
                                                                          "router.weight"))
    assert {f"model.layers.{i}.feed_forward.shared_expert.gate_proj" for i in range(2)} <= adapted_layers(model)
    ids = torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad and "layers.0" in n)


def test_an_exported_deepseek_checkpoints_skeleton_keeps_the_dense_and_shared_adapters(tmp_path) -> None:
    """`open_sft export` of an all-linear LoRA step checkpoint of DeepSeek-V3 built its skeleton with peft's
    conversion alone, which maps gate_proj/up_proj/down_proj to the routed experts: the dense layer-0 MLP's and the
    shared experts' adapters were left out of the export and the merge. The skeleton adapts what training did."""
    from open_sft.export.from_checkpoint import _peft_skeleton

    model = apply_lora(tiny_deepseek(), LoraArguments(use_lora=True), dropout_given=False)
    model.save_pretrained(tmp_path)
    model.base_model.model.config.save_pretrained(tmp_path)
    skeleton = _peft_skeleton(tmp_path)
    with_adapter = {name.split(".lora_")[0].removeprefix("base_model.model.").replace(".base_layer", "")
                    for name, _ in skeleton.named_parameters() if ".lora_A" in name}  # inference mode: frozen
    assert with_adapter == adapted_layers(model)
    assert set(DENSE_AND_SHARED) <= with_adapter


def test_an_export_merges_a_gpt_oss_checkpoints_expert_adapters_on_its_meta_skeleton(tmp_path) -> None:
    """`open_sft export --merge` of a LoRA step checkpoint of an MoE with adapters on its fused experts (peft's
    ParamWrapper) stopped with "Cannot copy out of meta tensor": the delta was computed on the weightless skeleton's
    device. It is the live model's merge, expert for expert."""
    from open_sft.export.from_checkpoint import _peft_skeleton
    from open_sft.export.lora_merge import merged_state_dict

    model = apply_lora(tiny_gpt_oss(), LoraArguments(use_lora=True, lora_rank=2, lora_dropout=0.0))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    model.save_pretrained(tmp_path)
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    expected = merged_state_dict(model, state)
    # a bf16 checkpoint's config builds a bf16 skeleton, whose dtype peft cast the experts' deltas to (7.6e-3 off)
    for dtype in (torch.float32, torch.bfloat16):
        config = model.base_model.model.config
        config.dtype = dtype
        config.save_pretrained(tmp_path)
        merged = merged_state_dict(_peft_skeleton(tmp_path), state)
        assert merged.keys() == expected.keys()
        for name in expected:
            torch.testing.assert_close(merged[name], expected[name], rtol=0, atol=0, msg=f"{name} ({dtype})")
    base = "model.layers.0.mlp.experts.gate_up_proj"
    (before,) = [t for n, t in state.items() if n.endswith("gate_up_proj") and "layers.0.mlp.experts." in n]
    assert not torch.equal(merged[base], before)  # the experts' adapter is in it


def test_a_peft_without_its_private_conversion_function_trains_and_says_what_is_not_kept(monkeypatch, caplog) -> None:
    """linear_targets_kept patches peft's private _convert_peft_config_moe on every LoRA run, and peft has no upper
    bound: a peft without it stopped every LoRA run with an AttributeError. It is skipped, said once a process."""
    import logging

    from peft.utils import transformers_weight_conversion

    from open_sft.model import lora_targets

    monkeypatch.delattr(transformers_weight_conversion, "_convert_peft_config_moe")
    monkeypatch.setattr(lora_targets, "_warned", set(), raising=False)
    caplog.set_level(logging.WARNING, logger="open_sft.model.lora_targets")
    for _ in range(2):
        with lora_targets.linear_targets_kept():
            pass
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith(
        "this peft has no peft.utils.transformers_weight_conversion._convert_peft_config_moe"), said
    assert "the dense first layers' MLP and the shared experts may be left without an adapter" in said[0]
    model = apply_lora(tiny_gpt_oss(), LoraArguments(use_lora=True, lora_rank=2), dropout_given=False)
    assert set(model.peft_config["default"].target_parameters) == set(HELD)


@pytest.mark.parametrize("family", ["nemotron_h", "falcon_h1"])
def test_all_linear_on_a_mamba_family_leaves_out_the_layers_peft_refuses(family, caplog) -> None:
    """peft refuses LoRA on a Mamba block's out_proj in these model types, so every all-linear LoRA run of
    Nemotron-H, Falcon-H1 (and Mamba, Mamba-2, Falcon-Mamba) was refused ('Module out_proj is incompatible with
    Mamba-based models'; found by a family sweep). all-linear adapts every other linear layer now, and says which it
    left out; a named out_proj is still refused with peft's reason."""
    from unit.model.test_packing_leaks import tiny

    base = tiny(family)
    linear = {n for n, m in base.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    out_proj = {n for n in linear if n.endswith(".out_proj")}
    assert out_proj and linear - out_proj
    with caplog.at_level("INFO", logger="open_sft.model.lora"):
        model = apply_lora(base, LoraArguments(use_lora=True, lora_dropout=0.0))
    assert adapted_layers(model) == linear - out_proj
    said = f"all-linear leaves the Mamba blocks' out_proj without an adapter ({len(out_proj)} of the linear layers)"
    assert said in caplog.text
    ids = torch.randint(3, 96, (1, 8), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    trained = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert all(g is not None for g in trained.values())  # lora_B, zero at start, is what moves first
    assert all(g.abs().sum() > 0 for n, g in trained.items() if ".lora_B." in n)
    with pytest.raises(UserError, match="out_proj' is incompatible with Mamba-based models"):
        apply_lora(tiny(family), LoraArguments(use_lora=True, lora_target_modules=["in_proj", "out_proj"]))


@pytest.mark.parametrize("family", ["mamba", "falcon_mamba", "jamba"])
def test_all_linear_leaves_out_a_dt_proj_the_mamba_mixer_reads_as_a_weight(family, caplog) -> None:
    """These mixers' torch path computes `dt_proj.weight @ time_step`, never calling the layer: all-linear's adapter
    on every dt_proj trained nothing (its lora_B got no gradient, found by a family sweep). all-linear leaves dt_proj
    out now and says so; every adapter it makes gets a gradient."""
    from unit.model.test_packing_leaks import tiny

    base = tiny(family)
    dt_proj = {n for n, m in base.named_modules() if n.endswith(".dt_proj")}
    assert dt_proj
    with caplog.at_level("INFO", logger="open_sft.model.lora"):
        model = apply_lora(base, LoraArguments(use_lora=True, lora_dropout=0.0))
    assert not adapted_layers(model) & dt_proj and adapted_layers(model)
    assert "dt_proj" in caplog.text.split("all-linear leaves the Mamba blocks' ")[1].split(" without")[0]
    ids = torch.randint(3, 96, (1, 8), generator=torch.Generator().manual_seed(0))
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    untrained = [n for n, p in model.named_parameters() if ".lora_B." in n and (p.grad is None or not p.grad.any())]
    assert untrained == []
