"""Preflight: the memory estimate per rank against the measured peak RSS (±25 %), the time estimate of
--dry_run's probe against the real run's training time (±30 %), and the activation coefficients against
the bytes transformers' Llama really saves for backward.

The memory runs use a model big enough that parameters, optimizer states and activations are a large
share of the peak (not only the interpreter and libraries): hidden 256, 4 layers, 4k vocabulary, 512-token
blocks of text.

(Its fast in-process tests are in tests/unit/preflight/test_preflight.py.)
"""

from __future__ import annotations

import json
import random
import re

import pytest

from conftest import SAMPLE, read_metrics, run_finetune
from open_sft.preflight.estimate import GIB


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
