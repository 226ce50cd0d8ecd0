"""Tensor parallelism's launch side: the size read from accelerate's variables, what is refused with its fix, the
plugin setting it turns off, the plan for LoRA layers, the resume identity and the memory model (training:
integration/test_tensor_parallel)."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, LlamaConfig

from open_sft.config.parse import parse_config
from open_sft.distributed import fsdp, tensor_parallel
from open_sft.distributed.parallelism import Parallelism, resolve
from open_sft.errors import UserError
from open_sft.preflight.estimate import Preflight
from open_sft.preflight.memory import ModelShape, RunShape, estimate_memory
from open_sft.training.resume import IDENTITY_BEFORE_RECORDED as BEFORE, check_compatible, run_identity

LAYOUT = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2",
          "PARALLELISM_CONFIG_TP_SIZE": "2"}
LLAMA = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=128)


def config(*flags: str):
    return parse_config(["--model_name_or_path", "m", "--dataset_mixer_list", "d.jsonl", "1.0", *flags])


def problems(tp: int = 2, world: int = 4, fsdp_on: bool = True, *flags: str, model=LLAMA, env=LAYOUT) -> list[str]:
    c = config(*flags)
    spread = resolve(c.train, None, {"version": "2"} if fsdp_on else None,
                     {**env, "WORLD_SIZE": str(world), "PARALLELISM_CONFIG_TP_SIZE": str(tp)})
    return tensor_parallel.tensor_parallel_problems(spread, c.train, c.lora, model)


def test_the_size_is_accelerates_parallelism_config() -> None:
    train = config().train
    assert resolve(train, None, None, {}).tp == 1
    assert resolve(train, None, None, {"PARALLELISM_CONFIG_TP_SIZE": "2"}).tp == 1  # no --use_parallelism_config
    assert resolve(train, None, None, {**LAYOUT, "WORLD_SIZE": "2"}).tp == 2


def test_a_llama_under_fsdp2_with_room_to_shard_is_accepted() -> None:
    assert problems() == []
    assert problems(tp=1, fsdp_on=False) == []  # no TP: nothing to check


def test_what_tensor_parallel_cannot_do_is_named_with_its_fix() -> None:
    assert problems(fsdp_on=False) == ["--parallelism_config_tp_size 2 runs combined with FSDP2: launch with "
                                       "`--use_fsdp --fsdp_version 2` (configs/accelerate/fsdp2_tp.yaml)"]
    assert problems(world=3, env={**LAYOUT, "PARALLELISM_CONFIG_DP_SHARD_SIZE": "1"}) == [
        "--parallelism_config_tp_size 2 must divide the number of processes (3)"]
    only_tp = problems(world=2, env={**LAYOUT, "PARALLELISM_CONFIG_DP_SHARD_SIZE": "1"})
    assert only_tp == ["--parallelism_config_tp_size 2 needs FSDP2 to shard over at least 2 ranks (accelerate's rule "
                       "for TP under FSDP): launch at least 4 processes with dp_shard 2 or more"]
    unsharded = problems(world=8, env={**LAYOUT, "PARALLELISM_CONFIG_DP_SHARD_SIZE": "1",
                                       "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "2"})
    assert unsharded[0].endswith("pass --parallelism_config_dp_shard_size 2 (dp_replicate × dp_shard × tp = 8 "
                                 "processes)")
    assert problems(2, 4, True, "--use_lora") == []  # the adapters follow their layers' slices (with_adapters)
    assert problems(2, 4, True, "--use_qlora") == ["--parallelism_config_tp_size 2 with --use_qlora: 4-bit weights "
                                                   "cannot be sliced into DTensors; use --use_lora"]
    odd_heads = LlamaConfig(hidden_size=48, num_attention_heads=3, num_key_value_heads=1, vocab_size=128)
    assert problems(model=odd_heads) == [
        "--parallelism_config_tp_size 2 must divide the model's num_attention_heads (3): each rank attends with 1/2 "
        "of the heads",
        "--parallelism_config_tp_size 2 must divide the model's num_key_value_heads (1): each rank attends with 1/2 "
        "of the heads"]
    no_plan = problems(model=GPT2Config(n_head=4))
    assert no_plan == ["--parallelism_config_tp_size 2: the model (gpt2) has no tensor-parallel plan in transformers "
                       "(base_model_tp_plan); drop TP and shard with FSDP2 alone"]


def test_a_model_whose_head_is_its_embedding_is_refused_before_it_loads() -> None:
    """Llama-3.2 1B/3B, Qwen2.5 0.5B-3B, Qwen3 0.6B-4B and Gemma tie the LM head to the embeddings: transformers'
    plan names lm_head.weight, which the model holds only as model.embed_tokens.weight, and every rank crashed with
    KeyError 'lm_head.weight' after loading. Refused with the launch's other problems (a multimodal config by its
    text model's flag); a tie the config does not announce is refused by apply, not a KeyError."""
    from transformers import AutoConfig, LlamaForCausalLM

    tied = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                       tie_word_embeddings=True)
    refusal = ("--parallelism_config_tp_size 2: the model ties its LM head to its input embeddings "
               "(tie_word_embeddings, as Llama-3.2 1B/3B, Qwen2.5 0.5B-3B, Qwen3 0.6B-4B and Gemma do), which tensor "
               "parallelism cannot split as one weight; drop TP and shard with FSDP2 alone")
    assert problems(model=tied) == [refusal]
    assert problems(model=AutoConfig.for_model("gemma3_text")) == [refusal]
    untied_text = AutoConfig.for_model("mistral3")  # tie_word_embeddings true, its text model's false
    untied_text.base_model_tp_plan = untied_text.text_config.base_model_tp_plan
    assert problems(model=untied_text) == []
    assert problems(tp=1, fsdp_on=False, model=tied) == []

    torch.manual_seed(0)
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=64)
    model = LlamaForCausalLM(LlamaConfig(**small, tie_word_embeddings=True))
    model.config.tie_word_embeddings = False  # the weights stay tied: the plan still names the head
    mesh = type("Mesh", (), {"size": lambda self: 2})()
    with pytest.raises(UserError) as info:
        tensor_parallel.apply(model, mesh)
    assert str(info.value) == f"tensor parallelism: {refusal} (lm_head.weight is a second name of a weight)"


