"""Preflight: the memory estimate per rank against the measured peak RSS (±25 %), the time estimate of
--dry_run's probe against the real run's training time (±30 %), and the activation coefficients against
the bytes transformers' Llama really saves for backward.

The memory runs use a model big enough that parameters, optimizer states and activations are a large
share of the peak (not only the interpreter and libraries): hidden 256, 4 layers, 4k vocabulary, 512-token
blocks of text.
"""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from conftest import SAMPLE, read_metrics, run_finetune
from open_sft.preflight.estimate import (
    GIB,
    ModelShape,
    RunShape,
    estimate_memory,
    format_seconds,
    micro_batch_positions,
    saved_activation_bytes,
)


@pytest.fixture(scope="module")
def mid_model_dir(tmp_path_factory):
    from open_sft.embedded.factory import build_embedded_default

    return build_embedded_default(tmp_path_factory.mktemp("mid_model"), vocab_size=4096, hidden_size=256,
                                  num_layers=4, num_heads=4, num_kv_heads=2, seed=0)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    """Documents long enough that every example is a full 512-token block."""
    words = SAMPLE.read_text().split()
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("text") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": " ".join(rng.choice(words) for _ in range(600))}) + "\n"
                            for _ in range(200)))
    return path


def base_args(model_dir, data, out, *extra):
    return ["--model_name_or_path", str(model_dir), "--dataset_mixer_list", str(data), "1.0", "--output_dir", str(out),
            "--max_seq_length", "512", "--logging_steps", "1", "--learning_rate", "1e-3", *extra]


MEMORY_RUNS = {  # name: (processes, deepspeed config, extra flags)
    "fp32": (1, None, ["--torch_dtype", "float32", "--per_device_train_batch_size", "6"]),
    "bf16_checkpointing": (1, None, ["--torch_dtype", "bfloat16", "--per_device_train_batch_size", "8",
                                     "--gradient_checkpointing"]),
    "lora": (1, None, ["--torch_dtype", "float32", "--per_device_train_batch_size", "4", "--use_lora",
                       "--lora_rank", "16"]),
    "zero2": (2, "zero2.json", ["--torch_dtype", "float32", "--per_device_train_batch_size", "4"]),
    "zero3_bf16": (2, "zero3.json", ["--torch_dtype", "bfloat16", "--per_device_train_batch_size", "4"]),
}


@pytest.mark.parametrize("name", MEMORY_RUNS)
def test_memory_estimate_within_25_percent_of_peak_rss(name, mid_model_dir, text_file, tmp_path) -> None:
    processes, ds_config, extra = MEMORY_RUNS[name]
    out = tmp_path / name
    # the allocator's high-water mark still grows over the first steps: measure a few
    result = run_finetune(base_args(mid_model_dir, text_file, out, "--max_train_steps", "4", *extra),
                          processes=processes, deepspeed_config=ds_config)
    assert "memory estimate per rank:" in result.stdout
    memory = json.loads((out / "run.json").read_text())["preflight"]["memory"]
    peak = read_metrics(out)[-1]["peak_memory_gib"] * GIB  # rank 0's peak resident set
    # The model's own share is large here, so a wrong model term cannot hide behind the process baseline.
    assert memory["total_bytes"] - memory["runtime_bytes"] > 0.25 * peak, memory
    assert 0.75 * peak <= memory["total_bytes"] <= 1.25 * peak, (memory, peak / GIB)


def test_dry_run_and_real_run_print_a_time_estimate(mid_model_dir, text_file, tmp_path) -> None:
    """A dry run prints the time and memory estimates and writes nothing; a real run logs its estimate
    after the probe steps. (How close the estimate is, is tested against given step times below: a
    test timing the machine fails when another job shares it.)"""
    args = ["--torch_dtype", "float32", "--per_device_train_batch_size", "2", "--max_train_steps", "16"]
    dry = run_finetune(base_args(mid_model_dir, text_file, tmp_path / "dry", "--dry_run", *args))
    assert not (tmp_path / "dry").exists()  # a dry run writes nothing
    assert re.search(r"time estimate: (\d+)m(\d+)s for 16 optimizer steps", dry.stdout), dry.stdout[-2000:]
    assert "memory estimate per rank:" in dry.stdout and "global batch: 2 per micro-batch × 1" in dry.stdout
    real = run_finetune(base_args(mid_model_dir, text_file, tmp_path / "real", *args))
    assert re.search(r"time estimate: (\d+)m(\d+)s for steps 1-16 \(measured on steps 2-4\)", real.stdout), \
        real.stdout[-2000:]


