"""Preflight: the per-rank memory a run will need, by component (the memory model: open_sft.preflight.memory; its
wall time: open_sft.preflight.timing).

Printed by --dry_run (which also runs the probe, then exits without writing anything) and at the start
of every run: the process measured before the model is loaded, the memory one rank has, the estimate beside it
and a warning when it is over.
"""

from __future__ import annotations

import dataclasses

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import psutil
import torch

from open_sft.distributed import env
from open_sft.distributed.deepspeed import zero_settings
from open_sft.preflight.memory import MemoryEstimate, ModelShape, RunShape, estimate_memory
from open_sft.preflight.positions import step_slots

if TYPE_CHECKING:
    from open_sft.distributed.parallelism import Parallelism

GIB = 2**30


def process_bytes() -> int:
    """This process's resident memory on CPU (interpreter, libraries, data); 0 on CUDA (device memory)."""
    if torch.cuda.is_available():
        return 0
    return psutil.Process().memory_info().rss


def device_memory_bytes(local_world_size: int, limit_gib: Optional[float] = None) -> tuple[int, str]:
    """Memory one rank can use and what it is: the user's limit, a GPU's total, or this machine's RAM shared
    by its ranks."""
    if limit_gib is not None:
        return int(limit_gib * GIB), "--max_memory_per_rank_gib"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return props.total_memory, props.name
    total = psutil.virtual_memory().total
    return total // max(local_world_size, 1), f"RAM ÷ {local_world_size} local ranks"


def format_memory(estimate: MemoryEstimate, device_bytes: int, device_name: str) -> str:
    def gib(value: int) -> str:
        return f"{value / GIB:8.2f} GiB"

    rows = [("process (measured)", estimate.runtime), ("parameters", estimate.parameters),
            ("gradients", estimate.gradients), ("optimizer states", estimate.optimizer),
            ("activations (peak)", estimate.activations)]
    lines = ["memory estimate per rank:"]
    lines += [f"  {name:<20}{gib(value)}" for name, value in rows]
    lines.append(f"  {'total':<20}{gib(estimate.total)}   (available: {device_bytes / GIB:.2f} GiB, {device_name})")
    lines += [f"  note: {note}" for note in estimate.notes]
    return "\n".join(lines)


def over_budget_warning(estimate: MemoryEstimate, device_bytes: int) -> Optional[str]:
    if estimate.total <= device_bytes:
        return None
    return (f"the estimated memory per rank ({estimate.total / GIB:.2f} GiB) exceeds what a rank has "
            f"({device_bytes / GIB:.2f} GiB): lower --per_device_train_batch_size (and raise "
            "--gradient_accumulation_steps to keep the global batch), turn on --gradient_checkpointing, use "
            "ZeRO-3 (configs/ds/zero3.json) or offload (zero3_offload.json), or LoRA")


# ----------------------------------------------------------------------------------------------
# Putting it together for a run
# ----------------------------------------------------------------------------------------------
def runtime_bytes(uses_deepspeed: bool, uses_lora: bool, uses_qlora: bool) -> int:
    """The process's own memory before the model is loaded, with the libraries the run will import
    (importing deepspeed alone adds a few hundred MB to the resident set)."""
    wanted = [("deepspeed", uses_deepspeed), ("peft", uses_lora or uses_qlora), ("bitsandbytes", uses_qlora)]
    for name, used in wanted:
        if used:
            importlib.import_module(name)
    return process_bytes()


@dataclass
class Preflight:
    memory: MemoryEstimate
    device_bytes: int
    device_name: str
    step_slots: list[int]
    sequence_parallel: int = 1  # --sequence_parallel_size: each rank holds 1/N of every sequence
    world_size: int = 1
    fsdp: Optional[dict] = None  # FSDP2's layout (open_sft.distributed.fsdp.fsdp_layout)
    pipeline: Optional[str] = None  # --pipeline_parallel_size: the stages' line (open_sft.preflight.pipeline_memory)
    pipeline_size: int = 1

    def describe(self, steps: Any, data: Any) -> str:
        layout = steps.layout
        tokens = getattr(getattr(steps, "plan", None), "max_tokens", None)  # --packing: a budget of tokens
        # open-instruct's --packing joins per_device_train_batch_size examples into a row: its steps hold a fixed
        # number of examples, ours a budget of tokens; said here, so a recipe brought over sees its steps change
        per_step = (f"up to {tokens * layout.gradient_accumulation_steps * layout.world_size} tokens per step, "
                    f"~{len(data) / max(steps.steps_per_epoch, 1):.0f} examples on average (open-instruct's "
                    f"--packing: {layout.global_batch_size} examples per step, "
                    f"{-(-len(data) // max(layout.global_batch_size, 1))} steps per epoch; --max_tokens_per_batch "
                    f"sets the budget)") if tokens else f"{layout.global_batch_size} examples per step"
        lines = [
            f"preflight: {len(data)} training examples, {steps.steps_per_epoch} optimizer steps per epoch, "
            f"{steps.total_steps} steps in all ({steps.num_epochs} epoch(s))",
            f"  global batch: {f'up to {tokens} packed tokens' if tokens else layout.micro_batch_size} per "
            f"micro-batch × {layout.gradient_accumulation_steps} accumulation × {layout.world_size} rank(s) = "
            f"{per_step}",
            format_memory(self.memory, self.device_bytes, self.device_name),
        ]
        if self.sequence_parallel > 1:
            lines.insert(2, f"  parallel layout: data parallel {layout.world_size // self.sequence_parallel} × "
                            f"sequence parallel {self.sequence_parallel} (each rank holds 1/{self.sequence_parallel} "
                            "of every sequence; the estimate is per rank)")
        if self.pipeline is not None:
            lines.insert(2, self.pipeline)
        if self.fsdp is not None:
            replicas = f" × {self.fsdp['replicas']} replicas (HSDP)" if self.fsdp["replicas"] > 1 else ""
            tp = self.fsdp.get("tensor_parallel", 1)
            shards = f"{self.fsdp['shards']} shards" if tp == 1 else (
                f"{self.fsdp['shards'] // tp} FSDP shards × tensor parallel {tp} (each TP group of {tp} ranks "
                "computes its members' micro-batches together)")
            lines.insert(2, f"  parallel layout: FSDP2, data parallel {layout.world_size} with every parameter, "
                            f"gradient and optimizer state in {shards}{replicas} (units: "
                            f"{self.fsdp['wrap']}); the estimate is per rank")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"memory": self.memory.to_dict(), "device_bytes": self.device_bytes, "device": self.device_name,
                "parallel": {"data": self.world_size // self.sequence_parallel // self.pipeline_size, "sequence": self.sequence_parallel,
                             "tensor": (self.fsdp or {}).get("tensor_parallel", 1), "pipeline": self.pipeline_size,
                             **({"fsdp": self.fsdp} if self.fsdp is not None else {})}}


