"""--torch_compile's refusals, before anything loads: each setting it does not run with is named with the fix
(the compiled training itself is in tests/integration/test_torch_compile.py: inductor compiles in subprocesses)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from open_sft.errors import UserError
from open_sft.model.anatomy import decoder_layers
from open_sft.model.compile import compile_layers, compile_problems, refuse_what_compile_cannot_do


def test_a_model_without_decoder_layers_is_named() -> None:
    model = torch.nn.Linear(2, 2)
    model.base_model_prefix = "model"
    with pytest.raises(ValueError, match="no decoder layers at model.layers"):
        decoder_layers(model)
    with pytest.raises(UserError, match="--torch_compile: Linear has no decoder layers.*drop --torch_compile"):
        compile_layers(model)


PLAIN = SimpleNamespace(pipeline_parallel_size=1, sequence_parallel_size=1)
NO_LORA = SimpleNamespace(use_qlora=False)


@pytest.mark.parametrize("case, expected", [
    (dict(zero_stage=3), "DeepSpeed ZeRO-3"),
    (dict(fsdp=True), "FSDP"),
    (dict(tp=2), "tensor parallelism"),
    (dict(train=SimpleNamespace(pipeline_parallel_size=2, sequence_parallel_size=1)), "--pipeline_parallel_size"),
    (dict(train=SimpleNamespace(pipeline_parallel_size=1, sequence_parallel_size=2)), "--sequence_parallel_size"),
    (dict(lora=SimpleNamespace(use_qlora=True)), "--use_qlora"),
])
def test_what_compile_does_not_run_with_is_refused_by_name(case, expected) -> None:
    args = {"train": PLAIN, "lora": NO_LORA, "fsdp": False, "zero_stage": 0, "tp": 1, **case}
    problems = compile_problems(**args)
    assert len(problems) == 1 and expected in problems[0] and "drop --torch_compile" in problems[0]


def test_plain_ddp_and_zero2_runs_are_not_refused() -> None:
    for zero_stage in (0, 1, 2):
        assert compile_problems(PLAIN, NO_LORA, fsdp=False, zero_stage=zero_stage, tp=1) == []


def test_a_zero3_launch_is_refused_before_loading() -> None:
    config = SimpleNamespace(lora=NO_LORA)
    plan = SimpleNamespace(train=PLAIN, fsdp=None, deepspeed_config={"zero_optimization": {"stage": 3}})
    with pytest.raises(UserError, match="--torch_compile cannot run as asked:\n.*ZeRO-3"):
        refuse_what_compile_cannot_do(config, plan)