def test_time_probe_scales_the_probe_steps_by_token_positions() -> None:
    """Steps whose time is proportional to the token positions they compute are estimated exactly from
    the probe steps (after the warm-up one), whatever the other steps' sizes."""
    from open_sft.preflight.estimate import TimeProbe

    slots = [900, 400, 800, 1200, 300, 2000, 1000, 600]
    probe = TimeProbe(total_steps=len(slots), step_slots=slots)
    seconds_per_slot = 0.002
    for index, size in enumerate(slots):
        probe.record(index, 5.0 if index == 0 else seconds_per_slot * size)  # a slow warm-up step
    assert probe.done and probe.seconds == pytest.approx([0.8, 1.6, 2.4])
    assert probe.estimate_seconds(1, 1) == pytest.approx(seconds_per_slot * sum(slots[1:]))
    assert probe.estimate_seconds(4, 1) == pytest.approx(seconds_per_slot * sum(slots[4:]))


def test_step_timer_estimate_is_warmup_plus_probed_rate(monkeypatch) -> None:
    """StepTimer on a clock it is given: the estimate logged after the probe steps is the warm-up step's
    time plus the probed rate × the remaining token positions; a resumed launch starts from its step."""
    from open_sft.preflight import estimate as preflight

    slots = [100, 100, 200, 300, 100, 400]
    durations = iter([3.0, 0.1, 0.2, 0.3, 0.1, 0.4])  # a warm-up step, then 1 ms per position
    clock = [0.0]
    monkeypatch.setattr(preflight.time, "perf_counter", lambda: clock[0])
    logged = []
    timer = preflight.StepTimer(preflight.TimeProbe(len(slots), slots), 0, log=logged.append)
    for done in range(1, len(slots) + 1):
        clock[0] += next(durations)
        timer(done, None)
    assert timer.estimate == pytest.approx(3.0 + 0.001 * sum(slots[1:]))
    assert logged == ["time estimate: 0m04s for steps 1-6 (measured on steps 2-4)"]

    clock[0] = 0.0
    resumed = preflight.StepTimer(preflight.TimeProbe(len(slots), slots), 2, log=logged.append)
    for done, seconds in zip(range(3, 7), [1.0, 0.3, 0.1, 0.4]):
        clock[0] += seconds
        resumed(done, None)
    assert resumed.estimate == pytest.approx(1.0 + 0.001 * sum(slots[3:]))


def _saved_bytes(model, tokens: torch.Tensor, mask: torch.Tensor, autocast: bool) -> int:
    """Bytes of the distinct storages autograd saves for backward in the decoder, parameters excluded."""
    seen, total = set(), [0]

    def pack(tensor):
        key = tensor.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total[0] += tensor.untyped_storage().nbytes()
        return tensor

    seen.update(p.untyped_storage().data_ptr() for p in model.parameters())
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        model.model(input_ids=tokens, attention_mask=mask)
    return total[0]


