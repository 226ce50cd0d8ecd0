"""--fp8: the decoder's large linear layers train with FP8 matmuls (torchao's float8 training), the rest in bf16.

torchao's Float8Linear replaces an nn.Linear in place: its weight stays the same fp32 (or bf16) parameter, and each
forward and backward casts the input, the weight and the output gradient to float8 with a scale (one per tensor,
"tensorwise", or one per row, "rowwise") and multiplies on the GPU's FP8 tensor cores (torch._scaled_mm), so the
optimizer, checkpoints and the exported model are what they are without --fp8. What it is not written by hand:
the casts, scales and the matmul autograd are torchao's (the recipes OLMo-core and torchtitan train with); open_sft
chooses the layers and says which it left in bf16 and why.

Which layers: a matmul gains from FP8 only when it is large enough that the casts cost less than the faster
multiply saves; torchao's measured rule for each recipe on an H100 (`auto`: dimensions divisible by 16 and past
its size thresholds) picks them: on a Llama-3.1-8B the attention's query and output projections and the MLP's three,
not the key and value projections (1,024 outputs). The LM head stays in bf16 (the logits' precision is the loss's,
as in torchtitan), as do MoE routers (a small matmul whose top-k decides the experts). `--fp8_layers all` takes
every linear layer of the decoder whose dimensions FP8 matmuls accept (16's multiples), for small models and tests.

FP8 matmuls need an NVIDIA GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell). torch also runs them on
a CPU, emulated and slower than bf16: open_sft refuses that unless OPEN_SFT_FP8_ON_CPU=1 (the suite's stand-in,
which trains the same layers through the same torchao code)."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

if TYPE_CHECKING:
    from open_sft.config.args import FinetuneConfig
    from open_sft.config.launch import LaunchPlan

logger = logging.getLogger(__name__)

CPU_STAND_IN = "OPEN_SFT_FP8_ON_CPU"
ROUTER_NAMES = ("gate", "router", "shared_expert_gate")  # MoE routers: the last part of the module's name


def hardware_problem() -> str | None:
    """Why this machine cannot run FP8 matmuls (None: it can)."""
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        if (major, minor) >= (8, 9):
            return None
        return (f"{torch.cuda.get_device_name()} (compute capability {major}.{minor}) has no FP8 tensor cores; "
                "FP8 matmuls need compute capability 8.9 or newer (L4, L40S, H100, H200, B200)")
    if os.environ.get(CPU_STAND_IN) == "1":
        return None
    return (f"this machine has no CUDA GPU; FP8 matmuls need an NVIDIA GPU of compute capability 8.9 or newer (on a "
            f"CPU torch emulates them, slower than bf16: {CPU_STAND_IN}=1 runs that, for tests)")


def fp8_problems(config: FinetuneConfig, launch: LaunchPlan) -> list[str]:
    """What --fp8 does not run with, each with the fix (open_sft.config.launch_check asks before anything loads)."""
    if not config.model.fp8:
        return []
    hardware = hardware_problem()
    problems = [f"--fp8: {hardware}"] if hardware else []
    if launch.dtype != torch.bfloat16:
        problems.append(f"--fp8: --torch_dtype resolved to {str(launch.dtype).replace('torch.', '')}, and FP8 "
                        "training keeps the layers it does not convert in bf16: give --torch_dtype bfloat16")
    refused = []
    if config.lora.use_qlora:
        refused.append("--use_qlora (its base weights are 4-bit already, in bitsandbytes' layers)")
    elif config.lora.use_lora:
        refused.append("--use_lora (the adapters' matmuls are too small to gain; the frozen base layers are peft's)")
    p = launch.parallelism
    if p.zero_stage == 3:
        refused.append("DeepSpeed ZeRO-3 (its partitioned weights are gathered inside the layers torchao replaces; "
                       "ZeRO-2 and FSDP2 run it)")
    if p.tp_enabled:
        refused.append("tensor parallelism (its plan shards nn.Linear layers, not torchao's)")
    if p.pp_enabled:
        refused.append("--pipeline_parallel_size")
    if p.sp_enabled:
        refused.append("--sequence_parallel_size")
    if config.model.torch_compile and not torch.cuda.is_available():
        # found with the CPU stand-in: the compiled first half of each decoder layer (up to the attention's graph
        # break) gives the FP8 q/k/v projections NaN weight gradients; eager FP8 and compiled bf16 are right
        refused.append("--torch_compile on a CPU (torch's CPU compiler gives FP8 layers NaN gradients; together "
                       "they are for a GPU)")
    return problems + [f"--fp8 does not run with {what}: drop --fp8 or that setting" for what in refused]


def _decoder_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The decoder's nn.Linear layers by name: not the LM head, not an MoE router."""
    head = model.get_output_embeddings()
    return {name: module for name, module in model.named_modules()
            if type(module) is nn.Linear and module is not head and name.rsplit(".", 1)[-1] not in ROUTER_NAMES}


