"""--load_balancing_loss on a real MoE model (a tiny Mixtral on the embedded tokenizer), through finetune.py:
the router loss trains and is logged as aux_loss, the logged loss stays the language model's (step 1 equals the
run without the flag, and the bs 2 × GA 4 layout's), and a dense model is refused up front."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from conftest import SAMPLE, read_metrics, run_finetune


@pytest.fixture(scope="module")
def moe_model(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_mixtral")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = AutoConfig.for_model("mixtral", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.1,
                                  pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                                  bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def moe_run(model, out, *extra) -> list[dict]:
    run_finetune(["--model_name_or_path", str(model), "--dataset_mixer_list", str(SAMPLE), "96",
                  "--output_dir", str(out), "--max_train_steps", "4", "--learning_rate", "3e-3", "--logging_steps",
                  "1", "--seed", "1", "--max_seq_length", "128", "--torch_dtype", "float32", *extra])
    return [m for m in read_metrics(out) if "loss" in m]


def test_router_loss_trains_and_is_logged(moe_model, tmp_path) -> None:
    plain = moe_run(moe_model, tmp_path / "plain", "--per_device_train_batch_size", "8")
    routed = moe_run(moe_model, tmp_path / "routed", "--per_device_train_batch_size", "8", "--load_balancing_loss")
    layout = moe_run(moe_model, tmp_path / "layout", "--per_device_train_batch_size", "2",
                     "--gradient_accumulation_steps", "4", "--load_balancing_loss")
    assert all("aux_loss" not in m for m in plain)
    assert all(math.isfinite(m["aux_loss"]) and m["aux_loss"] > 0 for m in routed + layout)
    # the logged loss is the language model's: the same first step with and without the router term
    assert routed[0]["loss"] == pytest.approx(plain[0]["loss"], rel=1e-6)
    assert layout[0]["loss"] == pytest.approx(routed[0]["loss"], rel=1e-6)
    # from step 2 the weights differ: the router term trained
    assert routed[1]["loss"] != plain[1]["loss"]
    assert routed[-1]["loss"] < routed[0]["loss"]


def test_a_dense_model_is_refused(tiny_model_dir, tmp_path) -> None:
    result = run_finetune(["--model_name_or_path", str(tiny_model_dir), "--dataset_mixer_list", str(SAMPLE), "16",
                           "--output_dir", str(tmp_path), "--max_train_steps", "1", "--load_balancing_loss"],
                          check=False)
    assert result.returncode == 2 and "--load_balancing_loss: model type 'llama' is not a mixture-of-experts model, so there is no router " in result.stdout + result.stderr
