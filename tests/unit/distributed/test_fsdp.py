"""The FSDP2 launch side: what the launch asked for, what is refused with its fix, the plugin open_sft builds, the
engine in the resume identity and the per-rank memory model (training itself: tests/integration/test_fsdp.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from open_sft.config.parse import parse_config
from open_sft.distributed import fsdp
from open_sft.distributed.parallelism import Parallelism
from open_sft.errors import UserError
from open_sft.preflight.memory import ModelShape, RunShape, estimate_memory
from open_sft.training.resume import IDENTITY_BEFORE_RECORDED as BEFORE, check_compatible, run_identity


def config(*flags: str):
    return parse_config(["--model_name_or_path", "m", "--dataset_mixer_list", "d.jsonl", "1.0", *flags])


def test_request_is_read_from_accelerates_variables() -> None:
    assert fsdp.fsdp_request({}) is None
    assert fsdp.fsdp_request({"ACCELERATE_USE_FSDP": "false", "FSDP_VERSION": "2"}) is None
    settings = fsdp.fsdp_request({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_OFFLOAD_PARAMS": "false",
                                  "OTHER": "x"})
    assert settings == {"version": "2", "offload_params": "false"}


def test_fsdp1_is_refused_with_the_fix() -> None:
    with pytest.raises(UserError, match=r"FSDP version 1 was asked for .*--fsdp_version 2.*fsdp2.yaml"):
        fsdp.fsdp_request({"ACCELERATE_USE_FSDP": "true"})


def test_data_and_tensor_parallel_layouts_of_a_parallelism_config() -> None:
    hsdp = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "2",
            "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2"}
    assert fsdp.parallelism_problems(hsdp) == []
    assert fsdp.parallelism_problems({**hsdp, "PARALLELISM_CONFIG_TP_SIZE": "2"}) == []  # distributed.tensor_parallel
    assert fsdp.parallelism_problems({"PARALLELISM_CONFIG_CP_SIZE": "2"}) == []  # no --use_parallelism_config
    problems = fsdp.parallelism_problems({**hsdp, "PARALLELISM_CONFIG_CP_SIZE": "2", "PARALLELISM_CONFIG_SP_SIZE": "1"})
    assert problems == ["--parallelism_config_cp_size 2: FSDP2 trains with data parallelism (dp_replicate × dp_shard, "
                        "HSDP) and tensor parallelism (tp) only; drop it"]
    fsdp_launch = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}
    assert fsdp.fsdp_request({**fsdp_launch, **hsdp}) == {"version": "2"}
    with pytest.raises(UserError, match="^FSDP2: --parallelism_config_sp_size 2"):
        fsdp.fsdp_request({**fsdp_launch, **hsdp, "PARALLELISM_CONFIG_SP_SIZE": "2"})


def test_what_fsdp2_cannot_do_is_named_with_its_fix() -> None:
    plain = config()
    assert fsdp.fsdp_problems(plain.train, plain.lora, torch.float32) == []
    assert fsdp.fsdp_problems(plain.train, plain.lora, torch.bfloat16) == []
    assert fsdp.fsdp_problems(config("--use_lora").train, config("--use_lora").lora, torch.float32) == []
    cases = {("--sequence_parallel_size", "2"): "DeepSpeed Ulysses", ("--use_qlora",): "--use_qlora under FSDP2",
             ("--auto_micro_batch_size",): "--per_device_train_batch_size instead"}
    for flags, phrase in cases.items():
        c = config(*flags)
        problems = fsdp.fsdp_problems(c.train, c.lora, torch.float32)
        assert len(problems) == 1 and phrase in problems[0], (flags, problems)
    assert "bfloat16 or float32" in fsdp.fsdp_problems(plain.train, plain.lora, torch.float16)[0]


def test_the_qlora_advice_names_only_launches_that_run_qlora() -> None:
    """FSDP2's refusal of --use_qlora advised DeepSpeed ZeRO-2, which the launch check refuses for QLoRA too (every
    DeepSpeed stage): it names DDP and one process, and the launch check takes both."""
    from open_sft.config.launch import LaunchPlan
    from open_sft.config.launch_check import QLORA_UNDER_DEEPSPEED, launch_problems

    c = config("--use_qlora")
    assert fsdp.fsdp_problems(c.train, c.lora, torch.bfloat16) == [
        "--use_qlora under FSDP2: 4-bit weights cannot be sharded into DTensors here; use --use_lora, or train QLoRA "
        "with DDP (accelerate launch --multi_gpu --num_processes N finetune.py ...) or in one process (python "
        "finetune.py ...)"]
    for parallelism in (Parallelism("ddp", 2, dp_replicate=2), Parallelism("single", 1)):
        assert launch_problems(c, LaunchPlan(c.train, torch.bfloat16, None, parallelism), None) == []
    deepspeed = LaunchPlan(c.train, torch.bfloat16, {"zero_optimization": {"stage": 2}},
                           Parallelism("deepspeed", 2, dp_shard=2))
    assert QLORA_UNDER_DEEPSPEED in launch_problems(c, deepspeed, None)


@pytest.fixture
def llama() -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1))


@pytest.fixture
def launch_env(monkeypatch):
    for name in [n for n in __import__("os").environ if n.startswith("FSDP_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    return monkeypatch


def test_plugin_shards_transformer_blocks_and_checkpoints_sharded(llama, launch_env) -> None:
    launch_env.setenv("FSDP_STATE_DICT_TYPE", "FULL_STATE_DICT")
    plugin = fsdp.build_plugin("no", 1)
    fsdp.adopt_model(plugin, llama)
    assert plugin.fsdp_version == 2
    assert plugin.transformer_cls_names_to_wrap == ["LlamaDecoderLayer"]  # accelerate's default: one unit
    assert plugin.state_dict_type.name == "SHARDED_STATE_DICT"  # checkpoints stay sharded; the export gathers
    assert plugin.mixed_precision_policy is None
    assert fsdp.offloads(plugin) is False


def test_plugin_keeps_the_launchs_own_units(llama, launch_env) -> None:
    launch_env.setenv("FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP")
    launch_env.setenv("FSDP_TRANSFORMER_CLS_TO_WRAP", "LlamaMLP")
    plugin = fsdp.build_plugin("no", 1)
    fsdp.adopt_model(plugin, llama)
    assert plugin.transformer_cls_names_to_wrap == ["LlamaMLP"]


def test_bf16_computes_on_fp32_masters_and_reduces_in_fp32(launch_env) -> None:
    policy = fsdp.build_plugin("bf16", 1).mixed_precision_policy
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32


def test_offload_is_kept_on_gpus_and_dropped_on_cpu_ranks(launch_env) -> None:
    launch_env.setenv("FSDP_OFFLOAD_PARAMS", "true")
    assert fsdp.offloads(fsdp.build_plugin("no", 1)) is torch.cuda.is_available()


def test_each_engine_records_its_checkpoint_format_and_only_the_portable_ones_change(tmp_path) -> None:
    engines = [run_identity(config(), "key", Parallelism(kind, 2))["engine"]
               for kind in ("deepspeed", "fsdp2", "ddp", "single")]
    assert engines == ["deepspeed", "fsdp2", "torch", "torch"]
    check_compatible(tmp_path, {"engine": "fsdp2"}, {"engine": "deepspeed", **BEFORE})  # converted by name
    with pytest.raises(UserError, match="training engine .*checkpoint 'pipeline', now 'deepspeed'"):
        check_compatible(tmp_path, {"engine": "pipeline"}, {"engine": "deepspeed", **BEFORE})
    check_compatible(tmp_path, {}, {"engine": "deepspeed", **BEFORE})  # written before the engine was recorded
    with pytest.raises(UserError, match="--sequence_parallel_size .*checkpoint 1, now 2"):
        check_compatible(tmp_path, {}, {**BEFORE, "sequence_parallel_size": 2})  # before SP was recorded: SP 1


def shape(**kw) -> ModelShape:
    base = dict(params=1_000_000, trainable=1_000_000, param_bytes=4_000_000, largest_param=64_000,
                matmul_params=900_000, hidden=100, layers=10, intermediate=300, vocab=500)
    return ModelShape(**{**base, **kw})


def test_fsdp2_memory_shards_states_and_gathers_one_block() -> None:
    def run(world: int, bf16: bool = False) -> RunShape:
        return RunShape(world, 0, False, bf16, 512, 512, False, fsdp=True)

    one, four = estimate_memory(shape(), run(1), 0), estimate_memory(shape(), run(4), 0)
    block, root = (1_000_000 - 2 * 500 * 100) // 10, 1_000_000 - 10 * 90_000
    assert four.parameters == 4_000_000 // 4 + 4 * (root + 2 * block)
    assert four.gradients == 4_000_000 // 4 + 4 * (root + block)
    assert four.optimizer == (8_000_000 + 4_000_000) // 4
    assert one.optimizer == 4 * four.optimizer and four.parameters < one.parameters
    assert estimate_memory(shape(), run(4, bf16=True), 0).parameters == 1_000_000 + 2 * (root + 2 * block)
    lora = estimate_memory(shape(trainable=10_000), run(4), 0)  # frozen base sharded, no gradient for it
    assert lora.gradients == 40_000 // 4 + 40_000 and lora.optimizer == 120_000 // 4
    assert any("FSDP2" in note for note in four.notes)
