"""LoRA and QLoRA: only adapters train, the saved adapter and the merged model agree, ZeRO-3 matches
one process, and QLoRA (bitsandbytes' CPU backend, NF4 + double quantization, bf16 compute) trains.

(Its fast in-process tests are in tests/unit/model/test_lora.py.)
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, SAMPLE, child_env, read_metrics, run_finetune, side_by_side
from export_check import assert_export_is_the_runs
from open_sft.errors import UserError
from open_sft.export.from_checkpoint import export_checkpoint
from open_sft.config.args import LoraArguments
from unit.model.test_model_options import make_batch


RANK, ALPHA = 8, 16


SCALING = ALPHA / RANK


STEPS = 12


LORA_RUNS = {  # name: (processes, deepspeed config, micro-batch, accumulation); global batch 8 in both
    "single": (1, None, 4, 2),
    "zero2": (2, "zero2.json", 2, 2),
    "zero3": (2, "zero3.json", 2, 2),
}


QLORA_STEPS = 40


QLORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


def lora_flags(model_dir, output_dir, steps: int, rank: int, lr: str) -> list[str]:
    return ["--model_name_or_path", str(model_dir), "--dataset_mixer_list", str(SAMPLE), "1.0",
            "--output_dir", str(output_dir), "--max_train_steps", str(steps), "--learning_rate", lr,
            "--warmup_ratio", "0.1", "--logging_steps", "1", "--seed", "1", "--max_seq_length", "256",
            "--lora_rank", str(rank), "--lora_alpha", str(2 * rank), "--lora_dropout", "0.0", "--merge_lora_on_save"]


@pytest.fixture(scope="module")
def lora_runs(tiny_model_dir, tmp_path_factory) -> dict:
    def launch(name: str) -> tuple:
        processes, ds_config, micro_batch, accumulation = LORA_RUNS[name]
        output_dir = tmp_path_factory.mktemp(f"lora_{name}")
        flags = lora_flags(tiny_model_dir, output_dir, STEPS, RANK, "1e-2") + [
            "--use_lora", "--torch_dtype", "float32", "--per_device_train_batch_size", str(micro_batch),
            "--gradient_accumulation_steps", str(accumulation), "--checkpointing_steps", str(STEPS)]
        result = run_finetune(flags, processes=processes, deepspeed_config=ds_config)
        return output_dir, result.stdout + result.stderr

    done = {name: launch(name) for name, run in LORA_RUNS.items() if run[0] == 1}
    done.update(side_by_side({name: lambda n=name: launch(n) for name, run in LORA_RUNS.items() if run[0] == 2},
                             processes=2))
    out = {}
    for name in LORA_RUNS:
        out[name], out[f"{name}_log"] = done[name]
    return out


@pytest.fixture(scope="module")
def qlora_run(tiny_model_dir, tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("qlora")
    run_finetune(lora_flags(tiny_model_dir, output_dir, QLORA_STEPS, 16, "1e-2")
                 + ["--use_qlora", "--per_device_train_batch_size", "8", "--lora_target_modules", *QLORA_TARGETS,
                    "--checkpointing_steps", str(QLORA_STEPS)])
    return output_dir


def lora_pairs(adapter: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Base-model weight key → (A, B) from a saved adapter."""
    pairs = {}
    for key in adapter:
        if key.endswith(".lora_A.weight"):
            module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            pairs[f"{module}.weight"] = (adapter[key], adapter[key.replace("lora_A", "lora_B")])
    return pairs


def test_a_plain_lora_run_logs_no_third_party_noise(lora_runs) -> None:
    """Output redirected (not a terminal): no progress bars, no bitsandbytes warning about its optional kernels
    (not a QLoRA run), no FutureWarning from peft's own call, the schedule as one readable line."""
    log = lora_runs[f"{next(iter(LORA_RUNS))}_log"]
    for noise in ("Loading weights", "Writing model shards", "it/s]", "kernels-community", "FutureWarning",
                  "is_gradient_checkpointing", "schedule: {"):
        assert noise not in log, noise
    assert re.search(r"schedule: \d+ optimizer steps \(1 epoch\(s\) of \d+, \d+ warming up\), each \d+ examples × "
                     r"\d+ accumulation × \d+ rank\(s\) = \d+ examples", log), log[-3000:]


