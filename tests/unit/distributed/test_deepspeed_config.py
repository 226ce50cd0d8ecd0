"""resolve_deepspeed_config: every "auto" of a launch's DeepSpeed config filled from the flags, nothing else."""

from __future__ import annotations

import json

import pytest

from conftest import DS_CONFIGS
from open_sft.distributed.deepspeed import find_auto, resolve_deepspeed_config, zero_stage

FLAGS = dict(micro_batch_size=2, gradient_accumulation_steps=3, world_size=4, bf16=True, clip_grad_norm=1.0)


@pytest.mark.parametrize("name", ["zero2.json", "zero3.json", "zero3_offload.json"])
def test_shipped_configs_resolve_completely(name) -> None:
    config = json.loads((DS_CONFIGS / name).read_text())
    resolved = resolve_deepspeed_config(config, **FLAGS, hidden_size=4096)
    assert find_auto(resolved) == []
    assert (resolved["train_micro_batch_size_per_gpu"], resolved["gradient_accumulation_steps"],
            resolved["train_batch_size"], resolved["gradient_clipping"]) == (2, 3, 24, 1.0)
    assert resolved["bf16"]["enabled"] is True and resolved["fp16"]["enabled"] is False
    assert config == json.loads((DS_CONFIGS / name).read_text())  # the input is not modified


def test_bucket_sizes_follow_the_hidden_size_with_a_floor() -> None:
    zero = {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto"}
    big = resolve_deepspeed_config({"zero_optimization": dict(zero)}, **FLAGS, hidden_size=4096)["zero_optimization"]
    assert (big["reduce_bucket_size"], big["stage3_prefetch_bucket_size"],
            big["stage3_param_persistence_threshold"]) == (4096**2, int(0.9 * 4096**2), 40960)
    assert big["stage3_gather_16bit_weights_on_model_save"] is True  # the export gathers full weights
    tiny = resolve_deepspeed_config({"zero_optimization": dict(zero)}, **FLAGS, hidden_size=64)["zero_optimization"]
    assert tiny["reduce_bucket_size"] == tiny["stage3_prefetch_bucket_size"] == 1 << 20  # not thousands of collectives
    unknown = resolve_deepspeed_config({"zero_optimization": dict(zero)}, **FLAGS)["zero_optimization"]
    assert unknown["reduce_bucket_size"] == 500_000_000  # DeepSpeed's own default


def test_clipping_off_and_fp32() -> None:
    resolved = resolve_deepspeed_config({"zero_optimization": {"stage": 2}, "gradient_clipping": "auto"},
                                        **{**FLAGS, "bf16": False, "clip_grad_norm": -1})
    assert resolved["gradient_clipping"] == 0.0 and resolved["bf16"]["enabled"] is False


@pytest.mark.parametrize("config, message", [
    ({"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 8}, "train_micro_batch_size_per_gpu=8"),
    ({"zero_optimization": {"stage": 2}, "bf16": {"enabled": False}}, "bf16.enabled=False conflicts with the compute dtype"),
    ({"zero_optimization": {"stage": 2}, "fp16": {"enabled": "true"}}, r"fp16.enabled='true' conflicts with the compute dtype \(bf16=True, fp16=False\)"),
    ({"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW"}}, "must not contain 'optimizer'"),
    ({"bf16": {"enabled": "auto"}}, "needs a zero_optimization section"),
    ({"zero_optimization": {"stage": 2, "sub_group_size": "auto"}}, "zero_optimization.sub_group_size"),
])
def test_what_the_launch_plan_should_have_settled_is_refused(config, message) -> None:
    """plan_launch reports these to the user first; reaching here is a bug, and it must not train silently."""
    with pytest.raises(ValueError, match=message):
        resolve_deepspeed_config(config, **FLAGS)


def test_fp16_fills_dynamic_loss_scaling_and_keeps_the_users_settings() -> None:
    flags = {**FLAGS, "bf16": False, "fp16": True}
    resolved = resolve_deepspeed_config({"zero_optimization": {"stage": 2}}, **flags)
    assert resolved["bf16"] == {"enabled": False}
    # Dynamic scale from 2^16, halved at the first overflow (hysteresis 1), never below 1.
    assert resolved["fp16"] == {"enabled": True, "loss_scale": 0, "initial_scale_power": 16,
                                "loss_scale_window": 1000, "hysteresis": 1, "min_loss_scale": 1}
    mine = resolve_deepspeed_config({"zero_optimization": {"stage": 2},
                                     "fp16": {"enabled": "auto", "hysteresis": 2, "initial_scale_power": 12}}, **flags)
    assert (mine["fp16"]["hysteresis"], mine["fp16"]["initial_scale_power"], mine["fp16"]["min_loss_scale"]) == (2, 12, 1)
    assert "loss_scale" not in resolve_deepspeed_config({"zero_optimization": {"stage": 2}}, **FLAGS)["fp16"]


@pytest.mark.parametrize("config, stage", [(None, 0), ({}, 0), ({"zero_optimization": {}}, 0),
                                           ({"zero_optimization": {"stage": 2}}, 2),
                                           ({"zero_optimization": {"stage": "3"}}, 3)])
def test_zero_stage_reads_absent_and_hand_written_stages(config, stage) -> None:
    assert zero_stage(config) == stage


def test_the_shipped_configs_stages() -> None:
    assert [zero_stage(json.loads((DS_CONFIGS / f"{n}.json").read_text())) for n in ("zero2", "zero3")] == [2, 3]
