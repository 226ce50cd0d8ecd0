"""How the run is spread over its processes: one typed record, resolved once from the launch and handed on.

The launch asks in three places: `accelerate launch` hands its settings to every worker as environment
variables (WORLD_SIZE; ACCELERATE_USE_DEEPSPEED and the ZeRO stage, read into a DeepSpeed config by
open_sft.config.deepspeed_request; ACCELERATE_USE_FSDP and FSDP_*, read by open_sft.distributed.fsdp; the
ParallelismConfig sizes of `--use_parallelism_config --parallelism_config_<dim>_size`), and finetune.py's own
flags ask for sequence parallelism (--sequence_parallel_size) and pipeline parallelism
(--pipeline_parallel_size, --pipeline_virtual_stages). `resolve` reads them all, once, in
open_sft.config.launch.plan_launch; everything else asks the record (`job.launch.parallelism`), never the
environment nor the Accelerator.

The degrees multiply to the world size on a launch that can run: dp_replicate × dp_shard × tp × sp × pp. A
launch whose degrees do not divide it is recorded as asked (the smaller degrees floored at 1) and refused by
open_sft.config.launch_check, which names every problem at once.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal, Mapping, Optional

from open_sft.distributed.deepspeed import zero_stage
from open_sft.distributed.env import ENV_PARALLELISM, parallelism_size

if TYPE_CHECKING:
    from open_sft.config.args import TrainingArguments

Engine = Literal["single", "ddp", "deepspeed", "fsdp2"]
ENGINE_NAMES = {"single": "plain torch", "ddp": "DDP", "deepspeed": "DeepSpeed", "fsdp2": "FSDP2"}


@dataclass(frozen=True)
class Parallelism:
    engine: Engine
    """single (one plain process), ddp (torch DDP over the launched processes), deepspeed (ZeRO) or fsdp2."""
    world_size: int = 1
    """The number of processes the launch started."""
    zero_stage: int = 0
    """DeepSpeed's ZeRO stage (0 outside DeepSpeed)."""
    dp_replicate: int = 1
    """Data-parallel replicas that each hold whole copies of what they train (FSDP2's HSDP replicas; DDP's ranks)."""
    dp_shard: int = 1
    """Data-parallel ranks each parameter (or ZeRO's optimizer state) is partitioned over: FSDP2's dp_shard,
    ZeRO's data-parallel ranks; 1 under DDP and on one process."""
    tp: int = 1
    """Tensor-parallel degree (accelerate's --parallelism_config_tp_size, beside FSDP2)."""
    sp: int = 1
    """Sequence-parallel degree (--sequence_parallel_size: DeepSpeed Ulysses)."""
    pp: int = 1
    """Pipeline stages across ranks (--pipeline_parallel_size)."""
    virtual_stages: int = 1
    """Pipeline stages per rank (--pipeline_virtual_stages, under the interleaved 1F1B schedule)."""

    @property
    def deepspeed(self) -> bool:
        return self.engine == "deepspeed"

    @property
    def fsdp(self) -> bool:
        return self.engine == "fsdp2"

    @property
    def ddp(self) -> bool:
        return self.engine == "ddp"

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def sp_enabled(self) -> bool:
        return self.sp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def splits_model(self) -> bool:
        """Whether the ranks of a group share one model copy's work: tensor, sequence or pipeline parallelism."""
        return self.tp_enabled or self.sp_enabled or self.pp_enabled

    @property
    def dp_replicas(self) -> int:
        """The data-parallel degree: the groups of ranks that each train on their own data as one model copy (TP,
        SP and the pipeline's stages work inside such a group)."""
        return self.dp_replicate * self.dp_shard

    @property
    def stages(self) -> int:
        """Pipeline stages in all (--pipeline_parallel_size × --pipeline_virtual_stages)."""
        return self.pp * self.virtual_stages

    def describe(self) -> str:
        """One line for the log, e.g. "4 processes: FSDP2, dp_replicate 1 × dp_shard 2 × tp 2"."""
        engine = ENGINE_NAMES[self.engine] + (f" ZeRO-{self.zero_stage}" if self.deepspeed else "")
        degrees = [f"dp_replicate {self.dp_replicate}", f"dp_shard {self.dp_shard}"]
        degrees += [f"{name} {size}" for name, size in (("tp", self.tp), ("sp", self.sp), ("pp", self.pp)) if size > 1]
        if self.virtual_stages > 1:
            degrees.append(f"{self.virtual_stages} virtual stages per rank")
        processes = f"{self.world_size} process{'es' * (self.world_size != 1)}"
        return f"{processes}: {engine}, " + " × ".join(degrees)

    def to_dict(self) -> dict[str, Any]:
        """For run.json: the fields, and the data-parallel degree they give."""
        return {**asdict(self), "dp_replicas": self.dp_replicas}


def resolve(train: TrainingArguments, deepspeed_config: Optional[dict], fsdp: Optional[dict],
            env: Mapping[str, str] = os.environ) -> Parallelism:
    """The run's parallelism from the launch's environment, its DeepSpeed config and FSDP settings (as
    open_sft.config.launch read them) and the flags. Nothing is refused here: open_sft.config.launch_check
    judges the record."""
    world = int(env.get("WORLD_SIZE", "1") or 1)
    tp, sp, pp = parallelism_size("tp", env), train.sequence_parallel_size, train.pipeline_parallel_size
    inner = max(1, tp * sp * pp)
    data = max(1, world // inner)  # data-parallel ranks
    if deepspeed_config is not None:
        engine, replicate, shard = "deepspeed", 1, data
    elif fsdp is not None and env.get(ENV_PARALLELISM, "false").lower() == "true":  # the mesh as the launch gave it
        engine, replicate, shard = "fsdp2", parallelism_size("dp_replicate", env), parallelism_size("dp_shard", env)
    elif fsdp is not None:
        engine, replicate, shard = "fsdp2", 1, data
    else:
        engine, replicate, shard = ("ddp" if world > 1 else "single"), data, 1
    return Parallelism(engine=engine, world_size=world, zero_stage=zero_stage(deepspeed_config),
                       dp_replicate=replicate, dp_shard=shard, tp=tp, sp=sp, pp=pp,
                       virtual_stages=train.pipeline_virtual_stages)
