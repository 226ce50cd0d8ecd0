"""Process / device setup for single-process, DDP (gloo) and DeepSpeed runs, CPU included.

Supported launches (all verified on a CPU-only machine, see the docs of each helper):

* ``python finetune.py ...``                                  -> single process, no DeepSpeed
* ``accelerate launch --multi_gpu --num_processes N finetune.py ...``
                                                              -> DDP; on CPU over gloo
  (``accelerate launch --num_processes N`` *without* ``--multi_gpu`` starts ONE process
  on a machine without GPUs: accelerate's "simple launcher" ignores ``--num_processes``.)
* ``accelerate launch --num_processes N --use_deepspeed --deepspeed_config_file CFG finetune.py ...``
  (or ``--config_file ACCELERATE.yaml``, or ``--use_deepspeed --zero_stage N ...``: see
  :mod:`open_sft.config.launch`)                              -> DeepSpeed ZeRO; on CPU over gloo

Thread rule (see :func:`setup_cpu_environment`): ``OPEN_SFT_NUM_THREADS`` wins; otherwise an
``OMP_NUM_THREADS`` the *user* set is respected; otherwise a launched rank (torchrun /
accelerate launch, which force ``OMP_NUM_THREADS=1``) uses ``usable_cpus // local_world_size``.

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
import warnings
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # pragma: no cover - import only for type checkers
    from accelerate import Accelerator

__all__ = [
    "NUM_THREADS_ENV",
    "setup_cpu_environment",
    "resolve_deepspeed_config",
    "build_accelerator",
    "gather_full_state_dict",
    "all_reduce_sum",
]

#: Explicit per-rank thread count; overrides everything else (also use it to force 1 thread).
NUM_THREADS_ENV = "OPEN_SFT_NUM_THREADS"

# DeepSpeed's own defaults, used for hidden-size dependent "auto" keys when the hidden size
# is unknown.
_DS_DEFAULT_REDUCE_BUCKET = 500_000_000
_DS_DEFAULT_PREFETCH_BUCKET = 50_000_000
_DS_DEFAULT_PERSISTENCE_THRESHOLD = 100_000
# Lower bound for bucket sizes derived from a (tiny) hidden size: hidden**2 for a toy model
# would mean thousands of tiny gloo collectives per step.
_MIN_BUCKET = 1 << 20


# --------------------------------------------------------------------------------------------
# Environment
# --------------------------------------------------------------------------------------------
CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"  # cgroup v2: "<quota> <period>", or "max <period>" for none


def usable_cpus() -> int:
    """The CPUs this process may use: its affinity, capped by the cgroup's CPU quota (a container's
    `--cpus`, a job's CPU limit), which the affinity does not show."""
    try:
        cpus = max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - non-Linux
        cpus = max(1, os.cpu_count() or 1)
    try:
        with open(CGROUP_CPU_MAX) as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):  # no cgroup v2 limit to read
        pass
    return cpus


