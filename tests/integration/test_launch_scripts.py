"""Launch helpers: a real two-"machine" ZeRO-3 job on loopback through scripts/launch_multinode.sh must
give the losses of one machine with two processes; the SLURM batch script requeues exactly when the
job was preempted; prepare_data.sh and merge_lora.sh hand their arguments to the right command.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, SAMPLE, child_env, free_port, read_metrics

LAUNCH = ROOT / "scripts" / "launch_multinode.sh"
SBATCH = ROOT / "scripts" / "slurm" / "finetune.sbatch"
STEPS = 4
SLURM_VARS = ("SLURM_NNODES", "SLURM_NODEID", "SLURM_GPUS_ON_NODE", "SLURM_JOB_NODELIST", "MASTER_ADDR",
              "MASTER_PORT", "NNODES", "NODE_RANK", "NUM_MACHINES", "MACHINE_RANK", "MAIN_PROCESS_IP",
              "MAIN_PROCESS_PORT", "PROCESSES_PER_MACHINE", "DEEPSPEED_CONFIG")


def script_env(**extra: str) -> dict[str, str]:
    """The child environment without any launch variables of the machine running the tests."""
    env = child_env(OPEN_SFT_NUM_THREADS="1", PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    for name in (*SLURM_VARS, "OMP_NUM_THREADS"):  # the script's own OMP_NUM_THREADS is tested
        env.pop(name, None)
    env.update(extra)
    return env


def finetune_args(model_dir: Path, output_dir: Path) -> list[str]:
    return ["--model_name_or_path", str(model_dir), "--dataset_mixer_list", str(SAMPLE), "1.0",
            "--output_dir", str(output_dir), "--max_train_steps", str(STEPS), "--per_device_train_batch_size", "2",
            "--gradient_accumulation_steps", "2", "--learning_rate", "3e-3", "--warmup_ratio", "0.1",
            "--logging_steps", "1", "--seed", "1", "--torch_dtype", "float32", "--max_seq_length", "256"]


def launch(options: list[str], args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(["bash", str(LAUNCH), *options, "--", *args], cwd=ROOT, env=script_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(process: subprocess.Popen, timeout: int = 400) -> str:
    output, _ = process.communicate(timeout=timeout)
    assert process.returncode == 0, output[-6000:]
    return output


@pytest.fixture(scope="module")
def zero3_runs(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    single = tmp_path_factory.mktemp("one_machine")
    finish(launch(["--processes_per_machine", "2", "--main_process_port", str(free_port())],
                  finetune_args(tiny_model_dir, single)))
    multi = tmp_path_factory.mktemp("two_machines")
    port = str(free_port())
    machines = [launch(["--num_machines", "2", "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1",
                        "--main_process_port", port, "--processes_per_machine", "1"],
                       finetune_args(tiny_model_dir, multi)) for rank in (0, 1)]
    outputs = [finish(machine) for machine in machines]
    assert "machine 1/2, 1 process(es) here" in outputs[1]
    return {"single": single, "multi": multi}


def test_two_machines_match_one_machine_under_zero3(zero3_runs) -> None:
    single, multi = read_metrics(zero3_runs["single"]), read_metrics(zero3_runs["multi"])
    assert [m["step"] for m in multi] == [m["step"] for m in single] == list(range(1, STEPS + 1))
    assert [m["loss"] for m in multi] == pytest.approx([m["loss"] for m in single], rel=1e-5)
    assert [m["train_tokens"] for m in multi] == [m["train_tokens"] for m in single]
    a, b = load_file(zero3_runs["single"] / "model.safetensors"), load_file(zero3_runs["multi"] / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=1e-4, msg=key)
    for run in zero3_runs.values():  # both ranks trained, and the run went through DeepSpeed with 2 ranks
        assert (run / "data_order.rank0.json").exists() and (run / "data_order.rank1.json").exists()
        assert '"world_size": 2' in (run / "run.json").read_text()


def dry_command(*options: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(LAUNCH), *options, "--dry_run_command", "--", "--seed", "3"], cwd=ROOT,
                          env=script_env(**env), capture_output=True, text=True, timeout=60)


def test_launch_script_reads_slurm_and_overrides() -> None:
    slurm = {"SLURM_NNODES": "4", "SLURM_NODEID": "2", "SLURM_GPUS_ON_NODE": "8", "MASTER_ADDR": "node07"}
    result = dry_command(**slurm)
    assert result.returncode == 0, result.stderr
    cmd = result.stdout.split()
    pairs = dict(zip(cmd, cmd[1:]))
    assert pairs["--num_machines"] == "4" and pairs["--machine_rank"] == "2"
    assert pairs["--main_process_ip"] == "node07" and pairs["--main_process_port"] == "29500"
    assert pairs["--num_processes"] == "32" and pairs["--deepspeed_multinode_launcher"] == "standard"
    assert pairs["--deepspeed_config_file"].endswith("configs/ds/zero3.json")
    assert cmd[-3:] == [str(ROOT / "finetune.py"), "--seed", "3"]
    override = dry_command("--machine_rank", "3", "--main_process_port", "1234", "--processes_per_machine", "2",
                           **slurm).stdout.split()
    pairs = dict(zip(override, override[1:]))
    assert (pairs["--machine_rank"], pairs["--main_process_port"], pairs["--num_processes"]) == ("3", "1234", "8")
    bad = dry_command("--num_machines", "2", "--machine_rank", "2")
    assert bad.returncode == 2 and "must be below --num_machines 2" in bad.stderr


def test_num_processes_counts_all_machines_and_no_gpu_means_one_process() -> None:
    """`--num_processes` as accelerate counts it (all machines); on a machine without GPUs (this one: no
    nvidia-smi on PATH) the default is one process, whose threads use the node's cores."""
    def pairs(result: subprocess.CompletedProcess) -> dict[str, str]:
        return dict(zip(result.stdout.split(), result.stdout.split()[1:]))

    assert pairs(dry_command())["--num_processes"] == "1"
    assert pairs(dry_command("--num_processes", "4", "--num_machines", "2"))["--num_processes"] == "4"
    assert "machine" not in dry_command("--num_processes", "4").stderr
    bad = dry_command("--num_processes", "3", "--num_machines", "2")
    assert bad.returncode == 2 and "--num_processes 3 must be a positive multiple of --num_machines 2" in bad.stderr


