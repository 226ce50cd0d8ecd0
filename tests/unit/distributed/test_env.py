"""The machine rules of open_sft.distributed.env: ranks on this machine, CPUs, threads per rank."""

from __future__ import annotations

import os

import pytest
import torch

from open_sft.distributed import env
from open_sft.errors import UserError

LAUNCH_VARIABLES = ("LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "LOCAL_RANK", "WORLD_SIZE",
                    "TORCHELASTIC_RUN_ID", "ACCELERATE_DYNAMO_BACKEND", "OMP_NUM_THREADS", env.NUM_THREADS_ENV)


@pytest.fixture
def clean_env(monkeypatch):
    """No launcher variables, and torch's thread count restored after the test."""
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    threads = torch.get_num_threads()
    yield monkeypatch
    torch.set_num_threads(threads)


@pytest.mark.parametrize("variables, expected", [
    ({}, 1),
    ({"LOCAL_WORLD_SIZE": "3"}, 3),  # torchrun, accelerate launch
    ({"MPI_LOCALNRANKS": "4"}, 4),  # MPICH / Intel MPI
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, 2),  # Open MPI
    ({"LOCAL_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "8"}, 2),  # the launcher's own variable first
    ({"LOCAL_WORLD_SIZE": "x", "MPI_LOCALNRANKS": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "5"}, 5),  # unusable skipped
])
def test_local_world_size_reads_every_launcher(clean_env, variables, expected) -> None:
    for name, value in variables.items():
        clean_env.setenv(name, value)
    assert env.local_world_size() == expected


def test_preflight_divides_memory_by_the_same_local_world_size(clean_env) -> None:
    """Under an MPI launch the memory budget and the thread share count the same ranks (they once differed)."""
    from open_sft.preflight import estimate

    clean_env.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "4")
    whole, _ = estimate.device_memory_bytes(1)
    share, name = estimate.device_memory_bytes(env.local_world_size())
    assert share == whole // 4 and "4 local ranks" in name
    assert not hasattr(estimate, "local_world_size")  # no second rule to drift


@pytest.mark.parametrize("variables, expected", [({}, False), ({"WORLD_SIZE": "1"}, False), ({"WORLD_SIZE": "2"}, True),
                                                 ({"LOCAL_RANK": "0"}, True)])
def test_multi_rank_launch(clean_env, variables, expected) -> None:
    for name, value in variables.items():
        clean_env.setenv(name, value)
    assert env.multi_rank_launch() is expected


def test_explicit_thread_count_wins(clean_env) -> None:
    clean_env.setenv(env.NUM_THREADS_ENV, "1")
    clean_env.setenv("OMP_NUM_THREADS", "7")
    env.setup_cpu_environment()
    assert torch.get_num_threads() == 1 and os.environ["OMP_NUM_THREADS"] == "1"


@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_bad_thread_count_is_a_user_error_naming_the_variable(clean_env, value) -> None:
    clean_env.setenv(env.NUM_THREADS_ENV, value)
    with pytest.raises(UserError, match=f"{env.NUM_THREADS_ENV} must be a positive integer, got '{value}'"):
        env.setup_cpu_environment()


@pytest.mark.parametrize("user_set_it, expected", [(False, 3), (True, 1)])
def test_launcher_forced_single_thread_becomes_a_share_of_the_cpus(clean_env, user_set_it, expected) -> None:
    """accelerate/torchrun export OMP_NUM_THREADS=1 to every rank; unless the user asked for it, a rank gets
    usable_cpus // local ranks instead."""
    torch.set_num_threads(1)
    for name, value in {"OMP_NUM_THREADS": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}.items():
        clean_env.setenv(name, value)
    clean_env.setattr(env, "usable_cpus", lambda: 7)
    clean_env.setattr(env, "_parent_start_env_has", lambda name: user_set_it)
    env.setup_cpu_environment()
    assert torch.get_num_threads() == expected and os.environ["OMP_NUM_THREADS"] == str(expected)


def test_plain_process_keeps_torch_default_threads(clean_env) -> None:
    before = torch.get_num_threads()
    env.setup_cpu_environment()
    assert torch.get_num_threads() == before and "OMP_NUM_THREADS" not in os.environ


@pytest.mark.parametrize("cpu_max, cap", [("150000 100000\n", 2), ("50000 100000\n", 1), ("max 100000\n", None),
                                          (None, None)])
def test_usable_cpus_respect_a_cgroup_quota(cpu_max, cap, tmp_path, monkeypatch) -> None:
    """A container's CPU quota (cgroup v2 cpu.max, rounded up) caps the CPUs the affinity shows."""
    path = tmp_path / "cpu.max"
    if cpu_max is not None:
        path.write_text(cpu_max)
    monkeypatch.setattr(env, "CGROUP_CPU_MAX", str(path))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert env.usable_cpus() == (8 if cap is None else cap)


SIMPLE = {"ACCELERATE_DYNAMO_BACKEND": "NO", "ACCELERATE_USE_CPU": "False"}  # what accelerate's simple launcher sets


@pytest.mark.parametrize("argv, expected", [
    (["python", "/venv/bin/accelerate", "launch", "--num_processes", "2", "finetune.py", "--seed", "1"], 2),
    (["python", "-m", "accelerate.commands.launch", "--num_processes=4", "--cpu", "finetune.py"], 4),
    (["python", "/venv/bin/accelerate-launch", "--num-processes", "2", "--mixed_precision", "no", "finetune.py"], 2),
    (["python", "/venv/bin/accelerate", "launch", "--num_processes", "1", "finetune.py"], None),
    (["python", "/venv/bin/accelerate", "launch", "finetune.py", "--num_processes", "2"], None),  # the script's own
    (["python", "/venv/bin/accelerate", "launch", "-m", "open_sft.train", "--num_processes", "2"], None),
    (["python", "train_wrapper.py", "--num_processes", "2"], None),  # not accelerate
    ([], None),  # the launcher's command line could not be read
])
def test_the_processes_asked_of_accelerate_s_one_process_launch(argv, expected) -> None:
    """`accelerate launch --num_processes 2 finetune.py` on a machine without GPUs started one process (accelerate's
    simple launcher: DDP only with --multi_gpu), which trained alone; the number asked is read off its command line."""
    assert env.processes_asked_of_one(SIMPLE, argv) == expected


@pytest.mark.parametrize("variables", [{}, {**SIMPLE, "LOCAL_RANK": "0"}, {**SIMPLE, "WORLD_SIZE": "2"}])
def test_a_launch_of_ranks_or_no_launcher_asks_nothing(variables) -> None:
    argv = ["python", "/venv/bin/accelerate", "launch", "--num_processes", "2", "finetune.py"]
    assert env.processes_asked_of_one(variables, argv) is None
