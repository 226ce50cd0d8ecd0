"""Pipeline parallelism through finetune.py on real gloo ranks (torch.distributed.pipelining).

A 4-layer model split into 2 stages (2 layers each) must train what one process trains on the same global batch
(fp32): the same per-step losses and evaluation, and final weights equal within what Adam makes of reordered
fp32 sums; so must 2 data-parallel replicas of 2 stages (4 ranks, GPipe). Packed rows in 2 stages train what
plain data parallelism trains on the same global batch, in fp32 also with each stage FSDP2-sharded over its 2
replicas (4 ranks: the replicas' packed micro-batches have other rows, yet they run one schedule shape together).
Packed rows under the interleaved schedule (2 ranks × 2 virtual stages), in bf16 with activation checkpointing, train
what plain data parallelism trains on the same 2 ranks (packing depends on the micro-batch's token budget). A kill -9
and relaunch continues exactly from the per-stage checkpoint (whole, or sharded and packed); the export is the whole
model and reloads in a fresh process; LoRA under PP trains what LoRA trains in one process.
"""

from __future__ import annotations

import json
import signal
import subprocess

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, SAMPLE, child_env, read_metrics, run_finetune, side_by_side
from export_check import assert_export_is_the_runs
from open_sft.errors import UserError
from open_sft.export.from_checkpoint import export_checkpoint
from integration.test_checkpoint import assert_continues_exactly, interrupt, load_weights, reloaded_loss
from integration.test_fsdp import LORA, STEPS, fsdp_command, losses
from integration.test_fsdp import args_for as absolute_args_for
from integration.test_lora import lora_pairs
from integration.test_moe import moe_model  # noqa: F401 (a fixture)

PP = ["--pipeline_parallel_size", "2"]
DDP = ["--multi_gpu"]  # accelerate's plain data-parallel launch (gloo on CPU)
FSDP_YAML = ["--config_file", str(ROOT / "configs" / "accelerate" / "fsdp2.yaml")]
# The sample named relative to the checkout (every run's working directory): the held-out split follows the
# source's name, so an absolute path gave each checkout other training rows, and on some of them Adam's near-sign
# steps on rarely seen embedding rows put a final weight 6.6e-4 from one process's (1e-5 on this split)
SAMPLE_NAME = str(SAMPLE.relative_to(ROOT))


def args_for(model_dir, output_dir, micro_batch: int, *extra: str) -> list[str]:
    return [SAMPLE_NAME if arg == str(SAMPLE) else arg
            for arg in absolute_args_for(model_dir, output_dir, micro_batch, *extra)]


