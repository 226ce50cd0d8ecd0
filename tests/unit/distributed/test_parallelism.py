"""The one record of how a run is spread: resolved from the environment accelerate hands its workers and the flags,
for every kind of launch (the problems of a launch that cannot run: tests/unit/config/test_launch_check.py)."""

from __future__ import annotations

import pytest
import torch

from open_sft.config.launch import plan_launch
from open_sft.config.parse import parse_config
from open_sft.distributed.parallelism import Parallelism
from open_sft.model.precision import DtypeChoice

DEEPSPEED = {"ACCELERATE_USE_DEEPSPEED": "true"}
FSDP2 = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}
MESH = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true"}


def spread(env: dict[str, str], *flags: str) -> Parallelism:
    config = parse_config(["--model_name_or_path", "m", "--dataset_mixer_list", "d.jsonl", "1.0", *flags])
    plan = plan_launch(config.train, config.model, config.explicit,
                       lambda: DtypeChoice(torch.float32, "auto"), env)
    assert plan.record["parallelism"] == plan.parallelism.to_dict()  # run.json's record of it
    return plan.parallelism


PP = ("--pipeline_parallel_size", "2", "--pipeline_virtual_stages", "2", "--pipeline_schedule", "interleaved_1f1b")


@pytest.mark.parametrize("env, flags, expected", [
    ({}, (), Parallelism("single")),
    ({"WORLD_SIZE": "2"}, (), Parallelism("ddp", 2, dp_replicate=2)),
    ({**DEEPSPEED, "WORLD_SIZE": "2"}, (), Parallelism("deepspeed", 2, zero_stage=2, dp_shard=2)),  # the default
    ({**DEEPSPEED, "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3", "WORLD_SIZE": "4"}, (),
     Parallelism("deepspeed", 4, zero_stage=3, dp_shard=4)),
    ({**FSDP2, "WORLD_SIZE": "4"}, (), Parallelism("fsdp2", 4, dp_shard=4)),
    ({**FSDP2, **MESH, "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "2", "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2",
      "WORLD_SIZE": "4"}, (), Parallelism("fsdp2", 4, dp_replicate=2, dp_shard=2)),
    ({**FSDP2, **MESH, "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2", "PARALLELISM_CONFIG_TP_SIZE": "2", "WORLD_SIZE": "4"},
     (), Parallelism("fsdp2", 4, dp_shard=2, tp=2)),
    ({**DEEPSPEED, "WORLD_SIZE": "4"}, ("--sequence_parallel_size", "2"),
     Parallelism("deepspeed", 4, zero_stage=2, dp_shard=2, sp=2)),
    ({"WORLD_SIZE": "4"}, PP, Parallelism("ddp", 4, dp_replicate=2, pp=2, virtual_stages=2)),
    ({**FSDP2, "WORLD_SIZE": "4"}, ("--pipeline_parallel_size", "2"), Parallelism("fsdp2", 4, dp_shard=2, pp=2)),
])
def test_each_kind_of_launch_gives_its_degrees(env, flags, expected) -> None:
    got = spread(env, *flags)
    assert got == expected
    assert got.dp_replicate * got.dp_shard * got.tp * got.sp * got.pp == got.world_size


def test_the_derived_views() -> None:
    fsdp_tp = Parallelism("fsdp2", 8, dp_replicate=2, dp_shard=2, tp=2)
    assert fsdp_tp.fsdp and not fsdp_tp.deepspeed and fsdp_tp.tp_enabled and not fsdp_tp.pp_enabled
    assert fsdp_tp.dp_replicas == 4 and fsdp_tp.distributed
    assert fsdp_tp.describe() == "8 processes: FSDP2, dp_replicate 2 × dp_shard 2 × tp 2"
    pipeline = Parallelism("ddp", 4, dp_replicate=2, pp=2, virtual_stages=2)
    assert pipeline.pp_enabled and pipeline.stages == 4 and pipeline.ddp
    assert pipeline.describe() == "4 processes: DDP, dp_replicate 2 × dp_shard 1 × pp 2 × 2 virtual stages per rank"
    zero = Parallelism("deepspeed", 2, zero_stage=3, dp_shard=1, sp=2)
    assert zero.sp_enabled and zero.describe() == "2 processes: DeepSpeed ZeRO-3, dp_replicate 1 × dp_shard 1 × sp 2"
    assert Parallelism("single").describe() == "1 process: plain torch, dp_replicate 1 × dp_shard 1"
    assert Parallelism("single").to_dict() == {"engine": "single", "world_size": 1, "zero_stage": 0, "dp_replicate": 1,
                                               "dp_shard": 1, "tp": 1, "sp": 1, "pp": 1, "virtual_stages": 1,
                                               "dp_replicas": 1}


def test_a_launch_that_does_not_divide_is_recorded_as_asked() -> None:
    """The launch check refuses it, naming the flag; the record keeps the degrees asked for."""
    odd = spread({"WORLD_SIZE": "3"}, "--pipeline_parallel_size", "2")
    assert (odd.world_size, odd.pp, odd.dp_replicate) == (3, 2, 1)
