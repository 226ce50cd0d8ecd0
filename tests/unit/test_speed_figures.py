"""The figures the GPU check's speed parts report, from runs' results: repeats folded into a median and a spread,
each open_sft row over TRL's fastest of the same kind and mode, FP8's loss against bf16's, and the Markdown row."""

from __future__ import annotations


import pytest

from conftest import load_script
from tests.gpu_check.report import runs_table
from tests.gpu_check.speed import FP8_TOLERANCE, fp8_against_bf16


@pytest.fixture(scope="module")
def benchmark():
    return load_script("benchmark")


def _ours(variant: str, rate: float) -> dict:
    return {"tool": "open_sft", "label": f"open_sft {variant}", "variant": variant, "compiled": "compile" in variant,
            "tokens_per_second": rate, "mfu": rate / 1e5, "peak_gib": rate / 1e4}


def _trl(variant: str, rate: float, compiled: bool = False) -> dict:
    return {"tool": "trl SFTTrainer", "label": f"trl {variant} {compiled}", "variant": variant, "compiled": compiled,
            "tokens_per_second": rate, "peak_gib": 1.0}


def test_repeats_fold_into_their_median_and_spread(benchmark) -> None:
    runs = [_ours("plain", 100.0), _ours("plain", 120.0), _ours("plain", 90.0), _trl("plain", 50.0)]
    rows = benchmark.aggregate(runs)
    assert [r["label"] for r in rows] == ["open_sft plain", "trl plain False"]
    plain = rows[0]
    assert plain["repeats"] == [100.0, 120.0, 90.0] and plain["tokens_per_second"] == 100.0
    assert plain["spread"] == pytest.approx(0.3)  # (120 - 90) / 100
    assert plain["peak_gib"] == 0.012  # the highest repeat's
    assert plain["mfu"] == pytest.approx(100.0 / 1e5)  # the first repeat's MFU, scaled to the median's tokens/s


def test_each_row_is_compared_with_trl_of_its_own_kind_and_mode(benchmark) -> None:
    rows = [_ours("plain", 300.0), _ours("compile", 400.0), _ours("lora", 90.0),
            _trl("plain", 100.0), _trl("plain", 200.0, compiled=True), _trl("lora", 60.0), _trl("qlora", 30.0)]
    benchmark.compare_with_trl(rows)
    eager, compiled, lora = rows[:3]
    assert eager["over_trl_best"] == 1.5 and eager["over_trl_same_mode"] == 3.0  # best TRL is compiled
    assert compiled["over_trl_best"] == compiled["over_trl_same_mode"] == 2.0
    assert lora["over_trl_best"] == 1.5  # against TRL + PEFT LoRA, not QLoRA or full training
    assert [benchmark.kind(r) for r in rows[3:]] == ["full", "full", "lora", "qlora"]


def test_fp8_loss_is_held_to_its_tolerance() -> None:
    bf16 = [3.0 - 0.01 * i for i in range(120)]
    close = [x * 1.004 for x in bf16]
    verdict = fp8_against_bf16(bf16, close)
    assert verdict["within"] and verdict["max_step_rel_diff"] == pytest.approx(0.004)
    assert verdict["tolerance"] == FP8_TOLERANCE
    drifting = bf16[:70] + [x * 1.02 for x in bf16[70:]]  # every step within 3 %, the last 50 2 % off
    assert not fp8_against_bf16(bf16, drifting)["within"]
    spike = list(bf16)
    spike[10] *= 1.05
    assert not fp8_against_bf16(bf16, spike)["within"]
    assert not fp8_against_bf16(bf16, close[:-1])["within"]  # a run cut short is no verdict


def test_a_speed_row_shows_both_mfu_counts_memory_and_the_ratios() -> None:
    row = {"label": "open_sft bfloat16 + fp8", "tokens_per_second": 71234.4, "spread": 0.031, "repeats": [1, 2, 3],
           "mfu": 0.41, "mfu_palm": 0.52, "peak_gib": 41.25, "peak_reserved_gib": 44.5, "estimate_gib": 43.1,
           "over_trl_best": 1.62, "over_trl_same_mode": 1.8}
    header, rule, line = runs_table([row])
    assert "MFU, PaLM count" in header and "reserved GiB" in header and header.count("|") == rule.count("|")
    assert line == "| open_sft bfloat16 + fp8 | 71,234 | 3.1% | 3 | 41.0% | 52.0% | 41.25 | 44.5 | 43.1 | 1.62 | 1.8 |"