def run_launch(args: list[str], processes: int = 2, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(fsdp_command(DDP, processes=processes) + args, cwd=ROOT, env=child_env(),
                            capture_output=True, text=True, timeout=600)
    if check and result.returncode != 0:
        raise AssertionError(f"finetune failed ({result.returncode}):\n{result.stdout[-3000:]}\n"
                             f"{result.stderr[-5000:]}")
    return result


@pytest.fixture(scope="module")
def model4(tmp_path_factory):
    from open_sft.embedded.factory import build_embedded_default

    return build_embedded_default(tmp_path_factory.mktemp("model4"), vocab_size=1024, hidden_size=64, num_layers=4,
                                  seed=0)


@pytest.fixture(scope="module")
def runs(model4, tmp_path_factory) -> dict:
    """One process: micro-batch 4 × accumulation 2; 2 ranks of PP: micro-batch 2 × 2 × 2; 4 ranks (2 replicas of
    2 stages): micro-batch 1 × 2 × 4 — the same global batches. Packed in fp32: 2 ranks micro-batch 3 ×
    accumulation 2, and 4 ranks (FSDP2-sharded stages) 3 × 1 — the same 4 packed micro-batches of 768 tokens a
    step; at step 3 one replica's micro-batches have 3 rows and the other's 4 (before the replicas agreed on the
    schedule's shape, that run hung there), and evaluated one example a schedule, one replica has 11 and the
    other 10 (before the other ran a loss-free one, the evaluation hung)."""
    out = {name: tmp_path_factory.mktemp(f"pipeline_{name}") for name in  # not test_fsdp's one0, one1, ...
           ("one", "pp", "killed", "dp_pp", "fsdp_pp", "fsdp_killed", "packed_ddp_fp32", "packed_pp_fp32",
            "packed_ddp", "packed_pp", "mean_ddp", "mean_pp", "lora_one", "lora_pp")}
    run_finetune(args_for(model4, out["one"], 4))
    run_finetune(args_for(model4, out["lora_one"], 4, *LORA))
    def fsdp() -> list[str]:  # a port of its own for each launch: launches run side by side
        return fsdp_command(FSDP_YAML, processes=4)

    killed_args = args_for(model4, out["killed"], 2, *PP)
    # packed fp32, 21 examples held out: 11 to one replica, 10 to the other
    packed_fp32 = ("--packing", "--eval_split_ratio", "0.0105")
    packed_4 = (*packed_fp32, "--gradient_accumulation_steps", "1", "--per_device_eval_batch_size", "1")
    fsdp_pp_args = args_for(model4, out["fsdp_pp"], 3, *PP, *packed_4)
    fsdp_killed_args = args_for(model4, out["fsdp_killed"], 3, *PP, *packed_4)
    packed = ("--packing", "--torch_dtype", "bfloat16")  # bf16 autocast on fp32 masters
    mean = ("--loss_normalization", "mean")

    def killed_and_relaunched() -> tuple:
        kill_code = interrupt("zero2", killed_args, out["killed"], 3, signal.SIGKILL, out["killed"] / "killed.log",
                              command=fsdp_command(DDP))
        return kill_code, run_launch(killed_args)

    def fsdp_killed_and_relaunched() -> int:
        fsdp_kill_code = interrupt("zero2", fsdp_killed_args, out["fsdp_killed"], 3, signal.SIGKILL,
                                   out["fsdp_killed"] / "killed.log", command=fsdp())
        subprocess.run(fsdp() + fsdp_killed_args, cwd=ROOT, env=child_env(), check=True, capture_output=True,
                       timeout=300)
        return fsdp_kill_code

    # launches of 4 ranks, then of 2, one thread each: two at a time (see conftest.side_by_side)
    done = side_by_side({
        "dp_pp": lambda: run_launch(args_for(model4, out["dp_pp"], 1, *PP, "--pipeline_schedule", "gpipe"),
                                    processes=4),
        # 2 stages × 2 replicas with each stage FSDP2-sharded over its replicas, packed; killed and relaunched
        # too (a run that hangs fails at the timeout: alone it takes 15 s)
        "fsdp_pp": lambda: subprocess.run(fsdp() + fsdp_pp_args, cwd=ROOT, env=child_env(), check=True,
                                          capture_output=True, timeout=300),
        "fsdp_killed": fsdp_killed_and_relaunched,
    }, processes=4)
    done.update(side_by_side({
        "pp": lambda: run_launch(args_for(model4, out["pp"], 2, *PP)),
        "killed": killed_and_relaunched,
        "packed_ddp_fp32": lambda: run_launch(args_for(model4, out["packed_ddp_fp32"], 3, *packed_fp32)),
        "packed_pp_fp32": lambda: run_launch(args_for(model4, out["packed_pp_fp32"], 3, *packed_fp32, *PP)),
        "packed_ddp": lambda: run_launch(args_for(model4, out["packed_ddp"], 2, *packed)),
        "packed_pp": lambda: run_launch(args_for(model4, out["packed_pp"], 2, *packed, *PP, "--pipeline_schedule",
                                                 "interleaved_1f1b", "--pipeline_virtual_stages", "2",
                                                 "--gradient_checkpointing")),
        "mean_ddp": lambda: run_launch(args_for(model4, out["mean_ddp"], 2, *mean)),
        "mean_pp": lambda: run_launch(args_for(model4, out["mean_pp"], 2, *mean, *PP)),
        "lora_pp": lambda: run_launch(args_for(model4, out["lora_pp"], 2, *LORA, *PP, "--merge_lora_on_save")),
    }, processes=2))
    result, (kill_code, relaunch), fsdp_kill_code = done["pp"], done["killed"], done["fsdp_killed"]
    return {**out, "stdout": result.stdout, "kill_code": kill_code, "relaunch": relaunch.stdout + relaunch.stderr,
            "fsdp_kill_code": fsdp_kill_code}


def test_two_stages_train_what_one_process_trains(runs) -> None:
    reference = losses(runs["one"])
    assert len(reference) == STEPS
    assert losses(runs["pp"]) == pytest.approx(reference, rel=1e-5)  # measured: 3e-8 relative
    one, pp = load_weights(runs["one"]), load_weights(runs["pp"])
    assert one.keys() == pp.keys() and len(one) > 10  # the export is the whole model, gathered from the stages
    for name, tensor in one.items():
        torch.testing.assert_close(pp[name], tensor, rtol=0, atol=1e-4, msg=name)  # measured: 1e-5


def test_two_replicas_of_two_stages_train_what_one_process_trains(runs) -> None:
    assert losses(runs["dp_pp"]) == pytest.approx(losses(runs["one"]), rel=1e-5)
    one, dp_pp = load_weights(runs["one"]), load_weights(runs["dp_pp"])
    for name, tensor in one.items():
        torch.testing.assert_close(dp_pp[name], tensor, rtol=0, atol=1e-4, msg=name)


def test_packed_stages_sharded_by_fsdp2_over_their_replicas_train_what_data_parallelism_trains(runs) -> None:
    """4 ranks (2 FSDP2-sharded stages × 2 replicas), packed: what 2 ranks of plain data parallelism train on the
    same packed micro-batches, past the step where the replicas' micro-batches first have other rows; and the
    same evaluation, although the replicas hold 11 and 10 of the held-out examples."""
    reference = losses(runs["packed_ddp_fp32"])
    assert len(reference) == STEPS
    assert losses(runs["fsdp_pp"]) == pytest.approx(reference, rel=1e-5)  # measured: 4e-8 relative
    ddp, sharded = load_weights(runs["packed_ddp_fp32"]), load_weights(runs["fsdp_pp"])
    assert ddp.keys() == sharded.keys()
    for name, tensor in ddp.items():
        torch.testing.assert_close(sharded[name], tensor, rtol=0, atol=1e-4, msg=name)
    evals = {run: [(m["eval_loss"], m["eval_tokens"]) for m in read_metrics(runs[run]) if "eval_loss" in m]
             for run in ("fsdp_pp", "packed_ddp_fp32")}
    ((loss, tokens),), ((reference_loss, reference_tokens),) = evals["fsdp_pp"], evals["packed_ddp_fp32"]
    assert tokens == reference_tokens and loss == pytest.approx(reference_loss, rel=1e-5)
    step = runs["fsdp_pp"] / "checkpoints" / f"step_{STEPS}" / "pipeline_sharded"
    assert sorted(p.name for p in step.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]


def test_kill_9_and_relaunch_of_fsdp2_sharded_stages_continues_exactly(runs) -> None:
    assert runs["fsdp_kill_code"] != 0
    assert_continues_exactly(runs["fsdp_killed"], runs["fsdp_pp"], STEPS)


def test_evaluation_under_pipeline_parallelism_equals_one_process(runs) -> None:
    def evals(output_dir) -> list[tuple[float, int]]:
        return [(m["eval_loss"], m["eval_tokens"]) for m in read_metrics(output_dir) if "eval_loss" in m]

    (reference, reference_tokens), = evals(runs["one"])
    for name in ("pp", "dp_pp"):
        (loss, tokens), = evals(runs[name])
        assert tokens == reference_tokens  # each example counted once
        assert loss == pytest.approx(reference, rel=1e-5)


def test_packed_rows_in_two_stages_train_what_data_parallelism_trains(runs) -> None:
    """Packed micro-batches are rows of a token budget per rank, so one process packs other steps: the reference
    is plain data parallelism on the same 2 ranks (which trains what one process trains on the same batches)."""
    assert losses(runs["packed_pp_fp32"]) == pytest.approx(losses(runs["packed_ddp_fp32"]), rel=1e-5)


def test_packed_bf16_rows_under_the_interleaved_schedule_with_checkpointing_train_what_ddp_trains(runs) -> None:
    # measured: 5e-6 relative (in fp32 without checkpointing: 3e-8)
    assert losses(runs["packed_pp"]) == pytest.approx(losses(runs["packed_ddp"]), rel=5e-4)


def test_the_mean_of_micro_batch_means_is_the_data_parallel_runs(runs) -> None:
    """--loss_normalization mean weighs each micro-batch by its own tokens: the gradient (its norm) shows it."""
    pp, ddp = read_metrics(runs["mean_pp"]), read_metrics(runs["mean_ddp"])
    assert [m["loss"] for m in pp if "loss" in m] == pytest.approx([m["loss"] for m in ddp if "loss" in m], rel=1e-5)
    # measured: 5e-7 relative at step 1, 5e-6 after 3 AdamW steps
    assert [m["grad_norm"] for m in pp if "loss" in m] == pytest.approx(
        [m["grad_norm"] for m in ddp if "loss" in m], rel=1e-4)


def test_the_run_says_its_layout_and_checkpoints_hold_each_stage(runs) -> None:
    assert "pipeline parallel 2 × 1 data-parallel replica(s), schedule 1f1b, 2 stages; this rank: stage 0: " \
           "layers 0-1" in runs["stdout"]
    assert "parallel layout: pipeline parallel 2 stages × 1 data-parallel replica(s), schedule 1f1b" in runs["stdout"]
    assert "pipeline: each rank's idle share of the schedules' time" in runs["stdout"]
    assert "pipeline: each rank's peak memory (GiB): [" in runs["stdout"]
    run = json.loads((runs["pp"] / "run.json").read_text())
    assert run["preflight"]["parallel"]["pipeline"] == 2 and run["preflight"]["parallel"]["data"] == 1
    step = runs["pp"] / "checkpoints" / f"step_{STEPS}"
    assert sorted(p.name for p in step.glob("pipeline_stage_*.pt")) == ["pipeline_stage_0.pt", "pipeline_stage_1.pt"]
    stage0 = torch.load(step / "pipeline_stage_0.pt", weights_only=False)["model"]
    stage1 = torch.load(step / "pipeline_stage_1.pt", weights_only=False)["model"]
    assert any(".layers.0." in k for k in stage0) and not any(".layers.2." in k for k in stage0)
    assert any(".layers.3." in k for k in stage1) and not any(".layers.1." in k for k in stage1)
    identity = json.loads((step / "trainer_state.json").read_text())["identity"]
    assert identity["engine"] == "pipeline" and identity["pipeline_parallel_size"].startswith("2 ")


def test_kill_9_and_relaunch_continues_exactly(runs) -> None:
    assert runs["kill_code"] != 0
    assert "resuming from" in runs["relaunch"]
    assert_continues_exactly(runs["killed"], runs["pp"], STEPS)


def test_the_export_reloads_in_a_fresh_process(runs) -> None:
    assert reloaded_loss(runs["pp"]) == pytest.approx(reloaded_loss(runs["one"]), rel=1e-4)


def test_lora_under_pipeline_parallelism_trains_what_lora_trains_in_one_process(runs) -> None:
    assert losses(runs["lora_pp"]) == pytest.approx(losses(runs["lora_one"]), rel=1e-5)
    one = lora_pairs(load_file(runs["lora_one"] / "adapter_model.safetensors"))
    pp = lora_pairs(load_file(runs["lora_pp"] / "adapter_model.safetensors"))
    assert one.keys() == pp.keys() and len(one) >= 8  # every stage's adapters are in the export
    for module, (a, b) in one.items():
        torch.testing.assert_close(pp[module][0], a, rtol=0, atol=1e-4)
        torch.testing.assert_close(pp[module][1], b, rtol=0, atol=1e-4)
    assert (runs["lora_pp"] / "merged" / "config.json").is_file()


def tied_sliding_model(base, out):
    """A tiny Qwen3 whose embeddings and LM head are one weight (its two stage copies' gradients must add up)
    and whose layers alternate attention types by stage (full, then sliding windows of 8 tokens)."""
    import shutil

    from transformers import AutoConfig, Qwen3Config, Qwen3ForCausalLM

    config = AutoConfig.from_pretrained(base)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=config.vocab_size, hidden_size=64, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id, tie_word_embeddings=True,
        use_sliding_window=True, sliding_window=8, layer_types=["full_attention"] * 2 + ["sliding_attention"] * 2))
    model.save_pretrained(out)
    for path in base.iterdir():
        if path.name.startswith("tokenizer") or path.suffix == ".jinja":
            shutil.copy(path, out)
    return out


