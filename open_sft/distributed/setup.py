"""Starting the processes' group: the Accelerator for single-process, DDP (gloo) and DeepSpeed runs, CPU included.

Process / device setup for single-process, DDP (gloo) and DeepSpeed runs, CPU included.

Supported launches (all verified on a CPU-only machine, see the docs of each helper):

* ``python finetune.py ...``                                  -> single process, no DeepSpeed
* ``accelerate launch --multi_gpu --num_processes N finetune.py ...``
                                                              -> DDP; on CPU over gloo
  (``accelerate launch --num_processes N`` *without* ``--multi_gpu`` starts ONE process
  on a machine without GPUs: accelerate's "simple launcher" ignores ``--num_processes``.)
* ``accelerate launch --num_processes N --use_deepspeed --deepspeed_config_file CFG finetune.py ...``
  (or ``--config_file ACCELERATE.yaml``, or ``--use_deepspeed --zero_stage N ...``: see
  :mod:`open_sft.config.deepspeed_request`)                   -> DeepSpeed ZeRO; on CPU over gloo

Loss normalisation: in every mode supported here the gradient that reaches the optimizer is
``mean over ranks of (sum over micro-batches of grad(loss_micro)) / gradient_accumulation_steps``
(accelerate divides by GA outside DeepSpeed, the DeepSpeed engine divides by GA inside
``engine.backward``; DDP and ZeRO both *average* gradients over ranks).  So to obtain
``grad(sum of token losses in the global batch / global trained tokens)`` pass
``loss = micro_sum_token_loss / global_tokens * gradient_accumulation_steps * num_processes`` to
``accelerator.backward`` (``open_sft.training.trainer.Trainer._loss_scale`` applies it).
"""

from __future__ import annotations

import copy
import os
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from open_sft.config.deepspeed_request import ENV_USE_DEEPSPEED
from open_sft.distributed.deepspeed import find_auto
from open_sft.distributed.env import multi_rank_launch

if TYPE_CHECKING:  # pragma: no cover - import only for type checkers
    from accelerate import Accelerator

    from open_sft.config.args import FinetuneConfig
    from open_sft.config.launch import LaunchPlan


def build_accelerator(
    *,
    gradient_accumulation_steps: int,
    mixed_precision: str,
    deepspeed_config: dict[str, Any] | None,
    timeout_s: int = 1800,
    zero3_init: bool = False,
    parallelism_config: Any = None,
    fsdp_plugin: Any = None,
) -> Accelerator:
    """Build the Accelerator for single process, DDP or DeepSpeed (``deepspeed_config`` resolved).

    * CPU, launched: process group backend "gloo" (without it accelerate 1.15 + DeepSpeed report one
      process per rank); without DeepSpeed ``cpu=True`` so a launched job is MULTI_CPU/DDP
      (otherwise accelerate would init the group but not wrap the model in DDP).
    * ``mixed_precision`` is passed explicitly, so it overrides ``ACCELERATE_MIXED_PRECISION``
      from ``accelerate launch --mixed_precision``; under DeepSpeed accelerate does NOT
      override an explicit ``bf16.enabled`` in the DS config, so the DS config must agree -
      checked here.
    * No trackers (``log_with=None``); we step the LR scheduler ourselves (do not pass it to
      ``prepare``: accelerate's wrapper steps it ``num_processes`` times per optimizer step).
    * ``zero3_init``: a model loaded after this loads partitioned (transformers sees the DeepSpeed
      config through the plugin and loads under ``deepspeed.zero.Init``).
    * ``fsdp_plugin`` (open_sft.distributed.fsdp.build_plugin): FSDP2; on CPU the Accelerator is built for
      MULTI_CPU and then switched to FSDP (``build_on_cpu`` says why).
    """
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    if mixed_precision not in ("no", "bf16", "fp16"):
        raise ValueError(f"mixed_precision must be 'no', 'bf16' or 'fp16', got {mixed_precision!r}")
    if mixed_precision == "fp16" and deepspeed_config is None:
        # accelerate 1.15 ignores fp16 on CPU (no autocast, no scaler): open_sft.training.amp does it instead.
        raise ValueError("fp16 outside DeepSpeed is open_sft.training.amp's: pass mixed_precision='no'")
    on_cpu = not torch.cuda.is_available()
    # Only for launched (multi-rank) jobs: a single plain process with backend="gloo" makes
    # accelerate 1.15 query a process group that was never initialised.
    # --timeout: how long a collective waits, e.g. ranks waiting for rank 0's tokenization.
    kwargs_handlers = [InitProcessGroupKwargs(backend="gloo" if on_cpu else None, timeout=timedelta(seconds=timeout_s))
                       ] if multi_rank_launch() else []

    plugin = _deepspeed_plugin(deepspeed_config, mixed_precision, zero3_init) if deepspeed_config is not None else None
    def make() -> Accelerator:
        return Accelerator(
            gradient_accumulation_steps=gradient_accumulation_steps,
            mixed_precision=mixed_precision,
            deepspeed_plugin=plugin,
            fsdp_plugin=fsdp_plugin if not on_cpu else None,
            cpu=on_cpu and plugin is None,
            kwargs_handlers=kwargs_handlers,
            log_with=None,
            parallelism_config=parallelism_config,  # --sequence_parallel_size (distributed.sequence_parallel)
        )

    if fsdp_plugin is not None and on_cpu:
        from open_sft.distributed.fsdp import build_on_cpu

        return build_on_cpu(make, fsdp_plugin)
    return make()