def _liger_loss_applies(config: Any, data: Any) -> bool:
    """Where Liger's fused loss will be the LM-head loss for sure (open_sft.model.liger_loss.why_not): on CUDA, a
    plain head (no LoRA, no 4-bit), one source (several log a loss per source); elsewhere our chunked loss."""
    return (config.model.use_liger_kernel and torch.cuda.is_available() and not config.lora.use_lora
            and not config.lora.use_qlora and len(getattr(data, "source_names", [None, None])) == 1)


def estimate_run(config: Any, model: torch.nn.Module, steps: Any, data: Any, ds_config: Optional[dict],
                 bf16: bool, baseline: int, parallelism: Parallelism, fsdp: Optional[dict] = None) -> Preflight:
    """`fsdp`: open_sft.distributed.fsdp.fsdp_layout's layout of an FSDP2 run, else None."""
    slots, largest, width = step_slots(steps, data.lengths(), config.train.packing)
    stage, offload, bucket = zero_settings(ds_config)
    # every position of the largest micro-batch counted as trained: an upper bound for the LM-head loss term
    # bitsandbytes' 4-bit layers keep fp32-sized activations on CPU (measured with bitsandbytes 0.50)
    bf16_activations = bf16 and not (config.lora.use_qlora and not torch.cuda.is_available())
    sp = parallelism.sp  # a rank computes 1/sp of each micro-batch's positions, unmasked
    per_rank = -(-largest // sp)
    if fsdp is not None:
        offload = fsdp["cpu_offload"]
    checkpointing = config.model.gradient_checkpointing or bool(fsdp and fsdp["activation_checkpointing"])
    sharded_over = fsdp["shards"] if fsdp is not None else steps.layout.world_size  # HSDP: replicas hold copies
    pp = parallelism.pp
    if parallelism.pp_enabled:  # a stage's parameters are sharded over its replicas (FSDP2) or held whole by each
        sharded_over = steps.layout.world_size // pp
    shape = RunShape(sharded_over, stage, offload, bf16_activations, per_rank, per_rank,
                     checkpointing, bucket, width if sp == 1 else 0, fsdp=fsdp is not None,
                     tensor_parallel=(fsdp or {}).get("tensor_parallel", 1), on_gpu=torch.cuda.is_available(),
                     liger=config.model.use_liger_kernel, compiled=config.model.torch_compile,
                     liger_loss=_liger_loss_applies(config, data))
    model_shape, pipeline = ModelShape.of(model), None
    if parallelism.pp_enabled:  # one stage a rank, several micro-batches in flight
        from open_sft.preflight.pipeline_memory import stage_view

        view = stage_view(model, config.train)
        model_shape = dataclasses.replace(model_shape, layers=view.layers, **{
            name: int(getattr(model_shape, name) * view.fraction)
            for name in ("params", "trainable", "param_bytes", "matmul_params")})
        shape = dataclasses.replace(shape, micro_batch_tokens=per_rank * view.in_flight)
        pipeline = view.describe(steps.layout.world_size // pp, config.train.pipeline_schedule,
                                 sharded=fsdp is not None)
        fsdp = None  # the pipeline's line says how the stages are sharded
    memory = estimate_memory(model_shape, shape, baseline)
    device_bytes, device_name = device_memory_bytes(env.local_world_size(), config.train.max_memory_per_rank_gib)
    return Preflight(memory, device_bytes, device_name, slots, sp, steps.layout.world_size, fsdp, pipeline, pp)