def test_tied_embeddings_and_per_stage_attention_types_train_what_one_process_trains(model4, tmp_path) -> None:
    model = tied_sliding_model(model4, tmp_path / "model")

    def args(out, micro_batch: int, *extra: str) -> list[str]:
        return ["--model_name_or_path", str(model), "--dataset_mixer_list", SAMPLE_NAME, "1.0", "--output_dir",
                str(out), "--max_train_steps", "3", "--logging_steps", "1", "--per_device_train_batch_size",
                str(micro_batch), "--gradient_accumulation_steps", "2", "--learning_rate", "3e-3", "--seed", "1",
                "--torch_dtype", "float32", "--max_seq_length", "256", *extra]

    run_finetune(args(tmp_path / "one", 4))
    run_launch(args(tmp_path / "pp", 2, *PP))
    one, pp = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "pp")
    assert [m["loss"] for m in pp] == pytest.approx([m["loss"] for m in one], rel=1e-5)
    assert pp[0]["grad_norm"] == pytest.approx(one[0]["grad_norm"], rel=1e-5)  # the tied weight counted once
    one_weights, pp_weights = load_weights(tmp_path / "one"), load_weights(tmp_path / "pp")
    assert one_weights.keys() == pp_weights.keys()
    for name, tensor in one_weights.items():
        torch.testing.assert_close(pp_weights[name], tensor, rtol=0, atol=1e-4, msg=name)