@pytest.mark.parametrize("name", LORA_RUNS)
def test_lora_output_layout_and_frozen_base(lora_runs, tiny_model_dir, name) -> None:
    out = lora_runs[name]
    for required in ("adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "generation_config.json",
                     "merged/config.json", "merged/model.safetensors", "merged/tokenizer.json"):
        assert (out / required).exists(), required
    assert not (out / "config.json").exists()  # see open_sft/model/lora.py: it would make loaders apply the adapter twice
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (RANK, ALPHA, str(tiny_model_dir))
    adapter = load_file(out / "adapter_model.safetensors")
    assert len(adapter) == 2 * 7 * 2 and all(".lora_A." in k or ".lora_B." in k for k in adapter)
    base = load_file(tiny_model_dir / "model.safetensors")
    merged = load_file(out / "merged" / "model.safetensors")
    assert merged.keys() == base.keys()
    pairs = lora_pairs(adapter)
    for key, weight in base.items():
        if key in pairs:  # merged = frozen base + the adapter's update, and the update is not zero
            lora_a, lora_b = pairs[key]
            assert float(lora_b.abs().min(dim=1).values.max()) > 0, key
            torch.testing.assert_close(merged[key], weight + SCALING * lora_b @ lora_a, rtol=0, atol=1e-6, msg=key)
        else:  # embeddings, norms, LM head: never trained
            assert torch.equal(merged[key], weight), key


@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_two_rank_lora_matches_one_process(lora_runs, name) -> None:
    single = [m["loss"] for m in read_metrics(lora_runs["single"])]
    multi = [m["loss"] for m in read_metrics(lora_runs[name])]
    assert len(single) == STEPS and single[-1] < single[0] - 0.2
    assert multi == pytest.approx(single, rel=1e-5)
    a = load_file(lora_runs["single"] / "adapter_model.safetensors")
    b = load_file(lora_runs[name] / "adapter_model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=1e-4, msg=key)


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits.float()


@pytest.mark.parametrize("name", LORA_RUNS)
def test_merged_model_logits_equal_adapter_logits(lora_runs, tiny_model_dir, name) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = lora_runs[name]
    ids = make_batch(seed=3)["input_ids"]
    base_logits = _logits(AutoModelForCausalLM.from_pretrained(tiny_model_dir), ids)
    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), out)
    adapter_logits = _logits(adapter, ids)
    merged_logits = _logits(AutoModelForCausalLM.from_pretrained(out / "merged"), ids)
    torch.testing.assert_close(merged_logits, adapter_logits, rtol=1e-5, atol=1e-5)
    # The output directory itself loads as base + adapter (once) with plain transformers.
    torch.testing.assert_close(_logits(AutoModelForCausalLM.from_pretrained(out), ids), adapter_logits,
                               rtol=1e-5, atol=1e-5)
    assert float((adapter_logits - base_logits).abs().max()) > 0.05


def test_qlora_trains_on_cpu(qlora_run, tiny_model_dir) -> None:
    metrics = read_metrics(qlora_run)
    assert [m["step"] for m in metrics] == list(range(1, QLORA_STEPS + 1))
    first = sum(m["loss"] for m in metrics[:3]) / 3
    last = sum(m["loss"] for m in metrics[-3:]) / 3
    assert first - last > 1.5, (first, last)
    info = json.loads((qlora_run / "run.json").read_text())
    assert info["compute_dtype"] == "torch.bfloat16"
    adapter = load_file(qlora_run / "adapter_model.safetensors")
    # the adapters alone: not the frozen base weight of the targeted LM head, which peft would save whole
    assert not [key for key in adapter if ".base_layer." in key]
    assert len(adapter) == 2 * 7 * 2 + 2 and all(t.dtype == torch.float32 for t in adapter.values())
    merged_config = json.loads((qlora_run / "merged" / "config.json").read_text())
    assert merged_config["dtype"] == "bfloat16" and "quantization_config" not in merged_config
    merged = load_file(qlora_run / "merged" / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in merged.values())