def _local_world_size() -> int:
    for name in ("LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        value = os.environ.get(name)
        if value and value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def _launched_by_launcher() -> bool:
    """True when started by torchrun / accelerate launch.

    torchrun-style launchers export LOCAL_RANK; every ``accelerate launch`` code path (also its
    single-process "simple launcher") exports ACCELERATE_DYNAMO_BACKEND.
    """
    markers = ("LOCAL_RANK", "TORCHELASTIC_RUN_ID", "ACCELERATE_DYNAMO_BACKEND")
    return any(name in os.environ for name in markers)


def _multi_rank_launch() -> bool:
    return "LOCAL_RANK" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1


def _parent_start_env_has(name: str) -> bool | None:
    """Whether ``name`` was in the environment the parent process (the launcher) was exec'd with.

    ``/proc/<ppid>/environ`` is the *initial* environment of the launcher, i.e. the user's
    shell environment, not the copy accelerate/torchrun modify for the workers.  Returns
    None when this cannot be determined (non-Linux, permissions).
    """
    try:
        with open(f"/proc/{os.getppid()}/environ", "rb") as fh:
            entries = fh.read().split(b"\0")
    except OSError:
        return None
    prefix = name.encode() + b"="
    return any(entry.startswith(prefix) for entry in entries)


def _threads_forced_by_launcher() -> bool:
    """OMP_NUM_THREADS=1 that the launcher, not the user, put there.

    accelerate 1.15 (``_validate_launch_command``) sets ``num_cpu_threads_per_process =
    OMP_NUM_THREADS or 1`` (the per-core share only with ``--cpu``, which disables DeepSpeed and
    multi-process launching) and exports it as OMP_NUM_THREADS for every worker; torchrun
    sets OMP_NUM_THREADS=1 when it is unset and nproc_per_node > 1.  An explicit user value
    (shell env or ``--num_cpu_threads_per_process``) other than 1 is passed through untouched.
    """
    if os.environ.get("OMP_NUM_THREADS") != "1" or not _launched_by_launcher():
        return False
    in_parent = _parent_start_env_has("OMP_NUM_THREADS")
    # Unknown parent env: treat "1" as launcher-forced (users wanting 1 thread can say so
    # with OPEN_SFT_NUM_THREADS=1).
    return not in_parent if in_parent is not None else True


def setup_cpu_environment() -> None:
    """Call first thing in ``main()``, before anything imports deepspeed.

    * No CUDA: set ``DS_ACCELERATOR=cpu`` unless already set.  DeepSpeed 0.19 would also fall
      back to its CPU accelerator by auto-detection (with a "Setting accelerator to CPU"
      warning) - setting it makes the choice explicit and deterministic.  It must happen before
      ``import deepspeed`` (deepspeed resolves its accelerator at import time).
    * Threads per rank, in this order:
        1. ``OPEN_SFT_NUM_THREADS=N`` -> N threads (explicit override, always wins);
        2. ``OMP_NUM_THREADS`` chosen by the user (present in the launcher's own environment,
           or any value other than 1) -> respected (torch already uses it);
        3. launched rank whose ``OMP_NUM_THREADS=1`` was forced by accelerate/torchrun ->
           ``max(1, usable_cpus // local_world_size)``;
        4. otherwise (plain ``python``) -> torch's default (all usable cores).
    """
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # DeepSpeed 0.19 calls torch.distributed.{all_gather_into_tensor,reduce_scatter_tensor},
    # which torch 2.13 flags as deprecated on *every* call: keep the logs readable.
    warnings.filterwarnings(
        "ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning
    )

    override = os.environ.get(NUM_THREADS_ENV)
    threads: int | None = None
    if override:
        try:
            threads = int(override)
        except ValueError as exc:
            raise ValueError(f"{NUM_THREADS_ENV} must be a positive integer, got {override!r}") from exc
        if threads < 1:
            raise ValueError(f"{NUM_THREADS_ENV} must be a positive integer, got {override!r}")
    elif _threads_forced_by_launcher():
        threads = max(1, usable_cpus() // _local_world_size())

    if threads is not None:
        torch.set_num_threads(threads)
        # Keep the env consistent for anything spawned later / reading it (e.g. accelerate's
        # MULTI_CPU setup, which only sets threads itself when OMP_NUM_THREADS is unset).
        os.environ["OMP_NUM_THREADS"] = str(threads)


# --------------------------------------------------------------------------------------------
# DeepSpeed config
# --------------------------------------------------------------------------------------------
def _check_or_fill(node: dict[str, Any], key: str, value: Any) -> None:
    current = node.get(key, "auto")
    if current == "auto":
        node[key] = value
    elif current != value:
        raise ValueError(
            f"DeepSpeed config {key}={current!r} conflicts with the training flags ({value!r}); "
            'set it to "auto"'
        )


def _find_auto(node: Any, prefix: str = "") -> list[str]:
    found: list[str] = []
    if isinstance(node, dict):
        for key, value in node.items():
            found += _find_auto(value, f"{prefix}{key}.")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += _find_auto(value, f"{prefix}{i}.")
    elif node == "auto":
        found.append(prefix[:-1])
    return found


def resolve_deepspeed_config(
    config: dict[str, Any],
    *,
    micro_batch_size: int,
    gradient_accumulation_steps: int,
    world_size: int,
    bf16: bool,
    clip_grad_norm: float,
    hidden_size: int | None = None,
) -> dict[str, Any]:
    """Return a copy of ``config`` with every "auto" filled from our flags.

    ``config`` comes from :func:`open_sft.config.launch.plan_launch`, which has already settled every
    conflict between the launch config and the flags (and reported it to the user), so a ``ValueError``
    here is a bug: explicit values that contradict the flags (DeepSpeed would otherwise silently train
    with e.g. a different batch size or precision), an "auto" this function does not know, or an
    "optimizer"/"scheduler" section (we always pass our own torch optimizer and scheduler).
    ``clip_grad_norm <= 0`` disables clipping (0.0).
    """
    cfg = copy.deepcopy(config)
    for section in ("optimizer", "scheduler"):
        if section in cfg:
            raise ValueError(
                f"DeepSpeed config must not contain {section!r}: open_sft creates its own {section}"
            )
    if micro_batch_size < 1 or gradient_accumulation_steps < 1 or world_size < 1:
        raise ValueError("micro_batch_size, gradient_accumulation_steps and world_size must be >= 1")

    _check_or_fill(cfg, "train_micro_batch_size_per_gpu", micro_batch_size)
    _check_or_fill(cfg, "gradient_accumulation_steps", gradient_accumulation_steps)
    _check_or_fill(cfg, "train_batch_size", micro_batch_size * gradient_accumulation_steps * world_size)
    _check_or_fill(cfg, "gradient_clipping", float(clip_grad_norm) if clip_grad_norm > 0 else 0.0)

    for name, wanted in (("bf16", bf16), ("fp16", False)):
        section = cfg.setdefault(name, {})
        if not isinstance(section, dict):
            raise ValueError(f"DeepSpeed config {name} must be an object")
        enabled = section.get("enabled", "auto")
        if enabled != "auto" and str(enabled).lower() in ("true", "false"):
            enabled = str(enabled).lower() == "true"
        if enabled == "auto":
            section["enabled"] = wanted
        elif enabled != wanted:
            hint = "fp16 is not supported" if name == "fp16" else "set it to \"auto\""
            raise ValueError(
                f"DeepSpeed config {name}.enabled={section['enabled']!r} conflicts with bf16={bf16} ({hint})"
            )
        else:
            section["enabled"] = wanted

    zero = cfg.get("zero_optimization")
    if not isinstance(zero, dict):
        raise ValueError("DeepSpeed config needs a zero_optimization section")
    if hidden_size:
        hidden_defaults = {
            "reduce_bucket_size": max(hidden_size * hidden_size, _MIN_BUCKET),
            "stage3_prefetch_bucket_size": max(int(0.9 * hidden_size * hidden_size), _MIN_BUCKET),
            "stage3_param_persistence_threshold": 10 * hidden_size,
        }
    else:
        hidden_defaults = {
            "reduce_bucket_size": _DS_DEFAULT_REDUCE_BUCKET,
            "stage3_prefetch_bucket_size": _DS_DEFAULT_PREFETCH_BUCKET,
            "stage3_param_persistence_threshold": _DS_DEFAULT_PERSISTENCE_THRESHOLD,
        }
    for key, value in hidden_defaults.items():
        if zero.get(key) == "auto":
            zero[key] = value
    if zero.get("stage") == 3 and zero.get("stage3_gather_16bit_weights_on_model_save", "auto") == "auto":
        # Needed by accelerator.get_state_dict to gather full weights under ZeRO-3.
        zero["stage3_gather_16bit_weights_on_model_save"] = True

    leftover = _find_auto(cfg)
    if leftover:
        raise ValueError(f"DeepSpeed config has unsupported \"auto\" value for: {', '.join(leftover)}")
    return cfg


# --------------------------------------------------------------------------------------------
# Accelerator
# --------------------------------------------------------------------------------------------
def build_accelerator(
    *,
    gradient_accumulation_steps: int,
    mixed_precision: str,
    deepspeed_config: dict[str, Any] | None,
    timeout_s: int = 1800,
    zero3_init: bool = False,
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
    """
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

    if mixed_precision not in ("no", "bf16"):
        raise ValueError(f"mixed_precision must be 'no' or 'bf16', got {mixed_precision!r}")
    on_cpu = not torch.cuda.is_available()
    # Only for launched (multi-rank) jobs: a single plain process with backend="gloo" makes
    # accelerate 1.15 query a process group that was never initialised.
    # --timeout: how long a collective waits, e.g. ranks waiting for rank 0's tokenization.
    kwargs_handlers = [InitProcessGroupKwargs(backend="gloo" if on_cpu else None, timeout=timedelta(seconds=timeout_s))
                       ] if _multi_rank_launch() else []

    plugin = None
    if deepspeed_config is not None:
        leftover = _find_auto(deepspeed_config)
        if leftover:
            raise ValueError(f"resolve the DeepSpeed config first; \"auto\" left in: {', '.join(leftover)}")
        ds_bf16 = bool(deepspeed_config.get("bf16", {}).get("enabled", False))
        if ds_bf16 != (mixed_precision == "bf16"):
            raise ValueError(f"DeepSpeed bf16.enabled={ds_bf16} but mixed_precision={mixed_precision!r}")
        from open_sft.config.launch import ENV_USE_DEEPSPEED

        os.environ[ENV_USE_DEEPSPEED] = "true"  # accelerate does this too; needed before the state exists
        plugin = DeepSpeedPlugin(
            hf_ds_config=copy.deepcopy(deepspeed_config),
            gradient_accumulation_steps=int(deepspeed_config["gradient_accumulation_steps"]),
            gradient_clipping=float(deepspeed_config.get("gradient_clipping", 0.0)),
            zero_stage=int(deepspeed_config["zero_optimization"].get("stage", 0)),
            zero3_init_flag=zero3_init,
        )
    return Accelerator(
        gradient_accumulation_steps=gradient_accumulation_steps,
        mixed_precision=mixed_precision,
        deepspeed_plugin=plugin,
        cpu=on_cpu and plugin is None,
        kwargs_handlers=kwargs_handlers,
        log_with=None,
    )


def all_reduce_sum(value: int | float | torch.Tensor) -> torch.Tensor:
    """Sum a scalar (or tensor) over all ranks; works with gloo on CPU (and nccl).

    Must be called by every rank (collective).  Python ints are summed exactly as int64,
    floats as float64; the result is on the input tensor's device (CPU for Python numbers).
    """
    if isinstance(value, torch.Tensor):
        tensor = value.detach().clone()
    elif isinstance(value, int):
        tensor = torch.tensor(value, dtype=torch.int64)
    else:
        tensor = torch.tensor(float(value), dtype=torch.float64)
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        backend = torch.distributed.get_backend()
        device = tensor.device
        if backend == "nccl" and device.type != "cuda":
            tensor = tensor.cuda()
        elif backend == "gloo" and device.type != "cpu":
            tensor = tensor.cpu()
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)
        tensor = tensor.to(device)
    return tensor


def gather_full_state_dict(accelerator: Accelerator, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) model weights on the main process, ``{}`` on the other ranks.

    Collective: call on every rank.  Under ZeRO-3 the parameters are gathered layer by layer
    (needs ``stage3_gather_16bit_weights_on_model_save=true``, which resolve_deepspeed_config
    sets); tensors are CPU copies in the model's dtype (bf16 under DS bf16, else fp32).
    """
    state_dict = accelerator.get_state_dict(model)
    if not accelerator.is_main_process or state_dict is None:
        return {}
    return {name: tensor.detach().to("cpu").clone() for name, tensor in state_dict.items()}
