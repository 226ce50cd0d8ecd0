"""FSDP2 (torch's `fully_shard`) as the second engine beside DeepSpeed, through accelerate's FSDP plugin.

A launch asks for it the accelerate way: `accelerate launch --use_fsdp --fsdp_version 2 ...` or
`--config_file configs/accelerate/fsdp2.yaml`; accelerate hands the settings to every worker as
ACCELERATE_USE_FSDP and FSDP_* variables, and its `FullyShardedDataParallelPlugin()` reads them. open_sft
adds what a fine-tuning run needs and accelerate leaves open:

* the transformer blocks are the sharding units when the launch names no wrap policy (accelerate's default
  would shard the whole model as one unit: every rank would gather all of it at once);
* checkpoints are always sharded (`SHARDED_STATE_DICT`: accelerate's save_state writes them with
  torch.distributed.checkpoint, each rank its own shard), whatever the launch says for the final model: the
  export gathers the full weights itself;
* on CPU the engine is switched on by hand (`build_on_cpu`, see there).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

import torch

from open_sft.distributed.env import ENV_PARALLELISM, parallelism_size
from open_sft.errors import UserError

if TYPE_CHECKING:
    from open_sft.distributed.parallelism import Parallelism

logger = logging.getLogger(__name__)

ENV_USE_FSDP = "ACCELERATE_USE_FSDP"
ENV_PREFIX = "FSDP_"
ENV_VERSION = "FSDP_VERSION"
ENV_WRAP = "FSDP_AUTO_WRAP_POLICY"


def uses_fsdp(env: Mapping[str, str] = os.environ) -> bool:
    return env.get(ENV_USE_FSDP, "false").lower() == "true"


def fsdp_request(env: Mapping[str, str] = os.environ) -> Optional[dict[str, str]]:
    """The FSDP settings the launch passed (FSDP_* variables, prefix dropped, lower case), or None without FSDP.
    Only FSDP2 is trained with, and only its data-parallel layouts: anything else is a clear error naming the fix."""
    if not uses_fsdp(env):
        return None
    settings = {name[len(ENV_PREFIX):].lower(): value for name, value in sorted(env.items())
                if name.startswith(ENV_PREFIX)}
    version = settings.get("version", "1")  # accelerate's own default when --fsdp_version is not given
    if version != "2":
        raise UserError(f"FSDP version {version} was asked for (accelerate's default without --fsdp_version); "
                        "open_sft trains with FSDP2: pass `accelerate launch --use_fsdp --fsdp_version 2`, or "
                        "use configs/accelerate/fsdp2.yaml (fsdp_version: 2)")
    problems = parallelism_problems(env)
    if problems:
        raise UserError("FSDP2: " + "; ".join(problems))
    return settings


def fsdp_problems(train: Any, lora: Any, dtype: torch.dtype) -> list[str]:
    """What an FSDP2 run cannot do here, each with its fix (checked before anything is loaded)."""
    problems = []
    if train.sequence_parallel_size > 1:
        problems.append("--sequence_parallel_size is DeepSpeed Ulysses: launch with DeepSpeed "
                        "(configs/accelerate/deepspeed_zero3.yaml) instead of FSDP, or drop the flag")
    if lora.use_qlora:
        problems.append("--use_qlora under FSDP2: 4-bit weights cannot be sharded into DTensors here; use "
                        "--use_lora, or train QLoRA with DDP (accelerate launch --multi_gpu --num_processes N "
                        "finetune.py ...) or in one process (python finetune.py ...)")
    if dtype == torch.float16:
        problems.append("fp16 under FSDP2 is not supported (its loss scaling needs a sharded grad scaler); pass "
                        "--torch_dtype bfloat16 or float32, or use DeepSpeed for fp16")
    if train.auto_micro_batch_size:
        problems.append("--auto_micro_batch_size measures one whole model on one process, not FSDP2's shards; "
                        "pass --per_device_train_batch_size instead")
    return problems


def build_plugin(mixed_precision: str, tp: int) -> Any:
    """accelerate's FSDP plugin from the launch's FSDP_* settings, with open_sft's defaults where the launch is
    silent: transformer blocks as sharding units (named once the model is loaded: `adopt_model`), sharded
    checkpoints. `tp`: the launch's tensor-parallel degree."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    os.environ.setdefault(ENV_VERSION, "2")
    if os.environ.get(ENV_WRAP, "NO_WRAP") == "NO_WRAP":
        os.environ[ENV_WRAP] = "TRANSFORMER_BASED_WRAP"
    os.environ[ENV_PREFIX + "STATE_DICT_TYPE"] = "SHARDED_STATE_DICT"
    plugin = FullyShardedDataParallelPlugin()
    if tp > 1 and plugin.cpu_ram_efficient_loading:
        # accelerate 1.15's broadcast of rank 0's weights (fsdp2_load_full_state_dict) sends a TP-sharded weight's
        # local slice as if it were the whole tensor; under TP every rank loads the model and keeps its slice
        plugin.cpu_ram_efficient_loading = False
        logger.info("FSDP2 cpu_ram_efficient_loading is off under tensor parallelism (each rank loads the model)")
    if offloads(plugin) and not torch.cuda.is_available():
        from torch.distributed.fsdp import OffloadPolicy

        # FSDP2's CPUOffloadPolicy pins host memory for device copies, which needs an accelerator; on CPU the
        # sharded parameters, gradients and optimizer states already live in host memory
        plugin.cpu_offload = OffloadPolicy()
        logger.info("FSDP2 offload_params: nothing to offload on CPU ranks (everything is in host memory already)")
    if mixed_precision == "bf16":
        from torch.distributed.fsdp import MixedPrecisionPolicy

        # bf16 compute on fp32 sharded master weights; gradients reduced in fp32 (accelerate's default policy
        # reduces in bf16, which rounds every rank's contribution before the sum)
        plugin.mixed_precision_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return plugin


