"""The packed probe: packed rows train exactly as the padded batch with the attention the run installs on this
device, positions that do not restart do not, and a sliding window sees each example alone; torch's variable-length
kernel (a CPU stand-in without CUDA) takes multi-head latent attention's rows and trains them as the padded batch,
and at the first attention layer of dense and routed models gives what per-example attention gives."""

from __future__ import annotations

import os

import pytest

from tests.gpu_check import packed, packed_kernel
from tests.gpu_check.context import MODEL
from tests.gpu_check.measure import record, short

FP32_LOSS, FP32_GRADS = 1e-5, 1e-4  # packed against padded (or each example alone), relative
BF16_TIMES, BF16_FLOOR = 2, 1e-3  # bf16 packed no further from fp32 than bf16 padded is: 2x, + this
WINDOW_BF16 = 2e-2  # a sliding window's packed rows in bf16 against fp32 alone
MOVES = 1e-4  # what must move the loss (positions that do not restart, the window itself) moves it more
BF16_STEP = 2 ** -7  # one bf16 step at the largest magnitude: the first layer's outputs round to it


@pytest.fixture(scope="module")
def figures(request) -> dict:
    from transformers import AutoConfig

    from open_sft.model.packing_check import RTOL_HALF

    model_dir = os.environ.get(MODEL) or request.getfixturevalue("tiny_model_dir")
    measured = packed.measure(str(model_dir))
    try:  # the kernel's own figures: a kernel that fails (a head width it does not take) is reported, not hidden
        measured.update(packed_kernel.measure(AutoConfig.from_pretrained(model_dir).vocab_size))
    except Exception as exc:  # whatever the kernel raises, the figures above still go to the report
        measured["kernel_error"] = f"{type(exc).__name__}: {exc}"
    else:
        measured["latent_bf16"] = {f: {k: r["bf16"][k] for k in ("loss_rel_error", "grad_rel_error",
                                                                 "varlen_kernel_calls")}
                                   for f, r in measured["latent"].items()}
        measured["first_layer_moves"] = {k: v["move"] for k, v in measured["first_layer"].items() if "move" in v}
    measured["tolerance"] = (
        f"fp32 packed vs padded: loss < {short(FP32_LOSS)}, gradients < {short(FP32_GRADS)} relative; bf16 packed "
        f"no further from fp32 than bf16 padded is ({BF16_TIMES}x + {short(BF16_FLOOR)}); positions that do not "
        f"restart move the loss > {short(MOVES)}; a sliding window shorter than the examples: packed = each example "
        f"alone (fp32 {short(FP32_LOSS)} / {short(FP32_GRADS)}, bf16 within {short(WINDOW_BF16)}) and the window "
        f"moves the loss > {short(MOVES)}; latent attention through the kernel: fp32 as above, bf16 as above, every "
        f"layer's call through the kernel; the first attention layer through the kernel against per-example: within "
        f"{short(RTOL_HALF)} (the packing check's) and {BF16_TIMES}x the dense model's + one bf16 step, and an acausal "
        f"kernel past {short(RTOL_HALF)}")
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


def test_latent_attention_takes_the_kernel_and_trains_as_the_padded_batch(figures) -> None:
    """DeepSeek-V3/Kimi-K2 (192-wide queries and keys, 128-wide values zero-padded for the kernel), DeepSeek-V2-Lite
    and GLM-4.7-Flash (256 wide): fp32 per example as the padded batch; bf16 through the kernel, once per layer."""
    assert "kernel_error" not in figures, figures["kernel_error"]
    for family, latent in figures["latent"].items():
        fp32, bf16, pad = latent["fp32"], latent["bf16"], latent["bf16_padded"]
        assert fp32["loss_rel_error"] < FP32_LOSS and fp32["grad_rel_error"] < FP32_GRADS, (family, latent)
        assert fp32["varlen_kernel_calls"] == 0 and bf16["varlen_kernel_calls"] == latent["layers"], (family, latent)
        for k in ("loss_rel_error", "grad_rel_error"):
            assert bf16[k] <= BF16_TIMES * pad[k] + BF16_FLOOR, (family, k, latent)
    widths = {f: (r["qk_head_dim"], r["v_head_dim"]) for f, r in figures["latent"].items()}
    assert widths == {"deepseek_v3": (192, 128), "deepseek_v2": (192, 128), "glm4_moe_lite": (256, 256)}


def test_the_first_attention_layer_through_the_kernel_is_per_example_attention(figures) -> None:
    """Before any router: what the packing check relies on where it measures a model again in fp32 (fp32
    takes the per-example attention, not the kernel), held to the dense model's figure and to the check's tolerance,
    and an acausal kernel found by it and refused by the packing check."""
    from open_sft.model.packing_check import RTOL_HALF

    assert "kernel_error" not in figures, figures["kernel_error"]
    first = figures["first_layer"]
    dense = first["llama"]["move"]
    for family in packed_kernel.FIRST_LAYER:
        assert first[family]["varlen_kernel_calls"] == 1, (family, first)
        assert first[family]["move"] <= min(RTOL_HALF, BF16_TIMES * dense + BF16_STEP), (family, first)
    assert first["llama_acausal"]["move"] > RTOL_HALF  # so the check can fail
    verdicts = first["packing_check_phimoe"]
    assert "keeps packed examples apart" in verdicts["kernel"], verdicts
    assert verdicts["acausal"].startswith("refused: ") and "first attention layer" in verdicts["acausal"], verdicts
