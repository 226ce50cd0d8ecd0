"""--fp8: which layers train in FP8 (torchao's rule on the real 8B and 1B shapes), that a converted model trains
like the bf16 one (FP8 matmuls emulated by torch on this CPU, the same torchao code a GPU runs), and what it refuses,
each named with the fix before anything loads. torchao lives outside the venv (tests/conftest.py FP8_SITE), so its
part runs in a process of its own (tests/unit/model/fp8_probe.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from conftest import ROOT, fp8_env
from open_sft.config.launch import LaunchPlan
from open_sft.config.parse import parse_config
from open_sft.distributed.parallelism import Parallelism
from open_sft.errors import ConfigError
from open_sft.model.fp8 import CPU_STAND_IN, fp8_problems

TOO_SMALL = "too small to gain"


@pytest.fixture(scope="module")
def probe() -> dict:
    result = subprocess.run([sys.executable, "-m", "tests.unit.model.fp8_probe"], cwd=ROOT, env=fp8_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Failed to load" not in result.stderr and "Enum subclass" not in result.stderr  # torchao's import noise
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_8b_shape_trains_its_large_projections_in_fp8(probe) -> None:
    """Llama-3.1-8B: q/o (4096x4096) and the MLP's three in FP8 under either recipe; k/v (1,024 outputs) in bf16."""
    for recipe in ("tensorwise", "rowwise"):
        verdicts = probe["layers"][f"8B {recipe}"]
        assert [k for k, v in verdicts.items() if v == "fp8"] == ["q_proj", "o_proj", "gate_proj", "up_proj",
                                                                 "down_proj"]
        assert verdicts["k_proj"] == verdicts["v_proj"] == f"1024x4096: {TOO_SMALL} ({recipe})"


def test_the_1b_shape_follows_each_recipes_own_thresholds(probe) -> None:
    """Llama-3.2-1B: tensorwise takes q/o and the MLP; rowwise (costlier casts) only the MLP's gate and up."""
    tensorwise, rowwise = probe["layers"]["1B tensorwise"], probe["layers"]["1B rowwise"]
    assert [k for k, v in tensorwise.items() if v == "fp8"] == ["q_proj", "o_proj", "gate_proj", "up_proj",
                                                               "down_proj"]
    assert [k for k, v in rowwise.items() if v == "fp8"] == ["gate_proj", "up_proj"]
    assert rowwise["down_proj"] == f"2048x8192: {TOO_SMALL} (rowwise)"


def test_a_converted_model_trains_as_the_bf16_one(probe) -> None:
    """Every decoder linear layer in FP8 (--fp8_layers all; the LM head stays a Linear): the same parameter names and
    shapes (checkpoints and exports unchanged), and over 12 steps from the same weights the loss within 0.2 % of
    bf16's while both fall by a fifth."""
    train = probe["train"]
    assert train["summary"]["fp8"] == 14 and train["summary"]["bf16"] == 0  # 2 layers x 7 projections
    assert train["module_kinds"] == ["Float8Linear", "Linear"] and train["head_kind"] == "Linear"
    assert train["same_state_dict"]
    bf16, fp8 = train["bf16"], train["fp8"]
    assert fp8 != bf16  # really other matmuls
    assert max(abs(a - b) / b for a, b in zip(fp8, bf16)) < 2e-3, (fp8, bf16)
    assert fp8[-1] < 0.8 * fp8[0] and bf16[-1] < 0.8 * bf16[0]


def test_a_model_whose_layers_are_all_too_small_is_refused_with_the_way_on(probe) -> None:
    message = probe["nothing_gains"]
    assert message.startswith("--fp8: no linear layer of this model gains from FP8 matmuls")
    assert "64x64: too small to gain (tensorwise)" in message and "--fp8_layers all" in message


@pytest.fixture
def torchao_installed(monkeypatch):
    """The flag checks as where torchao is installed (this venv has none: tests/conftest.py FP8_SITE), and the
    CPU stand-in allowed unless a test takes it away."""
    from open_sft.config import checks

    installed = checks._installed
    monkeypatch.setattr(checks, "_installed", lambda package: package == "torchao" or installed(package))
    monkeypatch.setenv(CPU_STAND_IN, "1")
    return monkeypatch


