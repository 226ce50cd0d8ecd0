"""--fp8 trained for real through finetune.py: torchao's FP8 layers (torch emulates their matmuls on this CPU, the
suite's stand-in for a GPU's FP8 tensor cores; tests/conftest.py fp8_env), against the same run in bf16 and under
FSDP2 on two ranks, and what it leaves behind: a plain Hugging Face model."""

from __future__ import annotations

import pytest
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
    """bf16 and --fp8 in one process (micro-batch 4 x 2), --fp8 on 2 FSDP2 ranks (2 x 2 x 2: the same batches)."""
    out = {}
    for name, micro_batch, extra, launch in (("bf16", 4, [], None), ("fp8", 4, FP8, None),
                                             ("fp8_fsdp2", 2, FP8, fsdp_command())):
        output_dir = tmp_path_factory.mktemp(name)
        result = run_finetune(_args(tiny_model_dir, output_dir, micro_batch, 2, *extra), env=fp8_env(),
                              launch=launch)
        out[name] = {"dir": output_dir, "log": result.stdout + result.stderr,
                     "losses": [m["loss"] for m in read_metrics(output_dir)]}
    return out


def test_fp8_trains_as_bf16_does(runs) -> None:
    """Every decoder projection in FP8 (the log says which, and that the LM head is not), the loss step by step
    within 0.3 % of bf16's and falling as it does; torchao's import noise is not in the log."""
    log = runs["fp8"]["log"]
    assert ("--fp8 (torchao, tensorwise scaling; every layer FP8 accepts): 14 linear layers in FP8 (q_proj, k_proj, "
            "v_proj, o_proj, gate_proj, up_proj, down_proj); in bf16: the LM head") in log
    assert "Failed to load" not in log and "Enum subclass" not in log
    assert "--fp8 (torchao" not in runs["bf16"]["log"]
    fp8, bf16 = runs["fp8"]["losses"], runs["bf16"]["losses"]
    assert len(fp8) == len(bf16) == STEPS and fp8 != bf16  # other matmuls, really
    assert max(abs(a - b) / b for a, b in zip(fp8, bf16)) < 3e-3, (fp8, bf16)
    assert fp8[-1] < fp8[0] - 0.8


def test_fp8_under_fsdp2_trains_as_one_process_does(runs) -> None:
    """FSDP2's sharded weights through the same FP8 layers: the single process's losses within 0.2 %."""
    sharded, single = runs["fp8_fsdp2"]["losses"], runs["fp8"]["losses"]
    assert "14 linear layers in FP8" in runs["fp8_fsdp2"]["log"]
    assert max(abs(a - b) / b for a, b in zip(sharded, single)) < 2e-3, (sharded, single)


def test_an_fp8_run_exports_a_plain_model(runs) -> None:
    """The export holds the bf16 run's tensors by name and shape, and loads as the model class it was (no torchao
    in this process)."""
    import transformers

    fp8, bf16 = (load_file(runs[name]["dir"] / "model.safetensors") for name in ("fp8", "bf16"))
    assert {k: v.shape for k, v in fp8.items()} == {k: v.shape for k, v in bf16.items()}
    assert any((fp8[k] != bf16[k]).any() for k in fp8)
    model = transformers.AutoModelForCausalLM.from_pretrained(runs["fp8"]["dir"])
    assert {type(m).__name__ for m in model.modules() if "Linear" in type(m).__name__} == {"Linear"}