def test_qlora_merge_dequantizes_to_bf16(qlora_run, tiny_model_dir) -> None:
    """Merged = bf16(dequantized NF4 base + B·A·alpha/r), checked weight by weight. Then its logits
    against the trained setup (4-bit base with bf16 matmuls, fp32 adapter): they may differ by what
    storing weights in bf16 does, which depends on how well conditioned the trained model is (on some
    CPUs a briefly trained tiny model turns out so ill-conditioned that bf16 rounding moves its logits
    by half their spread). So that effect is measured on the merged model itself, as the logit change
    from a seeded 2^-9 relative perturbation of every weight, and the merge may not differ by more
    than 3× that; training moved the logits far beyond either."""
    import bitsandbytes as bnb
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from open_sft.model.lora import quantization_config

    quantized = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, quantization_config=quantization_config(LoraArguments(use_qlora=True)),
        dtype=torch.float32, device_map={"": "cpu"})
    adapter_model = PeftModel.from_pretrained(quantized, qlora_run)
    merged = load_file(qlora_run / "merged" / "model.safetensors")
    pairs = lora_pairs(load_file(qlora_run / "adapter_model.safetensors"))
    dequantized = 0
    for name, module in adapter_model.get_base_model().named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            key = f"{name.removesuffix('.base_layer')}.weight"
            lora_a, lora_b = pairs[key]
            base = bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state).float()
            expected = (base + 2.0 * lora_b @ lora_a).to(torch.bfloat16)  # alpha / r = 32 / 16
            torch.testing.assert_close(merged[key], expected, rtol=0, atol=0, msg=key)
            dequantized += 1
    assert dequantized == 2 * 7  # every block linear was 4-bit; lm_head stayed unquantized

    ids = make_batch(seed=3)["input_ids"]
    adapter_logits = _logits(adapter_model, ids)
    model = AutoModelForCausalLM.from_pretrained(qlora_run / "merged", dtype=torch.float32)
    merged_logits = _logits(model, ids)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(1 + 2**-9 * torch.randn(parameter.shape, generator=generator))
    sensitivity = float((_logits(model, ids) - merged_logits).abs().max())
    base_logits = _logits(AutoModelForCausalLM.from_pretrained(tiny_model_dir), ids)
    error = float((merged_logits - adapter_logits).abs().max())
    assert error < 3 * sensitivity, (error, sensitivity)
    assert float((adapter_logits - base_logits).abs().max()) > 5 * max(error, sensitivity)


def test_offline_merge_cli_equals_merge_on_save(lora_runs, tmp_path) -> None:
    """`python -m open_sft merge-lora` (what scripts/merge_lora.sh runs) gives the merge the run wrote."""
    from open_sft.export.merge_adapter import main as merge_main

    out = lora_runs["single"]
    assert merge_main([str(out), str(tmp_path / "m"), "--dtype", "float32"]) == 0
    offline = load_file(tmp_path / "m" / "model.safetensors")
    on_save = load_file(out / "merged" / "model.safetensors")
    assert offline.keys() == on_save.keys()
    for key in on_save:
        torch.testing.assert_close(offline[key], on_save[key], rtol=0, atol=1e-6, msg=key)
    assert merge_main([str(tmp_path), str(tmp_path / "n")]) == 2  # not a LoRA run: clear error


