"""The preflight's view of a pipeline-parallel run (--pipeline_parallel_size): a rank holds one stage, so the
estimate counts the heaviest stage's parameters, gradients and optimizer states, and the activations of as many
micro-batches as the first stage keeps in flight (1F1B: up to one per stage; GPipe: all the replica's
micro-batches of the step; interleaved 1F1B is counted as 1F1B)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class StageView:
    stages: int
    fraction: float  # the heaviest stage's share of the model's parameters
    layers: int  # decoder layers of the heaviest stage
    in_flight: int  # micro-batches whose activations the first stage holds at once

    def describe(self, replicas: int, schedule: str, sharded: bool = False) -> str:
        how = " (each stage FSDP2-sharded over them)" if sharded else ""
        return (f"  parallel layout: pipeline parallel {self.stages} stages × {replicas} data-parallel replica(s){how}, "
                f"schedule {schedule}: the heaviest stage holds {self.fraction:.0%} of the parameters "
                f"({self.layers} decoder layers), the first keeps {self.in_flight} micro-batch(es) in flight; the "
                "estimate is per rank")


def stage_view(model: torch.nn.Module, train: Any) -> StageView:
    """Where the stages would split this model (the split the run makes) and what its heaviest stage holds."""
    from open_sft.distributed.pipeline_plan import plan_stages

    ranges, sizes = plan_stages(model, train)
    layers, first, last = sizes.layers, sizes.first, sizes.last
    size, virtual = train.pipeline_parallel_size, train.pipeline_virtual_stages
    per_rank = [0] * size
    layers_per_rank = [0] * size
    for index, span in enumerate(ranges):
        position = index % size
        per_rank[position] += sum(layers[i] for i in span) + (first if index == 0 else 0) + (
            last if index == len(ranges) - 1 else 0)
        layers_per_rank[position] += len(span)
    heaviest = max(range(size), key=per_rank.__getitem__)
    micro_batches = size * train.gradient_accumulation_steps  # a replica's micro-batches in one step
    in_flight = micro_batches if train.pipeline_schedule == "gpipe" else min(size, micro_batches)
    total = sum(layers) + first + last
    return StageView(size * virtual, per_rank[heaviest] / max(total, 1), layers_per_rank[heaviest], in_flight)
