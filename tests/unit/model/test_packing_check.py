"""The start-up packing check on a GPU machine and under --torch_compile: it ran the model on the CPU, where torch's
CUDA variable-length kernel (installed on every GPU machine) refused it, and ran its probes through the compiled
layers until dynamo's recompile limit, which left them eager for the whole run."""

from __future__ import annotations

import logging

import torch
import transformers

from open_sft.distributed.parallelism import Parallelism
from open_sft.model import packed_attention
from open_sft.model.packing_check import check_device, check_packing, route_packed_rows
from tests.unit.model.varlen_stand_in import own_sdpa_entry, reference_varlen  # noqa: F401 (a fixture)


def test_the_start_up_check_on_a_gpu_machine_runs_while_the_model_is_on_the_cpu(monkeypatch, caplog) -> None:
    """A GPU machine (CUDA available, torch's kernel installed) with the model still on the CPU, as route_packed_rows
    gets it under DeepSpeed or FSDP: tiny OLMo-3 (not verified: checked at start) was refused with
    NotImplementedError from aten::_flash_attention_forward; it is checked with the per-example calls."""
    config = transformers.Olmo3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(packed_attention, "varlen_kernel", lambda: reference_varlen)
    with caplog.at_level(logging.INFO, logger="open_sft.model.packing_check"):
        route_packed_rows(model, type("Train", (), {"packing": True})(), Parallelism("deepspeed", 2, zero_stage=2),
                          torch.bfloat16, torch.device("cuda", 0))
    assert "model type 'olmo3' keeps packed examples apart" in caplog.text
    assert next(model.parameters()).device.type == "cpu"  # DeepSpeed moves it itself, in half precision


def test_the_check_runs_where_the_model_trains_where_the_run_puts_it_there_whole() -> None:
    """One process or DDP: accelerate moves the whole fp32 model to the GPU, so the check moves it there first and
    judges the kernel that trains. Not under DeepSpeed (it casts to half precision before moving), FSDP or tensor
    parallelism (shards), nor where the model is placed already (QLoRA's device map) or the run is on the CPU."""
    model = torch.nn.Linear(2, 2)
    gpu = torch.device("cuda", 1)
    assert check_device(model, gpu, Parallelism("single")) == gpu
    assert check_device(model, gpu, Parallelism("ddp", 4)) == gpu
    for spread in (Parallelism("deepspeed", 2, zero_stage=2), Parallelism("fsdp2", 2, dp_shard=2),
                   Parallelism("ddp", 2, tp=2)):
        assert check_device(model, gpu, spread) is None
    assert check_device(model, torch.device("cpu"), Parallelism("single")) is None
    assert check_device(model, None, Parallelism("single")) is None
    assert check_device(model.to("meta"), gpu, Parallelism("single")) is None  # placed already


def test_the_start_up_check_leaves_compiled_layers_for_training_to_compile() -> None:
    """--torch_compile compiles the decoder layers before the check, whose probes (other shapes, no grad, eval) used
    to recompile them until dynamo's recompile limit (8): the first training forward then hit it and ran the layers
    eager all run. The probes run eager; training compiles (the eager backend: the same dynamo frames, cheaply)."""
    from torch._dynamo.utils import counters

    config = transformers.HeliumConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    torch._dynamo.reset()
    counters.clear()
    try:
        for layer in model.model.layers:
            layer.compile(backend="eager")
        packed_attention.install(model)
        assert "keeps packed examples apart" in check_packing(model, torch.bfloat16)
        assert counters["frames"]["total"] == 0 and counters["stats"]["unique_graphs"] == 0
        model.train()
        ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
        positions = torch.cat([torch.arange(15), torch.arange(25)]).repeat(2, 1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model.model(input_ids=ids, position_ids=positions).last_hidden_state.float().sum().backward()
        assert counters["stats"]["unique_graphs"] >= 2  # none at the recompile limit (before: 14 graphs, 0 new)
    finally:
        torch._dynamo.reset()