def _config(*flags: str):
    return parse_config(["--model_name_or_path", "m", "--dataset_mixer_list", "d.jsonl", "1.0", "--output_dir",
                         "unused", "--fp8", *flags])


def _problems(config, dtype=torch.bfloat16, **parallelism) -> list[str]:
    spread = Parallelism(**{"engine": "ddp", "world_size": 2, **parallelism})
    return fp8_problems(config, LaunchPlan(config.train, dtype, None, spread))


@pytest.mark.parametrize("case, expected", [
    (dict(engine="deepspeed", zero_stage=3), "DeepSpeed ZeRO-3"),
    (dict(tp=2), "tensor parallelism"),
    (dict(pp=2), "--pipeline_parallel_size"),
    (dict(engine="deepspeed", sp=2), "--sequence_parallel_size"),
    (dict(flags=("--torch_compile",)), "--torch_compile on a CPU (torch's CPU compiler gives FP8 layers NaN"),
])
def test_what_fp8_does_not_run_with_is_refused_by_name(torchao_installed, case, expected) -> None:
    problems = _problems(_config(*case.pop("flags", ())), **case)
    assert len(problems) == 1 and expected in problems[0] and "drop --fp8 or that setting" in problems[0]


def test_lora_qlora_and_a_dtype_other_than_bf16_are_refused(torchao_installed) -> None:
    for flag, expected in (("--use_lora", "--use_lora (the adapters"), ("--use_qlora", "--use_qlora (its base")):
        problems = _problems(_config(flag))
        assert len(problems) == 1 and problems[0].startswith(f"--fp8 does not run with {expected}"), problems
    problems = _problems(_config(), dtype=torch.float32)
    assert problems == ["--fp8: --torch_dtype resolved to float32, and FP8 training keeps the layers it does not "
                        "convert in bf16: give --torch_dtype bfloat16"]


def test_the_engines_it_runs_under_are_not_refused(torchao_installed) -> None:
    for case in (dict(engine="single", world_size=1), dict(), dict(engine="fsdp2"),
                 dict(engine="deepspeed", zero_stage=2)):
        assert _problems(_config(), **case) == [], case
    plain = parse_config(["--model_name_or_path", "m", "--dataset_mixer_list", "d.jsonl", "1.0"])
    assert fp8_problems(plain, SimpleNamespace()) == []  # no --fp8: nothing to judge


def test_a_machine_without_fp8_matmuls_is_refused_with_the_reason(torchao_installed) -> None:
    """This CPU, without the suite's stand-in: the GPUs FP8 needs are named (a GPU's own check reads its compute
    capability)."""
    torchao_installed.delenv(CPU_STAND_IN)
    problems = _problems(_config())
    assert len(problems) == 1 and problems[0].startswith("--fp8: this machine has no CUDA GPU; FP8 matmuls need an "
                                                         "NVIDIA GPU of compute capability 8.9 or newer")


def test_fp8_flags_are_checked_with_the_others(tmp_path) -> None:
    """Without torchao (this venv has none) --fp8 says how to install it; --fp8_recipe without --fp8 is named."""
    with pytest.raises(ConfigError) as info:
        parse_config(["--model_name_or_path", "m", "--dataset_mixer_list", "d.jsonl", "1.0", "--output_dir",
                      str(tmp_path), "--fp8"])
    assert "--fp8 needs torchao>=0.18 (its float8 training): pip install -e '.[fp8]'" in str(info.value)
    with pytest.raises(ConfigError) as info:
        parse_config(["--model_name_or_path", "m", "--dataset_mixer_list", "d.jsonl", "1.0", "--output_dir",
                      str(tmp_path), "--fp8_recipe", "rowwise", "--fp8_layers", "all"])
    assert ("--fp8_recipe and --fp8_layers choose how --fp8 trains, and --fp8 is not given: add --fp8 or drop "
            "--fp8_recipe and --fp8_layers") in str(info.value)
