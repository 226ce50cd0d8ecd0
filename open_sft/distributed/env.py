"""This process's place on the machine: usable CPUs (affinity and cgroup quota), ranks on this machine,
who launched it, the parallelism sizes the launch gave (accelerate's ParallelismConfig), and how many threads
it computes with. One rule each; everything else asks here.

Thread rule (see :func:`setup_cpu_environment`): ``OPEN_SFT_NUM_THREADS`` wins; otherwise an
``OMP_NUM_THREADS`` the *user* set is respected; otherwise a launched rank (torchrun /
accelerate launch, which force ``OMP_NUM_THREADS=1``) uses ``usable_cpus // local_world_size``.
"""

from __future__ import annotations

import os
import warnings
from typing import Mapping

from open_sft.errors import UserError

#: Explicit per-rank thread count; overrides everything else (also use it to force 1 thread).
NUM_THREADS_ENV = "OPEN_SFT_NUM_THREADS"
CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"  # cgroup v2: "<quota> <period>", or "max <period>" for none
ENV_PARALLELISM = "ACCELERATE_USE_PARALLELISM_CONFIG"  # accelerate launch --use_parallelism_config


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


def threads_per_rank(local_ranks: int) -> int:
    """A launched rank's share of this machine's usable CPUs. scripts/launch_multinode.sh exports it as
    OMP_NUM_THREADS before torchrun starts (torch-free, this module: torch is imported where threads are set)."""
    return max(1, usable_cpus() // local_ranks)


def local_world_size() -> int:
    """Ranks on this machine, by the variable whichever launcher started us exports (torchrun and
    accelerate: LOCAL_WORLD_SIZE; MPI launchers: theirs); 1 for a plain process."""
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


def multi_rank_launch() -> bool:
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
    import torch

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
            raise UserError(f"{NUM_THREADS_ENV} must be a positive integer, got {override!r}") from exc
        if threads < 1:
            raise UserError(f"{NUM_THREADS_ENV} must be a positive integer, got {override!r}")
    elif _threads_forced_by_launcher():
        threads = threads_per_rank(local_world_size())

    if threads is not None:
        torch.set_num_threads(threads)
        # Keep the env consistent for anything spawned later / reading it (e.g. accelerate's
        # MULTI_CPU setup, which only sets threads itself when OMP_NUM_THREADS is unset).
        os.environ["OMP_NUM_THREADS"] = str(threads)


def parallelism_size(name: str, env: Mapping[str, str] = os.environ) -> int:
    """The size the launch gave one dimension of accelerate's ParallelismConfig (`--parallelism_config_<name>_size`,
    passed as PARALLELISM_CONFIG_<NAME>_SIZE): 1 when unset or without `--use_parallelism_config`."""
    if env.get(ENV_PARALLELISM, "false").lower() != "true":
        return 1
    return int(env.get(f"PARALLELISM_CONFIG_{name.upper()}_SIZE", "1") or 1)


LAUNCH_COMMANDS = ("launch", "accelerate.commands.launch", "accelerate-launch")  # `accelerate launch`, -m, the script
SCRIPT_STARTS = ("-m", "--module", "--no_python", "--no-python")  # accelerate's flags before the script that it runs


def launcher_argv() -> list[str]:
    """The command line of this process's parent (the launcher that started it); [] where it cannot be read."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as fh:
            return [part.decode(errors="replace") for part in fh.read().split(b"\0") if part]
    except OSError:
        return []


def launch_flags(argv: list[str] | None = None) -> list[str]:
    """The flags `accelerate launch` was given before the script, from its command line `argv` (default: this
    process's parent's, read from /proc); [] where the parent is no accelerate launch."""
    argv = launcher_argv() if argv is None else argv
    start = next((i + 1 for i, part in enumerate(argv) if os.path.basename(part) in LAUNCH_COMMANDS), len(argv))
    end = next((i for i in range(start, len(argv)) if argv[i].endswith(".py") or argv[i] in SCRIPT_STARTS), len(argv))
    return argv[start:end]


def processes_asked_of_one(env: Mapping[str, str] = os.environ, argv: list[str] | None = None) -> int | None:
    """The --num_processes above 1 of an `accelerate launch` that started this process alone (its simple launcher,
    which it runs where it sees fewer than two GPUs unless --multi_gpu, --use_deepspeed or --use_fsdp asks for
    another, and always with --cpu); None for any other launch. `argv`: the launcher's (default: read from /proc)."""
    if "ACCELERATE_DYNAMO_BACKEND" not in env or "LOCAL_RANK" in env or env.get("WORLD_SIZE", "1") not in ("", "1"):
        return None
    flags, asked = launch_flags(argv), None
    for i, part in enumerate(flags):
        name, _, value = part.partition("=")
        if name in ("--num_processes", "--num-processes"):
            value = value or (flags[i + 1] if i + 1 < len(flags) else "")
            asked = int(value) if value.isdigit() else asked
    return asked if asked is not None and asked > 1 else None