def test_qlora_under_ddp_matches_one_process_and_resumes_exactly(tiny_model_dir, tmp_path) -> None:
    """QLoRA under plain multi-process DDP (`accelerate launch --multi_gpu`, 2 gloo ranks, micro-batch 4 each)
    trains the same per-step losses as one process with micro-batch 8: the README's advice for QLoRA beyond one
    process (DeepSpeed and FSDP2 refuse it). The DDP run, relaunched after a kill right after its step-2 checkpoint
    (the same command, as a requeue), continues to the straight run's losses and adapter, bitwise: the checkpoint
    holds the trained weights, not the 4-bit base (training.trained_state), whose quantization state the strict load
    refused before. (One process goes through the same load: tests/unit/training/test_trained_state.py.)"""
    losses = {}
    for name, processes, micro_batch in (("one", 1, "8"), ("ddp", 2, "4"), ("ddp_resumed", 2, "4")):
        out = tmp_path / name
        if name == "ddp_resumed":  # what a kill right after step_2 leaves
            shutil.copytree(tmp_path / "ddp" / "checkpoints" / "step_2", out / "checkpoints" / "step_2")
            shutil.copy(tmp_path / "ddp" / "metrics.jsonl", out / "metrics.jsonl")
        result = run_finetune(lora_flags(tiny_model_dir, out, 4, 8, "1e-2") + [
            "--use_qlora", "--per_device_train_batch_size", micro_batch, "--checkpointing_steps", "2"],
            processes=processes)
        losses[name] = [m["loss"] for m in read_metrics(out) if "loss" in m]
        assert (out / "adapter_model.safetensors").exists()
    assert "resuming from" in result.stdout + result.stderr and len(losses["ddp"]) == 4
    assert losses["ddp_resumed"] == losses["ddp"]
    straight, resumed = (load_file(tmp_path / name / "adapter_model.safetensors") for name in ("ddp", "ddp_resumed"))
    assert straight.keys() == resumed.keys() and all(torch.equal(straight[k], resumed[k]) for k in straight)
    stored = load_file(tmp_path / "ddp" / "checkpoints" / "step_2" / "model.safetensors")
    assert len(stored) == len(straight) and all(".lora_" in k for k in stored)  # the trained weights alone
    identity = json.loads((tmp_path / "ddp" / "checkpoints" / "step_2" / "trainer_state.json").read_text())["identity"]
    assert re.fullmatch(r"local files [0-9a-f]{16}", identity["base"])  # the base it quantizes again: the resume's
    # bf16 compute: the two layouts' matmuls round differently
    assert losses["ddp"] == pytest.approx(losses["one"], rel=2e-3), losses


@pytest.mark.parametrize("name", list(LORA_RUNS))
def test_export_of_a_lora_checkpoint_is_the_runs_own_adapter_and_merge(lora_runs, name, tmp_path) -> None:
    """The adapter and the merged model from the last checkpoint, bitwise the run's own (ZeRO-3: the frozen base
    weights from each rank's fragments)."""
    assert_export_is_the_runs(lora_runs[name], STEPS, tmp_path / "export")


def test_export_of_a_qlora_checkpoint_gives_its_adapter_and_refuses_the_merge_naming_the_way(qlora_run,
                                                                                           tmp_path) -> None:
    checkpoint = qlora_run / "checkpoints" / f"step_{QLORA_STEPS}"
    out = export_checkpoint(checkpoint, tmp_path / "adapter", merge=False)
    ours, theirs = load_file(out / "adapter_model.safetensors"), load_file(qlora_run / "adapter_model.safetensors")
    assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 16
    with pytest.raises(UserError, match="--no_merge_lora.*open_sft merge-lora"):
        export_checkpoint(checkpoint, tmp_path / "merged")
    assert not (tmp_path / "merged").exists()


def test_a_run_without_lora_does_not_import_peft() -> None:
    """What every run imports (the model loader, the export, the LoRA module's uses_lora) leaves peft out:
    `import peft` imports bitsandbytes, which sets up torch.compile, seconds of CPU per rank at each start;
    a LoRA run imports it where it calls it. Without peft no PeftModel exists, which is_peft_model says."""
    code = ("import sys, torch\n"
            "import open_sft.run, open_sft.model.load, open_sft.model.lora, open_sft.export.save\n"
            "from open_sft.model.anatomy import is_peft_model\n"
            "assert not is_peft_model(torch.nn.Linear(2, 2))\n"
            "print(sorted(m for m in ('peft', 'bitsandbytes') if m in sys.modules))\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=child_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"