def adopt_model(plugin: Any, model: torch.nn.Module) -> None:
    """Name the sharding units after the model's own blocks (`_no_split_modules`) unless the launch named them:
    accelerate would look for them on the module it prepares, our loss wrapper, which has none."""
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    if plugin.auto_wrap_policy is transformer_auto_wrap_policy and not plugin.transformer_cls_names_to_wrap:
        plugin.transformer_cls_names_to_wrap = list(getattr(model, "_no_split_modules", None) or [])


def offloads(plugin: Any) -> bool:
    return type(plugin.cpu_offload).__name__ == "CPUOffloadPolicy"


def build_on_cpu(make_accelerator: Callable[[], Any], plugin: Any) -> Any:
    """An Accelerator for CPU ranks (MULTI_CPU over gloo, from `make_accelerator`) switched to the FSDP engine,
    with the launch's parallel layout (`--use_parallelism_config`: dp_replicate × dp_shard × tp) attached afterwards.

    Why by hand: accelerate 1.15's AcceleratorState turns FSDP on only for GPU-like distributed types
    (MULTI_GPU, MULTI_XPU, ...): on CPU it leaves MULTI_CPU even under `--use_fsdp`, and `prepare` would wrap
    the model in DDP, sharding nothing; it also refuses a ParallelismConfig on MULTI_CPU while the Accelerator
    is being built. torch's `fully_shard` and DeviceMesh run on CPU tensors over gloo, and accelerate's FSDP2
    code paths (prepare, clip_grad_norm_, get_state_dict, save_state/load_state through
    torch.distributed.checkpoint) are device-agnostic, so setting the distributed type (and then the mesh)
    before `prepare` makes CPU runs take exactly the path GPU runs take. The type lives in two shared states
    (AcceleratorState, and PartialState, from which a later AcceleratorState() re-reads it): both are set.
    """
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    parallel = os.environ.pop(ENV_PARALLELISM, "false").lower() == "true"  # read back below, once FSDP is on
    try:
        accelerator = make_accelerator()
    finally:
        if parallel:
            os.environ[ENV_PARALLELISM] = "true"
    state = accelerator.state
    if state.distributed_type not in (DistributedType.MULTI_CPU, DistributedType.NO):
        raise RuntimeError(f"cannot switch a {state.distributed_type} accelerator to FSDP")
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    if parallel:
        config = ParallelismConfig()  # its sizes from accelerate's PARALLELISM_CONFIG_* variables
        state.parallelism_config = config
        state.device_mesh = config.get_device_mesh(accelerator.device.type)
        config._validate_accelerator(accelerator)  # accelerate's own checks, now against the FSDP state
    return accelerator


def parallelism_problems(env: Mapping[str, str] = os.environ) -> list[str]:
    """What a launch's ParallelismConfig asks of FSDP2 that open_sft does not train with (tensor parallelism is
    open_sft.distributed.tensor_parallel's, checked once the model's shape is known)."""
    sizes = {name: parallelism_size(name, env) for name in ("cp", "sp")}
    return [f"--parallelism_config_{name}_size {size}: FSDP2 trains with data parallelism (dp_replicate × dp_shard, "
            "HSDP) and tensor parallelism (tp) only; drop it" for name, size in sizes.items() if size > 1]


def fsdp_layout(accelerator: Any, parallelism: Parallelism) -> Optional[dict[str, Any]]:
    """The FSDP2 layout for the preflight and run.json; None when the run is not on FSDP."""
    if not parallelism.fsdp:
        return None
    plugin, replicas = accelerator.state.fsdp_plugin, parallelism.dp_replicate
    policy = plugin.mixed_precision_policy
    # shards: the pieces of each parameter, FSDP2's dp_shard × TP's tp
    return {"engine": "fsdp2", "shards": parallelism.world_size // replicas, "replicas": replicas,
            "tensor_parallel": parallelism.tp,
            "reshard_after_forward": plugin.reshard_after_forward,
            "wrap": ", ".join(plugin.transformer_cls_names_to_wrap or []) or "whole model",
            "cpu_offload": offloads(plugin),
            "param_dtype": str(getattr(policy, "param_dtype", None) or "float32"),
            "activation_checkpointing": bool(plugin.activation_checkpointing)}