def _deepspeed_plugin(deepspeed_config: dict[str, Any], mixed_precision: str, zero3_init: bool) -> Any:
    """accelerate's DeepSpeed plugin for a resolved config whose precision agrees with mixed_precision."""
    from accelerate.utils import DeepSpeedPlugin

    leftover = find_auto(deepspeed_config)
    if leftover:
        raise ValueError(f"resolve the DeepSpeed config first; \"auto\" left in: {', '.join(leftover)}")
    for name in ("bf16", "fp16"):
        enabled = bool(deepspeed_config.get(name, {}).get("enabled", False))
        if enabled != (mixed_precision == name):
            raise ValueError(f"DeepSpeed {name}.enabled={enabled} but mixed_precision={mixed_precision!r}")
    os.environ[ENV_USE_DEEPSPEED] = "true"  # accelerate does this too; needed before the state exists
    return DeepSpeedPlugin(
        hf_ds_config=copy.deepcopy(deepspeed_config),
        gradient_accumulation_steps=int(deepspeed_config["gradient_accumulation_steps"]),
        gradient_clipping=float(deepspeed_config.get("gradient_clipping", 0.0)),
        zero_stage=int(deepspeed_config["zero_optimization"].get("stage", 0)),
        zero3_init_flag=zero3_init,
    )


def start_accelerator(config: FinetuneConfig, launch: LaunchPlan, dtype: torch.dtype, model_config: Any,
                      zero3_init: bool = False) -> tuple[Accelerator, dict[str, Any] | None]:
    """The Accelerator for the run, and the launch's DeepSpeed config resolved from the flags (its "auto" values
    filled; None without DeepSpeed). What the launch cannot do was refused up front (open_sft.config.launch_check)."""
    from open_sft.distributed.deepspeed import resolve_deepspeed_config
    from open_sft.distributed.fsdp import build_plugin
    from open_sft.distributed.sequence_parallel import sequence_parallel_launch
    from open_sft.model.anatomy import text_config
    from open_sft.model.load import attn_implementation
    from open_sft.training.amp import accelerate_mixed_precision

    t, spread = config.train, launch.parallelism
    sp, batch = sequence_parallel_launch(config, spread, attn_implementation(config.model, model_config))
    ds_config = None
    if spread.deepspeed:
        from open_sft.distributed.cpu_comm_op import announce

        announce(is_main=os.environ.get("RANK", "0") == "0")  # before DeepSpeed's silent minute, if it compiles
        ds_config = resolve_deepspeed_config(
            launch.deepspeed_config, **batch, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
            clip_grad_norm=t.clip_grad_norm, hidden_size=getattr(text_config(model_config), "hidden_size", None))
    mixed_precision = accelerate_mixed_precision(dtype, spread.deepspeed)
    fsdp = build_plugin(mixed_precision, spread.tp) if spread.fsdp else None
    accelerator = build_accelerator(
        # under TP a group computes its tp members' micro-batches one after the other: tp passes per micro-batch
        gradient_accumulation_steps=batch["gradient_accumulation_steps"] * spread.tp, mixed_precision=mixed_precision,
        deepspeed_config=ds_config, timeout_s=t.timeout, zero3_init=zero3_init, parallelism_config=sp,
        fsdp_plugin=fsdp)
    return accelerator, ds_config
