"""The packed probe: packed rows train exactly as the padded batch with the attention the run installs on this
device, positions that do not restart do not, and a sliding window sees each example alone."""

from __future__ import annotations

import os

import pytest

from tests.gpu_check import packed
from tests.gpu_check.context import MODEL
from tests.gpu_check.measure import record, short

FP32_LOSS, FP32_GRADS = 1e-5, 1e-4  # packed against padded (or each example alone), relative
BF16_TIMES, BF16_FLOOR = 2, 1e-3  # bf16 packed no further from fp32 than bf16 padded is: 2x, + this
WINDOW_BF16 = 2e-2  # a sliding window's packed rows in bf16 against fp32 alone
MOVES = 1e-4  # what must move the loss (positions that do not restart, the window itself) moves it more


@pytest.fixture(scope="module")
def figures(request) -> dict:
    model_dir = os.environ.get(MODEL) or request.getfixturevalue("tiny_model_dir")
    measured = packed.measure(str(model_dir))
    measured["tolerance"] = (
        f"fp32 packed vs padded: loss < {short(FP32_LOSS)}, gradients < {short(FP32_GRADS)} relative; bf16 packed "
        f"no further from fp32 than bf16 padded is ({BF16_TIMES}x + {short(BF16_FLOOR)}); positions that do not "
        f"restart move the loss > {short(MOVES)}; a sliding window shorter than the examples: packed = each example "
        f"alone (fp32 {short(FP32_LOSS)} / {short(FP32_GRADS)}, bf16 within {short(WINDOW_BF16)}) and the window "
        f"moves the loss > {short(MOVES)}")
    return record(measured)


def test_packed_fp32_equals_padded(figures) -> None:
    assert figures["fp32"]["loss_rel_error"] < FP32_LOSS and figures["fp32"]["grad_rel_error"] < FP32_GRADS, figures


def test_packed_bf16_is_no_further_from_fp32_than_padded_bf16(figures) -> None:
    pad = figures["bf16_padded"]
    for k in ("loss_rel_error", "grad_rel_error"):
        assert figures["bf16"][k] <= BF16_TIMES * pad[k] + BF16_FLOOR, (k, figures["bf16"], pad)


def test_packed_positions_that_do_not_restart_move_the_loss(figures) -> None:
    assert figures["wrong_positions_loss_rel_change"] > MOVES  # so the check above can fail


def test_packed_sliding_window_sees_each_example_alone(figures) -> None:
    window = figures["sliding_window"]
    assert window["fp32"]["loss_rel_error"] < FP32_LOSS and window["fp32"]["grad_rel_error"] < FP32_GRADS, window
    assert window["bf16"]["loss_rel_error"] < WINDOW_BF16 and window["window_moves_loss"] > MOVES, window