@pytest.mark.parametrize("given, handed_on", [("SIGTERM, SIGUSR1,SIGINT", "SIGTERM,SIGINT"), ("SIGUSR1", "unset"),
                                               ("SIGTERM,SIGUSR10", "SIGTERM,SIGUSR10")])
def test_sigusr1_is_dropped_from_the_users_pet_signals_to_handle(tmp_path, given, handed_on) -> None:
    """torchrun handles PET_SIGNALS_TO_HANDLE's signals (tests/unit/distributed/test_launcher_signals.py): with SIGUSR1
    there, it replaced the script's `trap ''` with its handler, forwarded SIGUSR1 and killed the workers 30 s later,
    mid-checkpoint. The script drops it, saying so once (an `accelerate` on PATH prints what it was given)."""
    (tmp_path / "accelerate").write_text('#!/bin/sh\necho "PET_SIGNALS_TO_HANDLE=${PET_SIGNALS_TO_HANDLE-unset}"\n')
    (tmp_path / "accelerate").chmod(0o755)
    env = script_env(PET_SIGNALS_TO_HANDLE=given)
    env["PATH"] = f"{tmp_path}{os.pathsep}{env['PATH']}"
    result = subprocess.run(["bash", str(LAUNCH), "--", "--seed", "3"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"PET_SIGNALS_TO_HANDLE={handed_on}"
    dropped = [line for line in result.stderr.splitlines() if "SIGUSR1 dropped" in line]
    assert dropped == ([f"[launch_multinode] PET_SIGNALS_TO_HANDLE={given}: SIGUSR1 dropped (now "
                        f"{handed_on if handed_on != 'unset' else 'unset: torchrun default'}); this script forwards "
                        "SIGUSR1 to the workers itself, where torchrun would kill them 30 s after it, before their "
                        "checkpoint is written"] if handed_on != given else [])


def test_the_workers_exit_code_comes_through_torchrun(tiny_model_dir, tmp_path) -> None:
    """torchrun exits 1 whatever its workers' codes: the launcher hands on finetune.py's own 2 for bad input, and
    ends its output with the run's own error line, after torchrun's summary. Two processes and no OMP_NUM_THREADS:
    the script exports each one's share of the cores, so torchrun has no banner to print (nor accelerate its block
    of defaults: the script passes them)."""
    args = finetune_args(tiny_model_dir, tmp_path / "out")
    args[args.index(str(SAMPLE))] = str(tmp_path / "missing.jsonl")
    process = launch(["--processes_per_machine", "2", "--main_process_port", str(free_port())], args)
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 2, output[-3000:]
    lines = output.strip().splitlines()
    # the error block last: "error: invalid configuration (1 problem(s)):", then the problem
    assert lines[-2].startswith("error: ") and "missing.jsonl does not exist" in lines[-1], "\n".join(lines[-8:])
    assert "Setting OMP_NUM_THREADS" not in output and "were not passed to `accelerate launch`" not in output


def test_sigterm_to_the_launcher_checkpoints_and_exits_75(tiny_model_dir, tmp_path) -> None:
    """`docker stop` signals the container's PID 1, the launch script: it must reach the training process, which
    saves a checkpoint, and the script must exit 75 (the workers' children are found without pgrep)."""
    out = tmp_path / "out"
    args = finetune_args(tiny_model_dir, out)
    args[args.index("--max_train_steps") + 1] = "400"
    process = launch(["--processes_per_machine", "1", "--main_process_port", str(free_port())], args)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and process.poll() is None:
        if (out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=240)
    assert process.returncode == 75, output[-3000:]
    assert "got SIGTERM, forwarding to" in output and "no workers yet" not in output
    last = output.strip().splitlines()[-1]  # the run's own stop line, after torchrun's summary
    assert last.startswith("open_sft: stopped on a signal after step ") and "relaunch the same command" in last, last
    steps = [int(p.name.split("_")[1]) for p in (out / "checkpoints").glob("step_*") if (p / "COMPLETE").exists()]
    assert steps and 3 <= max(steps) < 400


FAKE_SLURM = """#!/usr/bin/env bash
if [ "$(basename "$0")" = srun ]; then echo "srun $* (SRUN_CPUS_PER_TASK=${SRUN_CPUS_PER_TASK:-})" >> "$FAKE_SLURM_LOG"
else echo "$(basename "$0") $*" >> "$FAKE_SLURM_LOG"; fi
if [ "$(basename "$0")" = scontrol ] && [ "$1" = show ]; then printf 'gpu-a1\\ngpu-a2\\n'; fi
if [ "$(basename "$0")" = srun ]; then exit "$FAKE_SRUN_EXIT"; fi
"""


@pytest.mark.parametrize("srun_exit, sbatch_exit, requeued", [(0, 0, False), (75, 0, True), (1, 1, False)])
def test_sbatch_requeues_only_when_preempted(tmp_path, srun_exit, sbatch_exit, requeued) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("srun", "scontrol"):
        (bin_dir / name).write_text(FAKE_SLURM)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "calls.log"
    env = script_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", FAKE_SLURM_LOG=str(log),
                     FAKE_SRUN_EXIT=str(srun_exit), SLURM_JOB_ID="4242", SLURM_NNODES="2",
                     SLURM_JOB_NODELIST="gpu-a[1-2]", SLURM_SUBMIT_DIR=str(ROOT), SLURM_CPUS_PER_TASK="32",
                     OPEN_SFT_VENV="none")  # the Docker image's: its python, no venv to activate
    result = subprocess.run(["bash", str(SBATCH), "--output_dir", "/shared/out"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == sbatch_exit, result.stderr
    calls = log.read_text().splitlines()
    srun = next(c for c in calls if c.startswith("srun "))
    assert "--ntasks-per-node=1" in srun and f"{ROOT}/scripts/launch_multinode.sh -- --output_dir /shared/out" in srun
    assert srun.endswith("(SRUN_CPUS_PER_TASK=32)"), srun  # Slurm 22.05-23.02's srun drops the allocation's cores
    assert ("scontrol requeue 4242" in calls) is requeued
    assert "main gpu-a1:" in result.stdout
    header = SBATCH.read_text()
    for directive in ("#SBATCH --ntasks-per-node=1", "#SBATCH --signal=USR1@", "#SBATCH --requeue"):
        assert directive in header


def test_prepare_data_prints_the_cache_path(tiny_model_dir, tmp_path) -> None:
    result = subprocess.run(["bash", str(ROOT / "scripts" / "prepare_data.sh"), "--model_name_or_path",
                             str(tiny_model_dir), "--dataset_mixer_list", str(SAMPLE), "0.05", "--max_seq_length",
                             "256", "--output_dir", str(tmp_path / "unused")], cwd=ROOT, env=script_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    cache = Path(result.stdout.strip().splitlines()[-1])
    assert (cache / "COMPLETE").exists() and (cache / "key.json").exists()
    assert not (tmp_path / "unused" / "model.safetensors").exists()


def test_merge_lora_wraps_the_lora_cli(tmp_path) -> None:
    adapter = tmp_path / "run"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    fake_python = tmp_path / "python"
    fake_python.write_text('#!/usr/bin/env bash\necho "$*"\n')
    fake_python.chmod(0o755)
    script = str(ROOT / "scripts" / "merge_lora.sh")
    result = subprocess.run(["bash", script, str(adapter), str(tmp_path / "merged"), "--dtype", "bfloat16"],
                            env=script_env(PYTHON=str(fake_python)), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"-m open_sft merge-lora {adapter} {tmp_path / 'merged'} --dtype bfloat16"
    missing = subprocess.run(["bash", script, str(tmp_path), str(tmp_path / "merged")], env=script_env(),
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "adapter_config.json not found" in missing.stderr


@pytest.mark.parametrize("kind", ["chat", "text"])
def test_benchmark_data_runs_on_chat_rows_and_documents(tiny_model_dir, tmp_path, kind) -> None:
    """scripts/benchmark_data.py (its numbers are for notes, not asserted here) builds the cache in two
    workers beside the raw encode, and reports rows read, examples made and a cache hit."""
    import json

    lines = SAMPLE.read_text().splitlines()
    data = SAMPLE
    if kind == "text":
        data = tmp_path / "docs.jsonl"
        data.write_text("".join(json.dumps({"text": "\n".join(m["content"] for m in json.loads(line)["messages"])})
                                + "\n" for line in lines))
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "benchmark_data.py"), "--tokenizer",
                             str(tiny_model_dir), "--data", str(data), "--preprocessing_num_workers", "2",
                             "--repeat", "1", "--max_seq_length", "128"],
                            cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    numbers = json.loads(result.stdout.strip().splitlines()[-1])
    assert numbers["rows"] == len(lines) and numbers["cache_hit"] is True
    if kind == "chat":
        assert 0.99 * len(lines) <= numbers["examples"] <= len(lines)
    else:  # documents spliced into blocks of 128 tokens (a last block of one token is left out)
        assert numbers["examples"] in (numbers["tokens"] // 128, -(-numbers["tokens"] // 128))
    assert numbers["build_tokens_per_s"] > 0 and numbers["raw_tokenizer_tokens_per_s"] > 0
    assert len(numbers["build_over_raw_each"]) == 1 and numbers["build_over_raw_each"][0] > 0


def test_profile_step_sorts_a_real_step_into_kinds_of_work(tiny_model_dir, tmp_path) -> None:
    """scripts/profile_step.py runs finetune.py's own command line, profiles one step of it, and accounts for
    every op's time in one kind of work; the run itself completes as without the profiler."""
    import json

    out = tmp_path / "out"
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "profile_step.py"), "--step", "2", "--top", "5",
                             "--", *finetune_args(tiny_model_dir, out), "--packing"],
                            cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    kinds = {line["kind"]: line for line in lines if "share" in line}
    top = [line for line in lines if "op" in line]
    summary = lines[-1]
    assert set(kinds) == {"lm_head_matmul", "lm_head_other", "backbone_matmul", "attention", "optimizer",
                          "casts_copies", "elementwise_other"}
    assert sum(k["share"] for k in kinds.values()) == pytest.approx(1.0, abs=1e-3)
    for kind in ("lm_head_matmul", "backbone_matmul", "attention", "optimizer"):
        assert kinds[kind]["seconds"] > 0, kind
    assert len(top) == 5 and top[0]["seconds"] >= top[-1]["seconds"]
    kernels = sum(kinds[k]["seconds"] for k in ("lm_head_matmul", "backbone_matmul", "attention"))
    assert summary["step"] == 2 and summary["model_flops"] > 0
    assert summary["mfu_ceiling_kernels"] == pytest.approx(
        summary["model_flops"] / (summary["peak_flops"] * kernels), rel=1e-2)
    assert summary["mfu_ceiling_kernels"] > summary["mfu_profiled"] > 0
    assert len([r for r in read_metrics(out) if "loss" in r]) == STEPS  # the profiled run is a whole run

    one_step = finetune_args(tiny_model_dir, tmp_path / "short")
    one_step[one_step.index("--max_train_steps") + 1] = "1"
    short = subprocess.run([sys.executable, str(ROOT / "scripts" / "profile_step.py"), "--step", "1", "--",
                            *one_step],
                           cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=600)
    assert short.returncode == 2 and "ended before step 1; give --max_train_steps above it" in short.stderr