def test_a_layout_that_cannot_run_is_refused_before_loading(model4, tmp_path) -> None:
    result = run_finetune(args_for(model4, tmp_path / "out", 4, *PP), check=False)
    assert result.returncode == 2
    assert "--pipeline_parallel_size 2 must divide the number of processes (1)" in result.stderr
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_fp16_and_the_router_loss_of_an_moe_in_two_stages_train_what_data_parallelism_trains(moe_model,
                                                                                              tmp_path) -> None:
    """fp16 loss scaling and --load_balancing_loss under PP: the router logits of stage 1's layers travel with its
    hidden states, so the last stage's router loss is the unsplit model's; every rank unscales by one scale. The
    reference is DDP on the same 2 ranks (the router loss is per micro-batch, so the micro-batches must be the
    same ones)."""
    def args(out, *extra: str) -> list[str]:
        return ["--model_name_or_path", str(moe_model), "--dataset_mixer_list", SAMPLE_NAME, "96", "--output_dir",
                str(out), "--max_train_steps", "3", "--logging_steps", "1", "--per_device_train_batch_size", "2",
                "--gradient_accumulation_steps", "2", "--learning_rate", "3e-3", "--seed", "1", "--torch_dtype",
                "float16", "--max_seq_length", "128", "--load_balancing_loss", *extra]

    run_launch(args(tmp_path / "ddp"))
    run_launch(args(tmp_path / "pp", *PP))
    ddp, pp = read_metrics(tmp_path / "ddp"), read_metrics(tmp_path / "pp")
    assert len(pp) == len(ddp) == 3 and all(m["aux_loss"] > 0 and m["loss_scale"] == 2.0 ** 16 for m in pp)
    # measured: 9e-6 relative (loss), 3e-5 (aux_loss), 8e-5 (grad_norm) at step 3; without stage 1's router logits
    # the aux loss would be about half
    for key, rel in (("loss", 1e-4), ("aux_loss", 1e-4), ("grad_norm", 5e-4)):
        assert [m[key] for m in pp] == pytest.approx([m[key] for m in ddp], rel=rel), key


@pytest.mark.parametrize("name", ["pp", "lora_pp"])
def test_export_of_a_checkpoint_of_stages_is_the_runs_own_export(runs, name, tmp_path) -> None:
    """Each stage's file holds its parameters by their names in the whole model: `open_sft export` joins them
    into the run's own export (and the LoRA run's merged model), bitwise."""
    out = assert_export_is_the_runs(runs[name], STEPS, tmp_path / "export")
    assert json.loads((out / "export.json").read_text())["engine"] == "pipeline stages"


def test_export_of_fsdp2_sharded_stages_is_refused_with_the_way_on(runs, tmp_path) -> None:
    with pytest.raises(UserError, match="pipeline stages sharded by FSDP2.*the run's own export"):
        export_checkpoint(runs["fsdp_pp"] / "checkpoints" / f"step_{STEPS}", tmp_path / "export")
    assert not (tmp_path / "export").exists()
