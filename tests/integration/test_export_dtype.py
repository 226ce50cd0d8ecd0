"""The export keeps the dtype of the checkpoint the run started from: a bf16 checkpoint exports bf16 (half the
bytes of fp32, config.json says bfloat16, each tensor the fp32-trained weight rounded to bf16), an fp32 one
fp32; --save_dtype overrides. Training keeps fp32 master weights either way."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import SAMPLE, run_finetune


@pytest.fixture(scope="module")
def exports(tiny_model_dir, tmp_path_factory) -> dict:
    bf16 = tmp_path_factory.mktemp("bf16_checkpoint")
    AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).save_pretrained(bf16)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(bf16)
    out = {}
    for name, extra in (("auto", []), ("float32", ["--save_dtype", "float32"])):
        out[name] = tmp_path_factory.mktemp(f"export_{name}")
        run_finetune(["--model_name_or_path", str(bf16), "--dataset_mixer_list", str(SAMPLE), "64",
                      "--output_dir", str(out[name]), "--max_train_steps", "3", "--per_device_train_batch_size", "4",
                      "--learning_rate", "1e-3", "--seed", "1", "--max_seq_length", "128", "--torch_dtype",
                      "float32"] + extra)
    return out


def test_a_bf16_checkpoint_exports_bf16(exports) -> None:
    bf16 = load_file(exports["auto"] / "model.safetensors")
    fp32 = load_file(exports["float32"] / "model.safetensors")
    assert {t.dtype for t in bf16.values()} == {torch.bfloat16} and {t.dtype for t in fp32.values()} == {torch.float32}
    assert json.loads((exports["auto"] / "config.json").read_text())["dtype"] == "bfloat16"
    assert json.loads((exports["float32"] / "config.json").read_text())["dtype"] == "float32"
    size = (exports["auto"] / "model.safetensors").stat().st_size / (exports["float32"] / "model.safetensors").stat().st_size
    assert 0.45 < size < 0.55
    # the same fp32 training (same seed, fp32 compute): the bf16 export is the fp32 weights rounded
    assert bf16.keys() == fp32.keys()
    assert all(torch.equal(bf16[k], fp32[k].to(torch.bfloat16)) for k in fp32)
    reloaded = AutoModelForCausalLM.from_pretrained(exports["auto"])
    assert reloaded.dtype == torch.bfloat16
