"""Tensor parallelism combined with FSDP2 through finetune.py on 4 real gloo ranks: accelerate's ParallelismConfig
(dp_shard 2 × tp 2), the model's transformers tp_plan.

Each rank holds half of every attention and MLP weight (and of the LM head), FSDP2 shards those halves over 2
ranks, and a TP group computes its two members' micro-batches together, so the 4 ranks must train what one
process trains on the same global batch (fp32): the same per-step losses, evaluation and final weights. A kill -9
and relaunch continues exactly from the sharded checkpoint of 2-D DTensors; the export is the whole model. Packed
rows in bf16 with activation checkpointing train under TP what FSDP2 alone trains, and LoRA what one process
trains.
"""

from __future__ import annotations

import json
import signal
import subprocess

import pytest
import torch
from safetensors.torch import load_file as load_weights_file
from torch.distributed.checkpoint import FileSystemReader

from conftest import ROOT, SAMPLE, child_env, read_metrics, run_finetune
from integration.test_checkpoint import assert_continues_exactly, interrupt, load_weights, reloaded_loss
from integration.test_fsdp import FLAGS, LORA, STEPS, args_for, fsdp_command, losses
from integration.test_lora import lora_pairs

TP = ["--use_parallelism_config", "--parallelism_config_dp_shard_size", "2", "--parallelism_config_tp_size", "2"]
YAML = ["--config_file", str(ROOT / "configs" / "accelerate" / "fsdp2_tp.yaml"),
        "--parallelism_config_dp_shard_size", "2", "--parallelism_config_tp_size", "2"]


def run_tp(launch: list[str], args: list[str], check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(fsdp_command(launch, processes=4) + args, cwd=ROOT, env=child_env(), capture_output=True,
                            text=True, timeout=600)
    if check and result.returncode != 0:
        raise AssertionError(f"finetune failed ({result.returncode}):\n{result.stdout[-3000:]}\n"
                             f"{result.stderr[-5000:]}")
    return result


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory) -> dict:
    """One process: micro-batch 4 × accumulation 2; 4 ranks (2 FSDP shards × 2 TP): micro-batch 1 × 2 × 4."""
    out = {name: tmp_path_factory.mktemp(name) for name in
           ("one", "tp", "killed", "packed_fsdp", "packed_tp", "lora_one", "lora_tp")}
    run_finetune(args_for(tiny_model_dir, out["one"], 4))
    result = run_tp([*FLAGS, *TP], args_for(tiny_model_dir, out["tp"], 1))
    killed_args = args_for(tiny_model_dir, out["killed"], 1)
    kill_code = interrupt("zero2", killed_args, out["killed"], 3, signal.SIGKILL, out["killed"] / "killed.log",
                          command=fsdp_command(YAML, processes=4))
    relaunch = run_tp(YAML, killed_args)
    # packed steps depend on the world size (a micro-batch is a row of the token budget): compared on 4 ranks
    packed = ("--torch_dtype", "bfloat16", "--packing")
    run_tp(FLAGS, args_for(tiny_model_dir, out["packed_fsdp"], 1, *packed))
    run_tp([*FLAGS, *TP], args_for(tiny_model_dir, out["packed_tp"], 1, *packed, "--gradient_checkpointing"))
    run_finetune(args_for(tiny_model_dir, out["lora_one"], 4, *LORA))
    run_tp([*FLAGS, *TP], args_for(tiny_model_dir, out["lora_tp"], 1, *LORA, "--merge_lora_on_save"))
    return {**out, "base": tiny_model_dir, "stdout": result.stdout, "kill_code": kill_code,
            "relaunch": relaunch.stdout + relaunch.stderr}


def test_fsdp2_with_tensor_parallel_trains_what_one_process_trains(runs) -> None:
    reference = losses(runs["one"])
    assert len(reference) == STEPS
    # measured: equal to 1e-8 relative (TP's all-reduces and FSDP's reduce-scatter reorder fp32 sums only)
    assert losses(runs["tp"]) == pytest.approx(reference, rel=1e-5)
    one, tp = load_weights(runs["one"]), load_weights(runs["tp"])
    assert one.keys() == tp.keys() and len(one) > 10
    for name, tensor in one.items():  # the export is whole: every weight at its full shape
        assert tp[name].shape == tensor.shape and tp[name].dtype == torch.float32, name
        # measured: at most 1.8e-5 apart (Adam amplifies reordered fp32 sums)
        torch.testing.assert_close(tp[name], tensor, rtol=0, atol=1e-4, msg=name)


