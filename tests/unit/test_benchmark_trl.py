"""benchmark_trl.py --compare_loss fits its flags to the run: --fp32_adapters on a full fine-tune cast the whole
model TRL trains to fp32 without a word, an fp16 run was compared against TRL in fp32 by default, and a QLoRA run's
base is quantized by open_sft's own builder (it was a hand-made copy of it)."""

from __future__ import annotations

import argparse

import pytest
import torch

from conftest import load_script


@pytest.fixture(scope="module")
def script():
    return load_script("benchmark_trl")


def _run(compute: str, lora: bool = False, qlora: bool = False) -> dict:
    return {"compute_dtype": compute, "args": {"lora": {"use_lora": lora, "use_qlora": qlora}}}


def _flags(precision=None, fp32_adapters=False) -> argparse.Namespace:
    return argparse.Namespace(compare_loss="out", trl_precision=precision, fp32_adapters=fp32_adapters)


def test_the_flags_are_refused_where_they_do_not_fit_the_run(script) -> None:
    with pytest.raises(SystemExit, match=r"^--fp32_adapters: out is a full fine-tune, with no adapters to keep fp32 "
                                         r"\(the flag would cast the whole model to fp32\)"):
        script._trl_precision(_flags(fp32_adapters=True), _run("torch.bfloat16"))
    with pytest.raises(SystemExit, match="^--compare_loss out: the run computed in fp16, which TRL has no CPU mode"):
        script._trl_precision(_flags(), _run("torch.float16", lora=True))
    accepted = [(_flags(fp32_adapters=True), _run("torch.bfloat16", lora=True)), (_flags(), _run("torch.float32")),
                (_flags("fp32", fp32_adapters=True), _run("torch.float16", qlora=True)),
                (_flags("autocast"), _run("torch.float16"))]
    assert [script._trl_precision(flags, run) for flags, run in accepted] == ["autocast", "fp32", "fp32", "autocast"]


def test_a_qlora_base_loads_as_open_sft_loads_it(script) -> None:
    loading = script._loading(_run("torch.float16", qlora=True), "fp32")
    quantization = loading["quantization_config"]
    assert (loading["dtype"], quantization.load_in_4bit, quantization.bnb_4bit_quant_type,
            quantization.bnb_4bit_use_double_quant, quantization.bnb_4bit_compute_dtype) == (
        torch.float32, True, "nf4", True, torch.float16)
    assert script._loading(_run("torch.bfloat16", qlora=True), "fp32")["quantization_config"].bnb_4bit_compute_dtype \
        == torch.bfloat16
    assert script._loading(_run("torch.bfloat16"), "bf16_weights") == {"dtype": torch.bfloat16}
