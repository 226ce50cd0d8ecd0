"""The start-up packing check on a GPU machine and under --torch_compile: it ran the model on the CPU, where torch's
CUDA variable-length kernel (installed on every GPU machine) refused it, and ran its probes through the compiled
layers until dynamo's recompile limit, which left them eager for the whole run. And what a forward that raises
TypeError is told."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers

from open_sft.distributed.parallelism import Parallelism
from open_sft.errors import UserError
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


def tiny_ctrl() -> torch.nn.Module:
    """A small family outside the verified ones, so checked at start."""
    config = transformers.CTRLConfig(vocab_size=96, n_positions=64, n_embd=32, dff=64, n_layer=2, n_head=4)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def test_a_type_error_inside_the_forward_is_not_taken_for_a_forward_without_position_ids() -> None:
    """Every TypeError the probes raised was reported as 'model type X does not take position_ids', also one from a
    bug inside a decoder layer, which the user then could neither fix nor report as what it was. That one is raised
    as it is (its traceback), with a note naming the family and the check; a forward that really has no
    position_ids is still refused with the fix."""
    model = tiny_ctrl()

    def broken_layer(*args, **kwargs):
        return len(None)

    model.transformer.h[1].forward = broken_layer
    with pytest.raises(TypeError, match=r"object of type 'NoneType' has no len\(\)") as raised:
        check_packing(model)
    assert not isinstance(raised.value, UserError)
    assert raised.value.__notes__ == [
        "--packing: raised by model type 'ctrl' while open_sft checked at start that it keeps packed examples apart; "
        "please report it with the model type (training without --packing skips the check)"]

    model = tiny_ctrl()
    backbone = model.transformer.forward

    def no_positions(input_ids, use_cache=None):
        return backbone(input_ids=input_ids, use_cache=use_cache)

    model.transformer.forward = no_positions
    with pytest.raises(UserError, match=r"^--packing: model type 'ctrl' does not take position_ids \(.*no_positions\(\) "
                                        r"got an unexpected keyword argument 'position_ids'\), which is how packed "
                                        r"examples are told apart; train without --packing$"):
        check_packing(model)


def test_a_forward_without_flash_attentions_packed_arguments_is_refused_with_sdpa_as_the_fix(monkeypatch) -> None:
    """Under flash_attention_2 the probes hand the backbone where each example starts (cu_seq_lens_q, ...), as
    training does: a forward that takes position_ids but not those is refused naming them, with sdpa as the fix."""
    from open_sft.model import packing_check

    model = tiny_ctrl()
    backbone = model.transformer.forward

    def positions_only(input_ids, position_ids=None, use_cache=None):
        return backbone(input_ids=input_ids, position_ids=position_ids, use_cache=use_cache)

    model.transformer.forward = positions_only
    monkeypatch.setattr(packing_check, "uses_flash", lambda model: True)
    monkeypatch.setattr(packing_check, "_not_run_here", lambda model: None)
    with pytest.raises(UserError, match=r"^--packing: model type 'ctrl' does not take cu_seq_lens_q \(.*\), which is "
                                        r"how packed examples are told apart under flash_attention_2; train with "
                                        r"--attn_implementation sdpa, or without --packing$"):
        check_packing(model)


def test_seed_oss_is_not_taken_for_a_recurrent_family_where_it_cannot_be_checked(caplog) -> None:
    """Seed-OSS's classes are SeedOssModel and SeedOssMLP, whose lowercase names hold "ssm": a --packing run of
    Seed-OSS-36B where the start-up check cannot run (ZeRO-3's partitioned loading, which its verified loss allows;
    FSDP2) was refused as a family with Mamba layers (found by a family sweep). It is trained with the warning any
    unverified attention family gets there, and the check itself finds its examples apart (RwkvModel's class still
    refuses: test_packing_leaks)."""
    from open_sft.model.packing_check import recurrent_layers

    config = transformers.SeedOssConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                        attention_dropout=0.0, residual_dropout=0.0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    packed_attention.install(model)
    assert recurrent_layers(model) is None
    assert "model type 'seed_oss' keeps packed examples apart" in check_packing(model)
    for param in model.parameters():  # what deepspeed.zero.Init leaves on each parameter
        param.ds_numel = param.numel()
    with caplog.at_level(logging.WARNING, logger="open_sft.model.packing_check"):
        assert check_packing(model) is None
    assert "model type 'seed_oss' is not among the families open_sft has verified" in caplog.text