def test_a_plan_with_styles_not_verified_here_is_refused_before_the_model_loads() -> None:
    """DeepSeek-V3's plan (mla_kv_a_proj) and Llama 4's (packed_rowwise, moe_tp_experts) were refused by apply, after
    every rank had loaded the whole model; the config's plan is read with the launch's other problems."""
    from transformers import AutoConfig

    deepseek = AutoConfig.for_model("deepseek_v3", num_attention_heads=4, num_key_value_heads=4,
                                    tie_word_embeddings=False)
    assert problems(model=deepseek) == [
        "--parallelism_config_tp_size 2: the model's tp_plan uses mla_kv_a_proj, which open_sft has not verified "
        "under FSDP2 + TP (only colwise, colwise_gather_output, embedding_rowwise, replicated_with_grad_allreduce, "
        "rowwise, rowwise_split_input); drop TP and shard with FSDP2 alone"]
    llama4 = AutoConfig.for_model("llama4_text", num_attention_heads=4, num_key_value_heads=2)
    assert [p.split(",", 1)[0] for p in problems(model=llama4)] == [
        "--parallelism_config_tp_size 2: the model's tp_plan uses moe_tp_experts"]
    assert problems(model=AutoConfig.for_model("qwen3_moe", num_attention_heads=4, num_key_value_heads=2)) == []


