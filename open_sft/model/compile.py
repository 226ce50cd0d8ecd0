"""--torch_compile: each decoder layer compiled by torch.compile, one compiled code shared by all layers.

On a GPU the 1B step's matmuls are fast and what is left is elementwise work around them: RMSNorm's
several passes, the rotary embedding, SiLU times the up projection, residual adds and casts (a quarter of
the step in scripts/gpu_check.py's profile). Inductor fuses those into a few kernels per layer. Compiling the
layers rather than the whole model ("regional" compilation) keeps the embeddings, the LM head and open_sft's
chunked loss as they are, and compiles one layer's code once for all layers (their parameters are inputs of
the graph, not constants), so the first step pays seconds, not minutes.

The attention call is not traced: open_sft's packed attention reads each batch's example lengths off the
device into a host list, which a traced graph would take as constants and recompile for at every batch; it
runs eagerly between the two compiled halves of each layer (one graph break per layer), as the kernel
call it is. Shapes that change between batches (padded rows) get one recompile with dynamic shapes.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from torch import nn

from open_sft.model.anatomy import decoder_layers

if TYPE_CHECKING:
    from open_sft.config.args import LoraArguments
    from open_sft.distributed.parallelism import Parallelism

logger = logging.getLogger(__name__)


def compile_layers(model: nn.Module) -> int:
    """Compile every decoder layer in place (nn.Module.compile: the module stays the same object, so its
    parameter names, hooks, checkpointing and state dict are untouched); returns how many."""
    from open_sft.errors import UserError

    try:
        layers = decoder_layers(model)
    except ValueError as exc:
        raise UserError(f"--torch_compile: {exc}; drop --torch_compile for this model") from exc
    for layer in layers:
        layer.compile()
    logger.info("--torch_compile: %d decoder layers compiled (%s), attention left eager; the first steps "
                "include the compilation", len(layers), type(layers[0]).__name__)
    return len(layers)


def compile_problems(lora: LoraArguments, parallelism: Parallelism) -> list[str]:
    """What --torch_compile does not run with, each with the fix (open_sft.config.launch_check asks before
    anything loads)."""
    refused = []
    if parallelism.zero_stage == 3:
        refused.append("DeepSpeed ZeRO-3 (its parameter gathering hooks run inside each layer's forward)")
    if parallelism.fsdp:
        refused.append("FSDP (its per-layer gathering would have to be traced with the layer)")
    if parallelism.tp_enabled:
        refused.append("tensor parallelism (the layers' weights are DTensors)")
    if parallelism.pp_enabled:
        refused.append("--pipeline_parallel_size (each stage swaps the backbone's layers)")
    if parallelism.sp_enabled:
        refused.append("--sequence_parallel_size (its attention exchanges heads across ranks)")
    if lora.use_qlora:
        refused.append("--use_qlora (bitsandbytes' 4-bit layers are not traceable)")
    return [f"--torch_compile does not run with {what}: drop --torch_compile or that setting"
            for what in refused]


def compile_summary() -> dict[str, int]:
    """What torch.compile did in this process: distinct graphs compiled and graph breaks met while tracing."""
    from torch._dynamo.utils import counters

    return {"graphs": int(counters["stats"].get("unique_graphs", 0)),
            "graph_breaks": int(sum(counters["graph_break"].values()))}


def log_summary() -> None:
    summary = compile_summary()
    logger.info("--torch_compile: %d graphs compiled, %d graph breaks traced (the attention call of each traced "
                "layer forward is one)", summary["graphs"], summary["graph_breaks"])
