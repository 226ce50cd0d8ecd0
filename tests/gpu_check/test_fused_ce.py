"""The fused_ce probe: the chunked LM-head loss (and Liger's, where it runs) as exact as plain cross-entropy
against a float64 reference, in fp32 and under bf16 autocast."""

from __future__ import annotations

import pytest

from tests.gpu_check import fused_ce
from tests.gpu_check.measure import record, short, smoke

FP32 = 1e-4  # relative error of the loss and both gradients to the float64 reference: fp32 rounding
BF16_TIMES, BF16_FLOOR = 2, 4e-3  # bf16: within 2x the plain bf16 path's error, plus bf16's own rounding
CAPPED = 1e-4  # Liger with a cap and a scale against the fused loss, fp32
ERRORS = ("loss", "grad_hidden", "grad_weight")


@pytest.fixture(scope="module")
def figures() -> dict:
    measured = fused_ce.measure(smoke())
    measured["tolerance"] = (
        f"fp32: relative error < {short(FP32)}; bf16: each candidate's error <= {BF16_TIMES} x plain bf16 error + "
        f"{short(BF16_FLOOR)}; Liger with a cap and a scale within {short(CAPPED)} of the fused loss (fp32)")
    return record(measured)


def test_fused_ce_fp32_is_within_fp32_rounding_of_float64(figures) -> None:
    errors = {(name, k): e[k] for name, e in figures["fp32"].items() for k in ERRORS}
    assert max(errors.values()) < FP32, errors


def test_fused_ce_bf16_is_no_further_than_plain_bf16(figures) -> None:
    bf16 = figures["bf16"]
    for name in bf16:
        for k in ERRORS:
            assert bf16[name][k] <= BF16_TIMES * bf16["plain"][k] + BF16_FLOOR, (name, k, bf16)


@pytest.mark.gpu
def test_fused_ce_liger_with_a_cap_and_a_scale_matches_the_fused_loss(figures) -> None:
    if figures["liger"] != "measured":
        pytest.skip("liger-kernel is not installed")
    assert max(figures["capped_fp32_liger_vs_fused"].values()) < CAPPED, figures["capped_fp32_liger_vs_fused"]
