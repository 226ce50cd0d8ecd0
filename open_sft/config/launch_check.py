"""The launch judged as a whole before anything is loaded: every problem that depends on how the run is spread
(open_sft.distributed.parallelism), on the flags and on the model's config.json, reported together in one
UserError (config.checks judges the flags on their own, before the launch is known).

Each engine and each kind of parallelism keeps its own list of what it cannot run with, next to its code
(distributed.fsdp, distributed.pipeline, distributed.tensor_parallel, distributed.sequence_parallel,
distributed.deepspeed, model.compile, model.fp8); this module asks each of them, for this launch."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Optional

import torch

from open_sft.errors import UserError

if TYPE_CHECKING:
    from open_sft.config.args import FinetuneConfig
    from open_sft.config.launch import LaunchPlan

QLORA_UNDER_DEEPSPEED = (
    "--use_qlora does not work under DeepSpeed: ZeRO flattens and partitions parameters, and bitsandbytes' packed "
    "4-bit weights (with their quantization state) cannot be partitioned or cast. Run QLoRA in one process (python "
    "finetune.py ...) or with DDP (accelerate launch --multi_gpu --num_processes N finetune.py ...), or use "
    "--use_lora under DeepSpeed")
ONE_OF_MANY = ("accelerate launch was given --num_processes {asked} but started this one process: on a machine with "
               "fewer than two GPUs it starts one unless --multi_gpu, --use_deepspeed or --use_fsdp (or an accelerate "
               "config file naming one) asks for more; add --multi_gpu for plain DDP over {asked} processes (CPUs "
               "too), or give --num_processes 1")
ONE_OF_MANY_CPU = ("accelerate launch was given --num_processes {asked} and --cpu, with which it starts this one process "
                   "whatever else it is given; drop --cpu (on a machine without GPUs, --multi_gpu runs plain DDP over "
                   "{asked} processes on the CPUs), or give --num_processes 1")
NONFINITE = "the DeepSpeed config would apply steps with a non-finite gradient instead of skipping them: "


def needs_model_config(launch: LaunchPlan) -> bool:
    """Whether judging this launch needs the model's config (heads and layers to split across ranks)."""
    return launch.parallelism.splits_model


def check_launch(config: FinetuneConfig, launch: LaunchPlan) -> None:
    """Raise one UserError naming every problem of this launch; the model's config.json is read when the launch
    splits the model (no weights are loaded), when --additional_model_arguments are given: a key the config
    lacks is refused there, before the data is tokenized (it was found when the model loaded, after it), and for
    --attn_implementation flash_attention_2 (a model whose attention flash-attn 2 does not compute is refused)."""
    model_config = None
    flash = config.model.attn_implementation == "flash_attention_2"  # whether the model's attention is flash-attn's
    if needs_model_config(launch) or config.model.additional_model_arguments or flash:
        from open_sft.model.load import load_model_config

        model_config = load_model_config(config.model)
    problems = launch_problems(config, launch, model_config)
    if problems:
        raise UserError("\n  ".join([f"the launch cannot run as asked ({launch.parallelism.describe()}):",
                                     *problems]))


def launch_problems(config: FinetuneConfig, launch: LaunchPlan, model_config: Optional[Any]) -> list[str]:
    """Every problem of the launch, each with its fix; `model_config` may be None when no model is split."""
    from open_sft.distributed.fsdp import fsdp_problems
    from open_sft.model.compile import compile_problems
    from open_sft.model.fp8 import fp8_problems

    from open_sft.distributed.env import launch_flags, processes_asked_of_one

    p, train = launch.parallelism, launch.train
    asked = processes_asked_of_one() if p.world_size == 1 else None
    alone = ONE_OF_MANY_CPU if asked and "--cpu" in launch_flags() else ONE_OF_MANY
    problems = [alone.format(asked=asked)] if asked else []
    if p.deepspeed:
        problems += deepspeed_problems(config, launch)
    if p.fsdp:
        problems += [f"FSDP2: {problem}" for problem in fsdp_problems(train, config.lora, launch.dtype)]
    if config.model.torch_compile:
        problems += compile_problems(config.lora, p)
    problems += fp8_problems(config, launch)
    if config.model.attn_implementation == "flash_attention_2" and model_config is not None:
        from open_sft.config.checks import flash_flag
        from open_sft.model.load import flash_attention_problem

        problems += [problem for problem in [flash_attention_problem(model_config, flash_flag(config)[0])] if problem]
    return problems + spread_problems(config, launch, model_config)


def deepspeed_problems(config: FinetuneConfig, launch: LaunchPlan) -> list[str]:
    """QLoRA, and a DeepSpeed config that would step on a non-finite gradient (judged with its precision as the
    compute dtype will fill it)."""
    from open_sft.distributed.deepspeed import deepspeed_nonfinite_problems

    problems = [QLORA_UNDER_DEEPSPEED] if config.lora.use_qlora else []
    filled = copy.deepcopy(launch.deepspeed_config or {})
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        section = filled.get(name) if isinstance(filled.get(name), dict) else {}
        filled[name] = {**section, "enabled": launch.dtype == dtype}
    nonfinite = deepspeed_nonfinite_problems(filled)
    return problems + ([NONFINITE + "; ".join(nonfinite)] if nonfinite else [])


def spread_problems(config: FinetuneConfig, launch: LaunchPlan, model_config: Optional[Any]) -> list[str]:
    """What tensor, sequence and pipeline parallelism cannot do with this launch, flags and model."""
    from open_sft.distributed.pipeline_plan import pipeline_problems
    from open_sft.distributed.sequence_parallel import sequence_parallel_problems
    from open_sft.distributed.tensor_parallel import tensor_parallel_problems

    p, problems = launch.parallelism, []
    if p.tp_enabled:
        problems += [f"tensor parallelism: {problem}" for problem in tensor_parallel_problems(
            p, launch.train, config.lora, model_config)]
    if p.sp_enabled:
        from open_sft.model.load import attn_implementation

        problems += sequence_parallel_problems(p.sp, p.world_size, p.deepspeed, config, model_config,
                                               attn_implementation(config.model, model_config))
    if p.pp_enabled:
        problems += pipeline_problems(config, p.world_size, p.deepspeed, p.tp)
        problems += stage_problems(launch.train, model_config)
    return problems


def stage_problems(train: Any, model_config: Optional[Any]) -> list[str]:
    """Whether the model has a decoder layer for each pipeline stage (and --pipeline_layers fits its layers)."""
    from open_sft.distributed.pipeline_plan import parse_layers, stage_ranges

    layers = getattr(model_config, "num_hidden_layers", None)
    if not isinstance(layers, int):
        return []
    try:
        stage_ranges([1] * layers, train.pipeline_parallel_size * train.pipeline_virtual_stages,
                     parse_layers(train.pipeline_layers))
    except ValueError as exc:
        return [f"--pipeline_parallel_size {train.pipeline_parallel_size}: {exc}"]
    return []