@pytest.mark.parametrize("hidden,intermediate,layers,bf16,padded", [
    (256, 688, 4, False, False), (384, 1024, 2, False, True), (256, 688, 4, True, False), (512, 1376, 2, True, True),
])
def test_activation_coefficients_match_saved_tensors(hidden, intermediate, layers, bf16, padded) -> None:
    """The estimate's per-token coefficients equal what autograd really keeps for backward (±15 %)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=512, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).train()
    tokens = torch.randint(0, 512, (2, 256))
    mask = torch.ones_like(tokens)
    if padded:
        mask[1, 100:] = 0
    measured = _saved_bytes(model, tokens, mask, bf16)
    if bf16:  # autocast's bf16 copies of the layers' weights are saved too; the estimate counts them as parameters
        measured -= 2 * sum(p.numel() for p in model.model.layers.parameters() if p.ndim == 2)
    run = RunShape(1, 0, False, bf16, tokens.numel(), 0, False, attention_width=256 if padded else 0)
    estimated = saved_activation_bytes(ModelShape.of(model), run)
    assert 0.85 * measured <= estimated <= 1.15 * measured, (estimated / 2**20, measured / 2**20)


def _shape(params: int, trainable: int, param_bytes: int) -> ModelShape:
    return ModelShape(params=params, trainable=trainable, param_bytes=param_bytes, largest_param=params // 10,
                      matmul_params=trainable, hidden=1024, layers=8, intermediate=2816, vocab=32000)


def test_model_states_follow_zero_stage_lora_and_dtype() -> None:
    full = _shape(100_000_000, 100_000_000, 400_000_000)

    def states(model, **run):
        fields = dict(world_size=1, zero_stage=0, offload=False, bf16=False, micro_batch_tokens=0,
                      trained_tokens=0, gradient_checkpointing=False)
        estimate = estimate_memory(model, RunShape(**{**fields, **run}), runtime=0)
        return estimate.parameters, estimate.gradients, estimate.optimizer

    params, grads, optimizer = states(full)
    assert (params, grads) == (400_000_000, 400_000_000)
    assert optimizer == 1_200_000_000  # Adam's two fp32 moments + one step temporary
    _, _, zero2_optimizer = states(full, world_size=4, zero_stage=2)
    assert zero2_optimizer == 200_000_000  # 8 bytes × N / 4 ranks
    zero2_params = states(full, world_size=4, zero_stage=2, bf16=True)[0]
    zero3_params = states(full, world_size=4, zero_stage=3, bf16=True)[0]
    assert zero2_params == 200_000_000 + 100_000_000  # bf16 module copy + fp32 master partition
    assert zero3_params < zero2_params  # ZeRO-3 partitions the module's parameters too
    lora = _shape(100_000_000, 1_000_000, 400_000_000)
    lora_params, lora_grads, lora_optimizer = states(lora)
    assert lora_params == 400_000_000 and lora_grads == 4_000_000 and lora_optimizer == 12_000_000
    qlora = _shape(100_000_000, 1_000_000, 56_000_000)  # 4-bit base: packed bytes as loaded
    assert states(qlora)[0] == 56_000_000


def test_packed_micro_batch_positions_count_the_rows_as_collated() -> None:
    assert micro_batch_positions([100, 30, 7], packing=False, row_capacity=512) == 300
    # 300 + 300 + 200 do not fit one 512 row: rows [300, 200] and [300] → 2 rows of width 500
    assert micro_batch_positions([300, 300, 200], packing=True, row_capacity=512) == 1000


def test_format_seconds() -> None:
    assert format_seconds(59.6) == "1m00s"
    assert format_seconds(3725) == "1h02m05s"


def _auto_choice(stdout: str) -> tuple[int, int, list[tuple[int, float]], float]:
    match = re.search(r"--auto_micro_batch_size: micro-batch (\d+) × accumulation (\d+) per rank \(estimates: (.*?); "
                      r"budget ([\d.]+) GiB", stdout)
    assert match, stdout[-3000:]
    estimates = [(int(m[1]), float(m[2])) for m in re.finditer(r"(\d+) × \d+: ([\d.]+) GiB", match[3])]
    return int(match[1]), int(match[2]), estimates, float(match[4])


def test_auto_micro_batch_keeps_the_global_batch_and_the_losses(mid_model_dir, text_file, tmp_path) -> None:
    """Asked for 8 × 1 with 1 GiB per rank: a smaller micro-batch is chosen, the accumulation raised to
    keep 8 examples per step, and the loss trajectory is that of the 8 × 1 run."""
    common = ["--torch_dtype", "float32", "--per_device_train_batch_size", "8", "--max_train_steps", "3"]
    auto = run_finetune(base_args(mid_model_dir, text_file, tmp_path / "auto", *common, "--auto_micro_batch_size",
                                  "--max_memory_per_rank_gib", "1.0"))
    micro, accumulation, estimates, budget = _auto_choice(auto.stdout)
    assert micro < 8 and micro * accumulation == 8
    assert [m for m, _ in estimates] == [8, 4, 2, 1][: len(estimates)]
    assert all(gib > budget for m, gib in estimates if m > micro)  # every larger micro-batch was over budget
    assert dict(estimates)[micro] <= budget
    schedule = json.loads((tmp_path / "auto" / "run.json").read_text())["schedule"]
    assert (schedule["micro_batch_size"], schedule["gradient_accumulation_steps"]) == (micro, accumulation)
    assert schedule["global_batch_size"] == 8

    run_finetune(base_args(mid_model_dir, text_file, tmp_path / "fixed", *common))
    auto_losses = [r["loss"] for r in read_metrics(tmp_path / "auto")]
    fixed_losses = [r["loss"] for r in read_metrics(tmp_path / "fixed")]
    assert len(auto_losses) == 3
    assert auto_losses == pytest.approx(fixed_losses, rel=1e-5)


def test_auto_micro_batch_ranks_agree_under_zero2(mid_model_dir, text_file, tmp_path) -> None:
    out = tmp_path / "zero2"
    result = run_finetune(base_args(mid_model_dir, text_file, out, "--torch_dtype", "float32", "--max_train_steps", "2",
                                    "--per_device_train_batch_size", "4", "--auto_micro_batch_size",
                                    "--max_memory_per_rank_gib", "0.9"), processes=2, deepspeed_config="zero2.json")
    micro, accumulation, _, _ = _auto_choice(result.stdout)
    schedule = json.loads((out / "run.json").read_text())["schedule"]
    assert micro < 4 and (schedule["micro_batch_size"], schedule["gradient_accumulation_steps"]) == (micro, accumulation)
    assert schedule["global_batch_size"] == 8
    orders = [json.loads((out / f"data_order.rank{r}.json").read_text())["example_indices"] for r in (0, 1)]
    assert len(orders[0]) == len(orders[1]) == 2 * 4 and not set(orders[0]) & set(orders[1])


def test_auto_micro_batch_refuses_packing(tmp_path) -> None:
    result = run_finetune(["--model_name_or_path", str(tmp_path), "--dataset_mixer_list", str(SAMPLE), "1.0",
                           "--packing", "--auto_micro_batch_size", "--output_dir", str(tmp_path / "out")], check=False)
    assert result.returncode == 2
    assert "--auto_micro_batch_size cannot keep the packing" in result.stderr