def test_evaluation_under_tensor_parallel_equals_one_process(runs) -> None:
    def evals(output_dir) -> list[tuple[float, int]]:
        return [(m["eval_loss"], m["eval_tokens"]) for m in read_metrics(output_dir) if "eval_loss" in m]

    (loss, tokens), = evals(runs["tp"])
    (reference, reference_tokens), = evals(runs["one"])
    assert tokens == reference_tokens  # each example counted once, not once per TP rank
    assert loss == pytest.approx(reference, rel=1e-5)


def test_the_run_says_its_layout(runs) -> None:
    run = json.loads((runs["tp"] / "run.json").read_text())
    assert run["distributed_type"] == "FSDP" and run["world_size"] == 4
    parallel = run["preflight"]["parallel"]
    assert parallel["tensor"] == 2 and parallel["fsdp"]["tensor_parallel"] == 2 and parallel["fsdp"]["shards"] == 4
    assert run["schedule"]["global_batch_size"] == 8  # micro-batch 1 × accumulation 2 × 4 ranks, as without TP
    assert "in 2 FSDP shards × tensor parallel 2" in runs["stdout"]
    # 7 per layer, the embedding (vocabulary-parallel) and the LM head
    assert "tensor parallel 2: 16 weights sharded by the model's tp_plan" in runs["stdout"]
    config = json.loads((runs["tp"] / "config.json").read_text())
    assert "distributed_config" not in config  # the export is a plain model, loadable on one process


def test_checkpoints_hold_the_2d_shards(runs) -> None:
    step = runs["tp"] / "checkpoints" / f"step_{STEPS}"
    assert (step / "COMPLETE").is_file()
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):
        assert sorted(p.name for p in (step / part).glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]
    identity = json.loads((step / "trainer_state.json").read_text())["identity"]
    assert identity["engine"] == "fsdp2" and identity["tensor_parallel_size"] == 2


def test_kill_9_and_relaunch_from_the_yaml_continues_exactly(runs) -> None:
    assert runs["kill_code"] != 0
    assert "resuming from" in runs["relaunch"]
    assert_continues_exactly(runs["killed"], runs["tp"], STEPS)


def test_the_export_reloads_in_a_fresh_process(runs) -> None:
    assert reloaded_loss(runs["tp"]) == pytest.approx(reloaded_loss(runs["one"]), rel=1e-4)


def test_packed_bf16_with_checkpointing_under_tensor_parallel_equals_fsdp2_alone(runs) -> None:
    """Turning TP on changes nothing in what is trained: 4 ranks of FSDP2 with and without TP, packed rows (each
    example attended on its own), bf16 compute on fp32 masters, activation checkpointing under TP."""
    # measured 4.5e-5 relative (fp32 with the same flags: 7.6e-8)
    assert losses(runs["packed_tp"]) == pytest.approx(losses(runs["packed_fsdp"]), rel=5e-4)
    assert len(losses(runs["packed_tp"])) == STEPS
    assert {t.dtype for t in load_weights(runs["packed_tp"]).values()} == {torch.float32}  # the fp32 masters


