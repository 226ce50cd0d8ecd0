"""Pipeline parallelism planned before anything runs: the flags checked up front, each stage's decoder layers
(balanced by parameters, or --pipeline_layers), and the process groups of a launched run's replicas and stage
positions (PipelineLayout). The stages themselves are built and run by open_sft.distributed.pipeline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

# --------------------------------------------------------------------------------------------------------------
# What the flags ask, checked up front
# --------------------------------------------------------------------------------------------------------------
def parse_layers(text: Optional[str]) -> Optional[list[int]]:
    """--pipeline_layers '10,20,30' → [10, 20, 30]; ValueError names what is wrong."""
    if text is None:
        return None
    try:
        starts = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise ValueError(f"--pipeline_layers {text!r}: give comma-separated layer indices, e.g. '10,20,30'")
    if not starts or any(b <= a for a, b in zip(starts, starts[1:])) or starts[0] < 1:
        raise ValueError(f"--pipeline_layers {text!r}: the indices must increase and start at 1 or more (each is "
                         "the first layer of a stage after the first)")
    return starts


def pipeline_flag_problems(t: Any) -> list[str]:
    """The pipeline flags on their own (numbers, schedule and virtual stages agreeing)."""
    problems = []
    if t.pipeline_parallel_size < 1:
        problems.append(f"--pipeline_parallel_size must be at least 1, got {t.pipeline_parallel_size}")
    if t.pipeline_virtual_stages < 1:
        problems.append(f"--pipeline_virtual_stages must be at least 1, got {t.pipeline_virtual_stages}")
    elif t.pipeline_schedule == "interleaved_1f1b" and t.pipeline_virtual_stages < 2:
        problems.append("--pipeline_schedule interleaved_1f1b needs --pipeline_virtual_stages 2 or more")
    elif t.pipeline_schedule != "interleaved_1f1b" and t.pipeline_virtual_stages > 1:
        problems.append(f"--pipeline_virtual_stages {t.pipeline_virtual_stages} needs --pipeline_schedule "
                        "interleaved_1f1b")
    try:
        starts = parse_layers(t.pipeline_layers)
    except ValueError as exc:
        return problems + [str(exc)]
    stages = t.pipeline_parallel_size * t.pipeline_virtual_stages
    if starts is not None and len(starts) != stages - 1:
        problems.append(f"--pipeline_layers gives {len(starts) + 1} stages, the pipeline has {stages} "
                        "(--pipeline_parallel_size × --pipeline_virtual_stages)")
    if starts is not None and t.pipeline_parallel_size == 1:
        problems.append("--pipeline_layers needs --pipeline_parallel_size 2 or more")
    return problems


def pipeline_problems(config: Any, world: int, deepspeed: bool, tp: int) -> list[str]:
    """What --pipeline_parallel_size N cannot run with, each with its fix (checked before any model is loaded).
    FSDP2 composes: it shards each stage over its replicas."""
    t, n = config.train, config.train.pipeline_parallel_size
    if n == 1:
        return []
    flag = f"--pipeline_parallel_size {n}"
    problems = []
    if world % n:
        problems.append(f"{flag} must divide the number of processes ({world}): launch a multiple of {n}")
    if deepspeed:
        problems.append(f"{flag} runs on torch's pipelining, not under DeepSpeed: launch without --use_deepspeed "
                        "(the stages' replicas are data parallel among themselves)")
    if tp > 1:
        problems.append(f"{flag} with tensor parallelism: pick one")
    if t.sequence_parallel_size > 1:
        problems.append(f"{flag} with --sequence_parallel_size: Ulysses SP runs on DeepSpeed; pick one")
    if config.lora.use_qlora:
        problems.append(f"{flag} with --use_qlora: 4-bit weights cannot move between devices by stage; use "
                        "--use_lora")
    if t.auto_micro_batch_size:
        problems.append(f"{flag} with --auto_micro_batch_size: it measures the whole model on one rank; give "
                        "--per_device_train_batch_size")
    return problems


def stage_ranges(layer_params: list[int], stages: int, starts: Optional[list[int]] = None, first_extra: int = 0,
                 last_extra: int = 0) -> list[range]:
    """The decoder layers of each stage: from --pipeline_layers, else balanced by parameter count — contiguous
    ranges of at least one layer whose largest stage, counting the embeddings on the first and the final norm
    and LM head on the last (`first_extra`, `last_extra`), is as small as it can be (the earliest such split on
    ties, so equal layers spread evenly with the extra layers on the earlier stages)."""
    count = len(layer_params)
    if stages > count:
        raise ValueError(f"{stages} pipeline stages need at least one of the model's {count} decoder layers "
                         "each: use fewer stages")
    if starts is None:
        starts = _balanced_starts(layer_params, stages, first_extra, last_extra)
    bounds = [0, *starts, count]
    if len(bounds) != stages + 1 or any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"{stages} pipeline stages need at least one of the model's {count} decoder layers "
                         f"each (stage starts {starts}): use fewer stages or other --pipeline_layers")
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def _balanced_starts(layer_params: list[int], stages: int, first_extra: int, last_extra: int) -> list[int]:
    """Two dynamic programmes over (stages used, layers covered): the smallest possible largest stage, then among
    the splits within it the most even one (least sum of squares)."""
    count = len(layer_params)
    prefix = [0]
    for value in layer_params:
        prefix.append(prefix[-1] + value)

    def cost(a: int, b: int, stage: int) -> int:
        return prefix[b] - prefix[a] + (first_extra if stage == 0 else 0) + (last_extra if stage == stages - 1 else 0)

    def solve(combine: Callable[[float, int], float], limit: float) -> tuple[float, list[int]]:
        best = [[math.inf] * (count + 1) for _ in range(stages + 1)]  # best[s][i]: layers [0, i) in s stages
        cut = [[0] * (count + 1) for _ in range(stages + 1)]
        best[0][0] = 0
        for s in range(1, stages + 1):
            for i in range(s, count - (stages - s) + 1):
                for j in range(i - 1, s - 2, -1):  # later cuts first: on ties the earlier stages keep more
                    c = cost(j, i, s - 1)
                    value = combine(best[s - 1][j], c) if c <= limit else math.inf
                    if value < best[s][i]:
                        best[s][i], cut[s][i] = value, j
        starts, i = [], count
        for s in range(stages, 1, -1):
            i = cut[s][i]
            starts.append(i)
        return best[stages][count], starts[::-1]

    largest, _ = solve(max, math.inf)
    return solve(lambda before, c: before + c * c, largest)[1]


@dataclass(frozen=True)
class StageSizes:
    """Parameter counts the split balances: each decoder layer's, and what the end stages hold besides."""

    layers: list[int]
    first: int  # the input embeddings (first stage)
    last: int  # the final norm and the LM head (last stage)