def test_heads_given_layer_by_layer_are_checked_layer_by_layer() -> None:
    """Gemma 4 31B's layout: its full-attention layers' key/value heads (num_global_key_value_heads) in transformers
    5's per_layer_config, where reading config.num_key_value_heads raises; every TP launch of it stopped with
    AmbiguousGlobalPerLayerAttributeError. Each layer's count is checked; so are sequence parallelism's and the
    memory model's attention heads, here given per layer too (as dots.llm3's are)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from open_sft.distributed.sequence_parallel import sequence_parallel_problems

    def gemma4(**full_layer):
        return AutoConfig.for_model("gemma4_text", vocab_size=128, hidden_size=64, intermediate_size=128,
                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    per_layer_config={1: {"head_dim": 32, "num_key_value_heads": 1, **full_layer}},
                                    layer_types=["sliding_attention", "full_attention"], sliding_window=8,
                                    vocab_size_per_layer_input=128, hidden_size_per_layer_input=0,
                                    tie_word_embeddings=False)  # the heads alone (a tied head is refused too)

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(gemma4())  # Gemma 4's own code takes per-layer key/value heads only
    gemma4 = model.config = gemma4(num_attention_heads=2)
    assert gemma4.per_layer_attributes == {"head_dim", "num_key_value_heads", "num_attention_heads"}
    assert problems(model=gemma4) == [
        "--parallelism_config_tp_size 2 must divide the model's num_key_value_heads (1): each rank attends with 1/2 "
        "of the heads"]
    assert problems(tp=1, model=gemma4) == []
    assert sequence_parallel_problems(4, 4, True, config(), gemma4, "sdpa") == [
        "--sequence_parallel_size 4 must divide the model's attention heads (2): each rank attends with 1/N of them"]
    assert sequence_parallel_problems(2, 2, True, config(), gemma4, "sdpa") == []
    assert ModelShape.of(model).heads == 4


def test_lora_layers_keep_the_style_on_their_base_and_slice_one_adapter() -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    small = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=64)
    model = get_peft_model(LlamaForCausalLM(small), LoraConfig(r=2, target_modules=["q_proj", "o_proj"]))
    modules = dict(model.get_base_model().named_modules())
    plan = {"model.layers.0.self_attn.q_proj": "colwise", "model.layers.0.self_attn.o_proj": "rowwise",
            "model.layers.0.mlp.up_proj.weight": "colwise", "model.layers.0.mlp.up_proj": "colwise",
            "lm_head.weight": "colwise_gather_output", "lm_head": "colwise_gather_output"}
    q, o = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj"
    assert tensor_parallel.with_adapters(plan, modules) == {
        f"{q}.base_layer.weight": "colwise", f"{q}.base_layer": "colwise",
        f"{q}.lora_B.default.weight": "colwise", f"{q}.lora_B.default": "colwise",  # output columns: lora_B
        f"{o}.base_layer.weight": "rowwise", f"{o}.base_layer": "rowwise",
        f"{o}.lora_A.default.weight": "rowwise", f"{o}.lora_A.default": "rowwise",  # input rows: lora_A
        "model.layers.0.mlp.up_proj.weight": "colwise", "model.layers.0.mlp.up_proj": "colwise",  # no adapter
        "lm_head.weight": "colwise_gather_output", "lm_head": "colwise_gather_output"}
    with pytest.raises(UserError, match=r"LoRA on .*q_proj, which the model's tp_plan shards 'colwise_rep'"):
        tensor_parallel.with_adapters({q: "colwise_rep"}, modules)


def test_a_plan_with_styles_not_verified_here_is_refused() -> None:
    from transformers import LlamaForCausalLM

    small = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=64)
    small.base_model_tp_plan = {**small.base_model_tp_plan, "layers.*.mlp.gate_proj": "packed_colwise"}
    mesh = type("Mesh", (), {"size": lambda self: 2})()
    with pytest.raises(UserError, match=r"^tensor parallelism: the model's tp_plan uses packed_colwise, which open_sft "
                                        r"has not verified under FSDP2 \+ TP \(only colwise, colwise_gather_output, "):
        tensor_parallel.apply(LlamaForCausalLM(small), mesh)


def test_accelerate_gets_the_replicate_style_transformers_5_dropped(monkeypatch) -> None:
    import transformers.integrations.tensor_parallel as hf_tensor_parallel

    monkeypatch.delattr(hf_tensor_parallel, "ReplicateParallel", raising=False)
    tensor_parallel.provide_replicate_parallel()
    assert hf_tensor_parallel.ReplicateParallel is tensor_parallel.ReplicateParallel
    own = type("ReplicateParallel", (), {})
    monkeypatch.setattr(hf_tensor_parallel, "ReplicateParallel", own, raising=False)
    tensor_parallel.provide_replicate_parallel()  # a transformers that has one keeps it
    assert hf_tensor_parallel.ReplicateParallel is own


def test_fsdp2_loads_on_every_rank_under_tensor_parallel(monkeypatch) -> None:
    for name in [n for n in __import__("os").environ if n.startswith("FSDP_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "true")
    assert fsdp.build_plugin("no", 1).cpu_ram_efficient_loading is True
    assert fsdp.build_plugin("no", 2).cpu_ram_efficient_loading is False


def test_a_checkpoint_of_another_tensor_parallel_size_is_not_resumed(tmp_path) -> None:
    assert run_identity(config(), "key", Parallelism("fsdp2", 4, dp_shard=2, tp=2))["tensor_parallel_size"] == 2
    assert run_identity(config(), "key", Parallelism("fsdp2", 4, dp_shard=4))["tensor_parallel_size"] == 1
    with pytest.raises(UserError, match=r"--parallelism_config_tp_size .*checkpoint 1, now 2"):
        check_compatible(tmp_path, {}, {**BEFORE, "tensor_parallel_size": 2})  # before TP was recorded: TP 1


def test_fsdp2_memory_gathers_a_blocks_tensor_parallel_slice() -> None:
    shape = ModelShape(params=1_000_000, trainable=1_000_000, param_bytes=4_000_000, largest_param=64_000,
                       matmul_params=900_000, hidden=100, layers=10, intermediate=300, vocab=500)

    def run(tp: int) -> RunShape:
        return RunShape(4, 0, False, False, 512, 512, False, fsdp=True, tensor_parallel=tp)

    plain, sliced = estimate_memory(shape, run(1), 0), estimate_memory(shape, run(2), 0)
    block, root = (1_000_000 - 2 * 500 * 100) // 10, 1_000_000 - 10 * 90_000
    assert sliced.parameters == 4_000_000 // 4 + 4 * (root + 2 * (block // 2))
    assert plain.parameters - sliced.parameters == 4 * 2 * (block - block // 2)
    assert sliced.optimizer == plain.optimizer  # states were sharded over all 4 ranks either way
    assert any("1/2 tensor-parallel slice" in note for note in sliced.notes)


def test_the_preflight_names_the_layout() -> None:
    layout = {"engine": "fsdp2", "shards": 4, "replicas": 1, "tensor_parallel": 2, "wrap": "LlamaDecoderLayer"}
    memory = estimate_memory(ModelShape(1000, 1000, 4000, 100, 900, 10, 2, 30, 50), RunShape(4, 0, False, False, 8, 8,
                                                                                            False, fsdp=True), 0)
    preflight = Preflight(memory, 2**30, "cpu", [8], world_size=4, fsdp=layout)
    assert preflight.to_dict()["parallel"]["tensor"] == 2
    steps = type("Steps", (), {"steps_per_epoch": 1, "total_steps": 1, "num_epochs": 1,
                               "layout": type("Layout", (), {"micro_batch_size": 1, "gradient_accumulation_steps": 2,
                                                             "world_size": 4, "global_batch_size": 8})()})()
    text = preflight.describe(steps, [0] * 8)
    assert "in 2 FSDP shards × tensor parallel 2 (each TP group of 2 ranks computes its members' micro-batches" in text
