"""FSDP2 through finetune.py on real gloo ranks: `accelerate launch --config_file configs/accelerate/fsdp2.yaml`
and `--use_fsdp --fsdp_version 2`.

Every parameter, gradient and optimizer state is sharded over the ranks, and the gradient that reaches the
optimizer is data parallelism's, so 2 ranks must train what one process trains on the same global batch (fp32):
the same per-step losses and the same final weights. A kill -9 and relaunch continues exactly from the sharded
(torch.distributed.checkpoint) checkpoint, and so does the relaunch after a SIGUSR1 to every process; the export
is the full model, which reloads in a fresh process; LoRA
under FSDP2 keeps optimizer state for the adapters only and trains what one process trains. A checkpoint resumes on
another number of ranks (2 FSDP2 ranks on 1, one process's on 2 DDP ranks) and under another engine (FSDP2's 2 ranks
under ZeRO-3 on 4, one process's under ZeRO-2 on 2 ranks) within 1e-6 of the uninterrupted run.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file as load_weights_file
from torch.distributed.checkpoint import FileSystemReader

from conftest import ROOT, SAMPLE, child_env, fsdp_command, launch_command, read_metrics, run_finetune
from export_check import assert_export_is_the_runs
from integration.test_checkpoint import (EXACT_FIELDS, assert_continues_within, interrupt, load_weights,
                                         resume_elsewhere)
from integration.test_lora import lora_pairs

STEPS = 6
YAML = None  # fsdp_command's default: configs/accelerate/fsdp2.yaml
FLAGS = ["--use_fsdp", "--fsdp_version", "2"]
LORA = ("--use_lora", "--lora_rank", "4", "--lora_alpha", "8", "--lora_dropout", "0")  # no dropout: its masks depend on the layout


def args_for(model_dir, output_dir, micro_batch: int, *extra: str) -> list[str]:
    """One process trains micro-batch 4 × accumulation 2; two ranks micro-batch 2 × 2 × 2: the same steps; 1 % of
    the examples held out and evaluated at the end."""
    return ["--model_name_or_path", str(model_dir), "--dataset_mixer_list", str(SAMPLE), "1.0",
            "--output_dir", str(output_dir), "--max_train_steps", str(STEPS), "--logging_steps", "1",
            "--per_device_train_batch_size", str(micro_batch), "--gradient_accumulation_steps", "2",
            "--learning_rate", "3e-3", "--warmup_ratio", "0.2", "--seed", "1", "--torch_dtype", "float32",
            "--max_seq_length", "256", "--checkpointing_steps", "2", "--eval_split_ratio", "0.01",
            "--eval_steps", str(STEPS), *extra]


def run_fsdp(launch: list[str], args: list[str], check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(fsdp_command(launch) + args, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                            timeout=600)
    if check and result.returncode != 0:
        raise AssertionError(f"finetune failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result


def losses(output_dir) -> list[float]:
    return [m["loss"] for m in read_metrics(output_dir) if "loss" in m]


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory) -> dict:
    out = {name: tmp_path_factory.mktemp(name) for name in
           ("one", "fsdp", "killed", "lora_one", "lora_fsdp", "bf16_one", "bf16_fsdp")}
    run_finetune(args_for(tiny_model_dir, out["one"], 4))
    result = run_fsdp(YAML, args_for(tiny_model_dir, out["fsdp"], 2))
    killed_args = args_for(tiny_model_dir, out["killed"], 2)
    kill_code = interrupt("zero2", killed_args, out["killed"], 3, signal.SIGKILL, out["killed"] / "killed.log",
                          command=fsdp_command(YAML))
    codes = tmp_path_factory.mktemp("usr1_codes")  # SIGUSR1 to the launcher, then each rank (pkill -USR1 -f ...)
    usr1_code = interrupt("zero2", killed_args, out["killed"], 4, signal.SIGUSR1, out["killed"] / "usr1.log",
                          command=fsdp_command(YAML), launcher_first=True, env={"OPEN_SFT_EXIT_CODE_DIR": str(codes)})
    usr1 = {"code": usr1_code, "log": (out["killed"] / "usr1.log").read_text(),
            "ranks": {path.name: path.read_text().strip() for path in codes.iterdir()}}
    relaunch = run_fsdp(YAML, killed_args)
    run_finetune(args_for(tiny_model_dir, out["lora_one"], 4, *LORA))
    run_fsdp(FLAGS, args_for(tiny_model_dir, out["lora_fsdp"], 2, *LORA, "--merge_lora_on_save"))
    run_finetune(args_for(tiny_model_dir, out["bf16_one"], 4, "--torch_dtype", "bfloat16"))
    run_fsdp(FLAGS, args_for(tiny_model_dir, out["bf16_fsdp"], 2, "--torch_dtype", "bfloat16",
                             "--gradient_checkpointing"))
    return {**out, "base": tiny_model_dir, "stdout": result.stdout, "kill_code": kill_code, "usr1": usr1,
            "relaunch": relaunch.stdout + relaunch.stderr}


def test_two_ranks_train_what_one_process_trains(runs) -> None:
    reference = losses(runs["one"])
    assert len(reference) == STEPS
    # Measured: equal to 6 decimals (the sharded reduce-scatter reorders fp32 sums only).
    assert losses(runs["fsdp"]) == pytest.approx(reference, rel=1e-5)
    one, fsdp = load_weights(runs["one"]), load_weights(runs["fsdp"])
    assert one.keys() == fsdp.keys() and len(one) > 10
    for name, tensor in one.items():  # measured: at most 1.1e-5 apart (Adam amplifies reordered fp32 sums)
        assert fsdp[name].dtype == torch.float32
        torch.testing.assert_close(fsdp[name], tensor, rtol=0, atol=1e-4, msg=name)


def test_evaluation_under_fsdp2_equals_one_process(runs) -> None:
    def eval_losses(output_dir) -> list[float]:
        return [m["eval_loss"] for m in read_metrics(output_dir) if "eval_loss" in m]

    assert len(eval_losses(runs["one"])) == 1
    assert eval_losses(runs["fsdp"]) == pytest.approx(eval_losses(runs["one"]), rel=1e-5)


def test_the_run_is_fsdp2_and_says_so(runs) -> None:
    run = json.loads((runs["fsdp"] / "run.json").read_text())
    assert run["distributed_type"] == "FSDP"
    layout = run["preflight"]["parallel"]["fsdp"]
    assert layout["engine"] == "fsdp2" and layout["shards"] == 2 and layout["wrap"] == "LlamaDecoderLayer"
    assert run["launch"]["fsdp_settings"]["version"] == "2"
    assert "parallel layout: FSDP2, data parallel 2" in runs["stdout"]
    assert "FSDP2: parameters, gradients and optimizer states sharded over 2 rank(s)" in runs["stdout"]


def test_checkpoints_are_sharded_with_torch_distributed_checkpoint(runs) -> None:
    step = runs["fsdp"] / "checkpoints" / f"step_{STEPS}"
    assert (step / "COMPLETE").is_file()
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):
        assert sorted(p.name for p in (step / part).glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    state = json.loads((step / "trainer_state.json").read_text())
    assert state["identity"]["engine"] == "fsdp2"


def test_sigusr1_to_every_process_saves_the_checkpoint_though_it_ends_the_launcher(runs) -> None:
    """torchrun does not handle SIGUSR1 and dies of it: its ranks, signalled too, stopped without a checkpoint (exit
    4, "its launcher is gone"). They now finish the stop (a checkpoint, exit 75), saying why the launcher went; the
    relaunch through it continues exactly (test_kill_9_and_relaunch_continues_exactly)."""
    usr1 = runs["usr1"]
    assert usr1["code"] == -signal.SIGUSR1
    assert (usr1["ranks"]["rank0"], usr1["ranks"]["rank1"]) == ("75", "75"), usr1["log"][-3000:]
    assert usr1["ranks"]["rank0.message"].startswith("open_sft: stopped on a signal after step ")
    assert "this rank got SIGUSR1 and finishes its stop" in usr1["log"]


def test_kill_9_and_relaunch_continues_exactly(runs) -> None:
    assert runs["kill_code"] != 0
    assert "resuming from" in runs["relaunch"]
    view = [{k: r[k] for k in EXACT_FIELDS} for r in read_metrics(runs["killed"]) if "loss" in r]
    base = [{k: r[k] for k in EXACT_FIELDS} for r in read_metrics(runs["fsdp"]) if "loss" in r]
    assert [r["step"] for r in view] == list(range(1, STEPS + 1))
    assert view == base  # measured: bitwise
    killed, uninterrupted = load_weights(runs["killed"]), load_weights(runs["fsdp"])
    assert all(torch.equal(killed[name], tensor) for name, tensor in uninterrupted.items())


def test_the_export_reloads_in_a_fresh_process(runs) -> None:
    code = ("import sys, torch; from transformers import AutoModelForCausalLM, AutoTokenizer\n"
            "m, info = AutoModelForCausalLM.from_pretrained(sys.argv[1], output_loading_info=True)\n"
            "t = AutoTokenizer.from_pretrained(sys.argv[1])\n"
            "ids = t('hello world', return_tensors='pt').input_ids\n"
            "print(sum(len(v) for v in info.values()), m.dtype, float(m(ids, labels=ids).loss))")
    result = subprocess.run([sys.executable, "-c", code, str(runs["fsdp"])], capture_output=True, text=True,
                            env=child_env(), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    problems, dtype, loss = result.stdout.split()[-3:]
    assert problems == "0" and dtype == "torch.float32" and 0 < float(loss) < 20


def test_lora_under_fsdp2_trains_only_the_adapters(runs) -> None:
    assert losses(runs["lora_fsdp"]) == pytest.approx(losses(runs["lora_one"]), rel=1e-5)
    assert losses(runs["lora_fsdp"]) != pytest.approx(losses(runs["fsdp"]), rel=1e-3)  # not full fine-tuning
    assert (runs["lora_fsdp"] / "adapter_model.safetensors").is_file()
    assert not (runs["lora_fsdp"] / "model.safetensors").exists()
    optimizer = FileSystemReader(str(runs["lora_fsdp"] / "checkpoints" / f"step_{STEPS}" / "optimizer_0"))
    held = [key for key in optimizer.read_metadata().state_dict_metadata if ".exp_avg" in key]
    assert held and all("lora_A" in key or "lora_B" in key for key in held)
    model = FileSystemReader(str(runs["lora_fsdp"] / "checkpoints" / f"step_{STEPS}" / "pytorch_model_fsdp_0"))
    assert any("base_layer" in key for key in model.read_metadata().state_dict_metadata)  # the base is sharded too
    # the merged export: the untouched base plus each adapter's update (lora_alpha 8 / rank 4)
    base, merged = load_weights(runs["base"]), load_weights(runs["lora_fsdp"] / "merged")
    pairs = lora_pairs(load_weights_file(runs["lora_fsdp"] / "adapter_model.safetensors"))
    assert merged.keys() == base.keys() and pairs
    for key, weight in base.items():
        lora_a, lora_b = pairs.get(key, (None, None))
        expected = weight if lora_a is None else weight + 8 / 4 * lora_b @ lora_a
        torch.testing.assert_close(merged[key], expected, rtol=0, atol=1e-6, msg=key)


def test_bf16_under_fsdp2_tracks_one_process(runs) -> None:
    # bf16 compute on fp32 masters in both; measured within 1e-4 relative over these steps
    assert losses(runs["bf16_fsdp"]) == pytest.approx(losses(runs["bf16_one"]), rel=1e-3)
    layout = json.loads((runs["bf16_fsdp"] / "run.json").read_text())["preflight"]["parallel"]["fsdp"]
    assert layout["param_dtype"] == "torch.bfloat16"
    # the fp32 master weights are exported, as one process's bf16 autocast run exports its fp32 weights
    assert {t.dtype for t in load_weights(runs["bf16_fsdp"]).values()} == {torch.float32}
    assert {t.dtype for t in load_weights(runs["bf16_one"]).values()} == {torch.float32}


def test_hsdp_on_four_ranks_trains_what_one_process_trains(runs, tiny_model_dir, tmp_path) -> None:
    """2 replicas × 2 shards (accelerate's --use_parallelism_config), micro-batch 1 × 2 × 4 ranks."""
    hsdp = [*FLAGS, "--use_parallelism_config", "--parallelism_config_dp_replicate_size", "2",
            "--parallelism_config_dp_shard_size", "2"]
    args = args_for(tiny_model_dir, tmp_path / "out", 1)
    result = subprocess.run(fsdp_command(hsdp, processes=4) + args, cwd=ROOT, env=child_env(), capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-5000:]
    assert losses(tmp_path / "out") == pytest.approx(losses(runs["one"]), rel=1e-5)
    layout = json.loads((tmp_path / "out" / "run.json").read_text())["preflight"]["parallel"]["fsdp"]
    assert (layout["shards"], layout["replicas"]) == (2, 2)
    assert "in 2 shards × 2 replicas (HSDP)" in result.stdout


def test_dry_run_probes_under_fsdp2_and_writes_nothing(tiny_model_dir, tmp_path) -> None:
    result = run_fsdp(FLAGS, args_for(tiny_model_dir, tmp_path / "out", 2, "--dry_run"))
    assert "parallel layout: FSDP2" in result.stdout and "time estimate:" in result.stdout
    assert not (tmp_path / "out").exists()


def test_fsdp1_is_refused_with_the_fix(tiny_model_dir, tmp_path) -> None:
    result = run_fsdp(["--use_fsdp"], args_for(tiny_model_dir, tmp_path / "out", 2), check=False)
    assert result.returncode != 0
    assert "error: FSDP version 1 was asked for" in result.stderr
    assert "--fsdp_version 2" in result.stderr
    assert not (tmp_path / "out" / "run.json").exists()


@pytest.mark.parametrize("name", ["fsdp", "bf16_fsdp", "lora_fsdp"])
def test_export_of_a_sharded_checkpoint_is_the_runs_own_export(runs, name, tmp_path) -> None:
    """`open_sft export` reads FSDP2's torch distributed checkpoint without a process group: the full model (fp32
    masters, also of the bf16 run), and the LoRA run's adapter and merged model, bitwise the run's own export."""
    out = assert_export_is_the_runs(runs[name], STEPS, tmp_path / "export")
    assert "FSDP2" in json.loads((out / "export.json").read_text())["engine"]
    assert (out / "merged" / "config.json").is_file() == (name == "lora_fsdp")


def test_a_two_rank_fsdp2_checkpoint_resumes_on_one_process(runs, tiny_model_dir, tmp_path) -> None:
    """torch.distributed.checkpoint reshards the 2 ranks' shards onto 1 process; accumulation 2 → 4 keeps the
    global batch of 8, so steps 3-6 train what the 2 ranks trained."""
    out = tmp_path / "out"
    log = resume_elsewhere(runs["fsdp"], 2, out, fsdp_command(YAML, processes=1), args_for(tiny_model_dir, out, 2))
    assert ("resuming a 2-rank checkpoint on 1 rank: gradient accumulation 2 -> 4 keeps the global batch of 8 "
            "sequences") in log
    # measured: losses 1.1e-8 relative, gradient norms 3.5e-6, weights 7.6e-7 apart (the same sums, another order)
    assert_continues_within(out, runs["fsdp"], STEPS, atol=1e-5)


def test_a_one_process_checkpoint_resumes_on_two_ddp_ranks(runs, tiny_model_dir, tmp_path) -> None:
    """The plain one-process checkpoint (whole model and optimizer) on 2 DDP ranks: accumulation 2 → 1 keeps the
    global batch of 8 (given explicitly, as the world-size refusal asks); rank 1, which the checkpoint had no random
    state for, says where its state comes from. The original one-process command, requeued on the finished run, is
    answered `already complete` (it was refused: '--gradient_accumulation_steps: 1 then, 2 now')."""
    out = tmp_path / "out"
    log = resume_elsewhere(runs["one"], 2, out, launch_command(2, None),
                           args_for(tiny_model_dir, out, 4, "--gradient_accumulation_steps", "1"))
    assert ("resuming a 1-rank checkpoint on 2 ranks: gradient accumulation 2 -> 1 keeps the global batch of 8 "
            "sequences") in log
    assert "has no random state for rank(s) 1: theirs are derived from --seed, the step and the rank" in log
    # measured: losses equal, eval loss 5e-9 relative, gradient norms 7e-8, weights 1.4e-6 apart
    assert_continues_within(out, runs["one"], STEPS, atol=1e-5)
    assert json.loads((out / "checkpoints" / f"step_{STEPS}" / "trainer_state.json").read_text())["identity"][
        "world_size"] == 2
    requeued = subprocess.run(launch_command(1, None) + args_for(tiny_model_dir, out, 4), cwd=ROOT, env=child_env(),
                              capture_output=True, text=True, timeout=300)
    assert requeued.returncode == 0 and f"already complete: {out}" in requeued.stdout, requeued.stderr[-3000:]


def test_an_fsdp2_checkpoint_resumes_under_zero3_on_four_ranks(runs, tiny_model_dir, tmp_path) -> None:
    """The 2 FSDP2 ranks' distributed checkpoint read by name and written in DeepSpeed's universal layout; ZeRO-3 on
    4 ranks (accumulation 2 → 1 keeps the global batch of 8) trains steps 3-6 as FSDP2 did."""
    out = tmp_path / "out"
    log = resume_elsewhere(runs["fsdp"], 2, out, launch_command(4, "zero3.json"), args_for(tiny_model_dir, out, 2))
    assert ("resuming a 2-rank checkpoint on 4 ranks: gradient accumulation 2 -> 1 keeps the global batch of 8 "
            "sequences") in log
    assert ("resuming a FSDP2 checkpoint of 2 rank(s) under DeepSpeed ZeRO-3: its fp32 weights and Adam moments "
            "(21 trained tensors) read by name") in log
    assert "has no random state for rank(s) 2, 3" in log
    assert not list((out / "checkpoints").glob("*.tmp"))  # the conversion is removed once loaded
    # measured on 2 ranks: losses 2.4e-8 relative, gradient norms 3.6e-6, weights 2.4e-7 apart
    assert_continues_within(out, runs["fsdp"], STEPS, atol=1e-5)
    state = json.loads((out / "checkpoints" / f"step_{STEPS}" / "trainer_state.json").read_text())
    assert state["identity"]["engine"] == "deepspeed"  # and its own checkpoints from then on


def test_a_one_process_checkpoint_resumes_under_zero2_on_two_ranks(runs, tiny_model_dir, tmp_path) -> None:
    """Another engine and another number of ranks at once: accumulation 2 → 1 keeps the global batch of 8, the
    plain checkpoint's model.safetensors and optimizer.bin (by index in the optimizer's order) read by name."""
    out = tmp_path / "out"
    log = resume_elsewhere(runs["one"], 2, out, launch_command(2, "zero2.json"), args_for(tiny_model_dir, out, 4))
    assert ("resuming a 1-rank checkpoint on 2 ranks: gradient accumulation 2 -> 1 keeps the global batch of 8 "
            "sequences") in log
    assert "resuming a one process or DDP checkpoint of 1 rank(s) under DeepSpeed ZeRO-2" in log
    # measured: losses equal, gradient norms 7.7e-6 relative, weights 5.3e-7 apart
    assert_continues_within(out, runs["one"], STEPS, atol=1e-5)