def plan_stages(model: nn.Module, train: Any) -> tuple[list[range], StageSizes]:
    """The split the run makes of `model` (a transformers causal LM, or a peft model around one): each stage's
    decoder layers, from --pipeline_layers or balanced by parameter count, and the sizes it balanced; a
    UserError naming the flag when the model cannot be split so."""
    from open_sft.errors import UserError
    from open_sft.model.anatomy import backbone_of, causal_lm_of, param_numel

    causal_lm = causal_lm_of(model)
    backbone = backbone_of(causal_lm)
    if not isinstance(getattr(backbone, "layers", None), nn.ModuleList):  # Gemma-3 4B-27B: vision + language model
        raise UserError(f"--pipeline_parallel_size: model type {causal_lm.config.model_type!r} "
                        f"({type(causal_lm).__name__}) keeps its decoder layers inside a multimodal model, which "
                        "open_sft does not split into pipeline stages; train it without --pipeline_parallel_size "
                        "(ZeRO-3 or FSDP2 shard it)")

    def params(module: Optional[nn.Module]) -> int:
        return sum(param_numel(p) for p in module.parameters()) if module is not None else 0

    sizes = StageSizes([params(layer) for layer in backbone.layers], params(backbone.embed_tokens),
                       params(backbone.norm) + params(causal_lm.get_output_embeddings()))
    try:
        ranges = stage_ranges(sizes.layers, train.pipeline_parallel_size * train.pipeline_virtual_stages,
                              parse_layers(train.pipeline_layers), sizes.first, sizes.last)
    except ValueError as exc:
        raise UserError(f"--pipeline_parallel_size {train.pipeline_parallel_size}: {exc}")
    return ranges, sizes


# --------------------------------------------------------------------------------------------------------------
# Process groups
# --------------------------------------------------------------------------------------------------------------
@dataclass
class PipelineLayout:
    size: int  # N stage positions (ranks) per replica
    virtual: int  # stages per rank
    replicas: int
    position: int  # this rank's position in its replica's pipeline
    replica: int
    pipe_group: Any  # this replica's N ranks
    replica_group: Any  # the ranks holding this position in every replica (their gradients are summed)
    tied_group: Any  # this replica's first and last rank (tied embeddings), or None

    @property
    def stages(self) -> int:
        return self.size * self.virtual

    def stage_ids(self) -> list[int]:
        """The stages this rank runs: its position, and under interleaving position + N, + 2N, ..."""
        return [self.position + k * self.size for k in range(self.virtual)]

    def replica_ranks(self) -> list[int]:
        return [self.replica * self.size + p for p in range(self.size)]


def build_layout(size: int, virtual: int, tied: bool) -> PipelineLayout:
    """The groups of a launched run (collective: every rank creates every group, in the same order)."""
    dist = torch.distributed
    world, rank = dist.get_world_size(), dist.get_rank()
    replicas = world // size
    pipes = [dist.new_group(list(range(r * size, (r + 1) * size))) for r in range(replicas)]
    by_position = [dist.new_group(list(range(p, world, size))) for p in range(size)]
    ties = [dist.new_group([r * size, r * size + size - 1]) for r in range(replicas)] if tied else []
    replica, position = divmod(rank, size)
    return PipelineLayout(size, virtual, replicas, position, replica, pipes[replica], by_position[position],
                          ties[replica] if tied else None)