def test_lora_under_tensor_parallel_trains_what_one_process_trains(runs) -> None:
    """The wrapped layers keep their slices (base_layer), lora_B is sliced by output under colwise layers and
    lora_A by input under rowwise ones; only the adapters have optimizer state; the exports are whole."""
    # measured: 3.2e-8 relative
    assert losses(runs["lora_tp"]) == pytest.approx(losses(runs["lora_one"]), rel=1e-5)
    assert losses(runs["lora_tp"]) != pytest.approx(losses(runs["tp"]), rel=1e-3)  # not full fine-tuning
    one = load_weights_file(runs["lora_one"] / "adapter_model.safetensors")
    tp = load_weights_file(runs["lora_tp"] / "adapter_model.safetensors")
    assert one.keys() == tp.keys() and len(one) == 28  # 7 layers' A and B in each of 2 blocks
    for name, tensor in one.items():  # measured: at most 2.5e-6 apart
        assert tp[name].shape == tensor.shape, name
        torch.testing.assert_close(tp[name], tensor, rtol=0, atol=1e-4, msg=name)
    optimizer = FileSystemReader(str(runs["lora_tp"] / "checkpoints" / f"step_{STEPS}" / "optimizer_0"))
    held = [key for key in optimizer.read_metadata().state_dict_metadata if ".exp_avg" in key]
    assert held and all("lora_A" in key or "lora_B" in key for key in held)
    base, merged = load_weights(runs["base"]), load_weights(runs["lora_tp"] / "merged")
    pairs = lora_pairs(tp)
    assert merged.keys() == base.keys() and pairs
    for key, weight in base.items():  # the untouched base plus each adapter's update (lora_alpha 8 / rank 4)
        lora_a, lora_b = pairs.get(key, (None, None))
        expected = weight if lora_a is None else weight + 8 / 4 * lora_b @ lora_a
        torch.testing.assert_close(merged[key], expected, rtol=0, atol=1e-6, msg=key)


def family_model(tiny_model_dir, out, family: str):
    """A small random model of another family with the tiny model's tokenizer: Qwen3 (per-head q/k norms, whose
    weights are whole on every rank while their inputs hold this rank's heads) or OLMo2 (q/k norms over the
    whole projection, so its plan gathers q/k/v and splits o_proj's input)."""
    import shutil

    from transformers import AutoConfig, Olmo2Config, Olmo2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    base = AutoConfig.from_pretrained(tiny_model_dir)
    shape = dict(vocab_size=base.vocab_size, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, bos_token_id=base.bos_token_id,
                 eos_token_id=base.eos_token_id, pad_token_id=base.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**shape, head_dim=16)) if family == "qwen3" else \
        Olmo2ForCausalLM(Olmo2Config(**shape))
    model.save_pretrained(out)
    for path in tiny_model_dir.iterdir():
        if path.name.startswith("tokenizer") or path.suffix == ".jinja":
            shutil.copy(path, out)
    return out


@pytest.mark.parametrize("family", ["qwen3", "olmo2"])
def test_other_families_plans_train_what_one_process_trains(family, tiny_model_dir, tmp_path) -> None:
    model = family_model(tiny_model_dir, tmp_path / "model", family)

    def args(out, micro_batch: int) -> list[str]:
        return ["--model_name_or_path", str(model), "--dataset_mixer_list", str(SAMPLE), "1.0", "--output_dir",
                str(out), "--max_train_steps", "3", "--logging_steps", "1", "--per_device_train_batch_size",
                str(micro_batch), "--gradient_accumulation_steps", "2", "--learning_rate", "3e-3", "--seed", "1",
                "--torch_dtype", "float32", "--max_seq_length", "256"]

    run_finetune(args(tmp_path / "one", 4))
    run_tp([*FLAGS, *TP], args(tmp_path / "tp", 1))
    one, tp = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "tp")
    # measured: qwen3 losses 6.4e-8 apart and its q/k norm weights 1.2e-7; olmo2 1.2e-6 (FSDP2 alone: 2.6e-7;
    # Adam's first, sign-like step amplifies fp32 reordering more in this family)
    assert [m["loss"] for m in tp] == pytest.approx([m["loss"] for m in one], rel=1e-5)
    assert tp[0]["grad_norm"] == pytest.approx(one[0]["grad_norm"], rel=1e-5)  # the first step's whole gradient
    if family == "qwen3":  # the per-head norms' gradients are summed over the TP group's heads
        one_weights, tp_weights = load_weights(tmp_path / "one"), load_weights(tmp_path / "tp")
        norms = [name for name in one_weights if "q_norm" in name or "k_norm" in name]
        assert len(norms) == 4
        for name in norms:
            torch.testing.assert_close(tp_weights[name], one_weights[name], rtol=0, atol=1e-5, msg=name)