def choose_layers(model: nn.Module, recipe: str, layers: str) -> dict[str, str]:
    """Each decoder linear layer's verdict: "fp8", or why it stays in bf16 (shape too small to gain, a shape FP8
    matmuls refuse). `layers` "auto" is torchao's measured rule for the recipe; "all" takes every accepted shape."""
    # torchao's rule (its size thresholds measured on an H100, per recipe); private in name, the API torchtitan's
    # float8 auto-filter calls
    from torchao.float8 import _auto_filter_for_recipe

    gains: Callable[[nn.Module, str], bool] = _auto_filter_for_recipe(recipe, filter_fqns=[])
    verdicts = {}
    for name, module in _decoder_linears(model).items():
        out_features, in_features = module.weight.shape
        if out_features % 16 or in_features % 16:
            verdicts[name] = f"{out_features}x{in_features}: FP8 matmuls need dimensions divisible by 16"
        elif layers == "all" or gains(module, name):
            verdicts[name] = "fp8"
        else:
            verdicts[name] = f"{out_features}x{in_features}: too small to gain ({recipe})"
    return verdicts


def _kinds(names: list[str]) -> str:
    """The kinds of layers named (q_proj, k_proj, ...), in order of first appearance."""
    return ", ".join(dict.fromkeys(name.rsplit(".", 1)[-1] for name in names)) or "none"


def apply_fp8(model: nn.Module, recipe: str, layers: str) -> dict[str, Any]:
    """Convert the chosen layers in place to torchao's Float8Linear; returns what was done (also logged)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from open_sft.errors import UserError

    verdicts = choose_layers(model, recipe, layers)
    chosen = {name for name, verdict in verdicts.items() if verdict == "fp8"}
    if not chosen:
        raise UserError(f"--fp8: no linear layer of this model gains from FP8 matmuls under torchao's rule for the "
                        f"{recipe} recipe (e.g. {next(iter(verdicts.values()), 'no decoder linear layers')}); "
                        "drop --fp8, or give --fp8_layers all to convert every layer FP8 accepts")
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe),
                               module_filter_fn=lambda module, fqn: fqn in chosen)
    kept = [name for name in verdicts if name not in chosen]  # in the model's order
    summary = {"recipe": recipe, "layers": layers, "fp8": len(chosen), "bf16": len(kept),
               "fp8_kinds": _kinds([name for name in verdicts if name in chosen]), "bf16_kinds": _kinds(kept)}
    reasons = "; ".join(dict.fromkeys(f"{_kinds([name])} {verdicts[name]}" for name in kept))
    logger.info("--fp8 (torchao, %s scaling; %s): %d linear layers in FP8 (%s); in bf16: %sthe LM head", recipe,
                "every layer FP8 accepts" if layers == "all" else "the layers torchao's size rule says gain",
                len(chosen), summary["fp8_kinds"], f"{len(kept)} ({reasons}) and " if kept else "")
    return summary
