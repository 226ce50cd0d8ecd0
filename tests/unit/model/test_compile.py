"""--torch_compile's refusals, before anything loads: each setting it does not run with is named with the fix
(the compiled training itself is in tests/integration/test_torch_compile.py: inductor compiles in subprocesses)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from open_sft.errors import UserError
from open_sft.distributed.parallelism import Parallelism
from open_sft.model.anatomy import decoder_layers
from open_sft.model.compile import compile_layers, compile_problems


def test_a_model_without_decoder_layers_is_named() -> None:
    model = torch.nn.Linear(2, 2)
    model.base_model_prefix = "model"
    with pytest.raises(ValueError, match="no decoder layers at model.layers"):
        decoder_layers(model)
    with pytest.raises(UserError, match="--torch_compile: Linear has no decoder layers.*drop --torch_compile"):
        compile_layers(model)


NO_LORA = SimpleNamespace(use_qlora=False)


@pytest.mark.parametrize("case, expected", [
    (dict(engine="deepspeed", zero_stage=3), "DeepSpeed ZeRO-3"),
    (dict(engine="fsdp2"), "FSDP"),
    (dict(tp=2), "tensor parallelism"),
    (dict(pp=2), "--pipeline_parallel_size"),
    (dict(engine="deepspeed", sp=2), "--sequence_parallel_size"),
    (dict(lora=SimpleNamespace(use_qlora=True)), "--use_qlora"),
])
def test_what_compile_does_not_run_with_is_refused_by_name(case, expected) -> None:
    lora = case.pop("lora", NO_LORA)
    problems = compile_problems(lora, Parallelism(**{"engine": "ddp", "world_size": 2, **case}))
    assert len(problems) == 1 and expected in problems[0] and "drop --torch_compile" in problems[0]


def test_plain_ddp_and_zero2_runs_are_not_refused() -> None:
    assert compile_problems(NO_LORA, Parallelism("ddp", 2)) == []
    for zero_stage in (0, 1, 2):
        assert compile_problems(NO_LORA, Parallelism("deepspeed", 2, zero_stage=zero_stage)) == []
