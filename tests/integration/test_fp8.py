"""--fp8 trained for real through finetune.py: torchao's FP8 layers (torch emulates their matmuls on this CPU, the
suite's stand-in for a GPU's FP8 tensor cores; tests/conftest.py fp8_env) in one process and under FSDP2 on two
ranks, and what it leaves behind: a plain Hugging Face model. (FP8 against bf16 from the same weights and batches:
tests/unit/model/test_fp8.py, in process.)"""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from conftest import SAMPLE, fp8_env, fsdp_command, read_metrics, run_finetune

STEPS = 8
FP8 = ["--fp8", "--fp8_layers", "all"]  # the tiny model's 64-wide layers gain under no size rule: all of them


def _args(model_dir, output_dir, micro_batch: int, accumulation: int, *extra: str) -> list[str]:
    return ["--model_name_or_path", str(model_dir), "--dataset_mixer_list", str(SAMPLE), "1.0",
            "--output_dir", str(output_dir), "--max_train_steps", str(STEPS),
            "--per_device_train_batch_size", str(micro_batch), "--gradient_accumulation_steps", str(accumulation),
            "--learning_rate", "3e-3", "--warmup_ratio", "0.1", "--logging_steps", "1", "--seed", "1",
            "--torch_dtype", "bfloat16", "--max_seq_length", "256", *extra]


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory) -> dict:
    """--fp8 in one process (micro-batch 4 x 2) and on 2 FSDP2 ranks (2 x 2 x 2: the same batches)."""
    out = {}
    for name, micro_batch, extra, launch in (("fp8", 4, FP8, None), ("fp8_fsdp2", 2, FP8, fsdp_command())):
        output_dir = tmp_path_factory.mktemp(name)
        result = run_finetune(_args(tiny_model_dir, output_dir, micro_batch, 2, *extra), env=fp8_env(),
                              launch=launch)
        out[name] = {"dir": output_dir, "log": result.stdout + result.stderr,
                     "losses": [m["loss"] for m in read_metrics(output_dir)]}
    out["base"] = tiny_model_dir
    return out


def test_fp8_trains_and_says_which_layers(runs) -> None:
    """Every decoder projection in FP8 (the log says which, and that the LM head is not), the loss falling; torchao's
    import noise is not in the log."""
    log = runs["fp8"]["log"]
    assert ("--fp8 (torchao, tensorwise scaling; every layer FP8 accepts): 14 linear layers in FP8 (q_proj, k_proj, "
            "v_proj, o_proj, gate_proj, up_proj, down_proj); in bf16: the LM head") in log
    assert "Failed to load" not in log and "Enum subclass" not in log
    fp8 = runs["fp8"]["losses"]
    assert len(fp8) == STEPS and all(math.isfinite(x) for x in fp8) and fp8[-1] < fp8[0] - 0.8, fp8


def test_fp8_under_fsdp2_trains_as_one_process_does(runs) -> None:
    """FSDP2's sharded weights through the same FP8 layers: the single process's losses within 0.2 %."""
    sharded, single = runs["fp8_fsdp2"]["losses"], runs["fp8"]["losses"]
    assert "14 linear layers in FP8" in runs["fp8_fsdp2"]["log"]
    assert max(abs(a - b) / b for a, b in zip(sharded, single)) < 2e-3, (sharded, single)


def test_an_fp8_run_exports_a_plain_model(runs) -> None:
    """The export holds the model's tensors by name and shape, trained, and loads as the model class it was (no
    torchao in this process)."""
    import transformers

    exported = load_file(runs["fp8"]["dir"] / "model.safetensors")
    base = transformers.AutoModelForCausalLM.from_pretrained(runs["base"])
    assert {k: tuple(v.shape) for k, v in exported.items()} == {k: tuple(v.shape) for k, v in base.state_dict().items()
                                                                  if k in exported}
    assert any(not torch.equal(exported[k].float(), v.float()) for k, v in base.state_dict().items() if k in exported)
    model = transformers.AutoModelForCausalLM.from_pretrained(runs["fp8"]["dir"])
    assert {type(m).__name__ for m in model.modules() if "Linear" in type(m).__name__} == {"Linear"}
