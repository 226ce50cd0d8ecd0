"""A checkpoint of one engine resumed under another (open_sft.training.portable): each engine's files read by
parameter name give the optimizer's own state, exactly; what is put back into a torch optimizer steps as the original
does, bitwise (each parameter with its own step count, also from ZeRO-3's flat, one-step universal files); the
refusals name their reason before anything loads. The real launches (ZeRO-2 → FSDP2, FSDP2 → ZeRO-3, one process →
ZeRO-2 on 2 ranks, ZeRO-3 on 2 ranks → one process) are in tests/integration/test_fsdp.py and test_checkpoint.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_model
from transformers import LlamaConfig, LlamaForCausalLM

from open_sft.errors import UserError
from open_sft.model.loss import TokenLossModel
from open_sft.training.checkpoint import ResumePoint
from open_sft.training.elastic import fit_to_checkpoint
from open_sft.training.optim import build_optimizer, param_group_names
from open_sft.training.portable import (CrossEngineResume, _fsdp2_states, _torch_states, checkpoint_io, load_torch,
                                        refusal, tied_names, universal_states, write_universal)
from open_sft.training.resume import IDENTITY_BEFORE_RECORDED, check_compatible


def trained(tied: bool, seed: int = 0, steps: int = 2) -> tuple[TokenLossModel, torch.optim.Optimizer]:
    """A tiny Llama in open_sft's loss wrapper and its AdamW (weight decay on matrices), `steps` steps in."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied)
    model = TokenLossModel(LlamaForCausalLM(config))
    optimizer = build_optimizer(model, 1e-2, 0.1, fused=False)
    for _ in range(steps):
        fake_gradients(model, seed + 1)
        optimizer.step()
    return model, optimizer


def fake_gradients(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for param in model.parameters():
        param.grad = torch.randn(param.shape, generator=generator)


def order_of(model: torch.nn.Module) -> list[str]:
    decay, no_decay = param_group_names(model)
    return decay + no_decay


def save_like_accelerate(model, optimizer, directory: Path) -> Path:
    """What accelerate's save_state writes for one process or DDP: model.safetensors (shared tensors once) and the
    torch optimizer's state dict."""
    directory.mkdir(parents=True)
    save_model(model, str(directory / "model.safetensors"))
    torch.save(optimizer.state_dict(), directory / "optimizer.bin")
    return directory


def assert_same_states(states, model, optimizer) -> None:
    params = dict(model.named_parameters())
    loaded = states.load(order_of(model))
    assert sorted(loaded) == sorted(order_of(model))
    for name, got in loaded.items():
        state = optimizer.state[params[name]]
        assert torch.equal(got.weight, params[name].detach()), name
        assert torch.equal(got.exp_avg.reshape(params[name].shape), state["exp_avg"]), name
        assert torch.equal(got.exp_avg_sq.reshape(params[name].shape), state["exp_avg_sq"]), name
        assert float(got.step) == float(state["step"]) == 2.0


@pytest.mark.parametrize("tied", [False, True])
def test_accelerates_files_read_by_name_are_the_optimizers_state(tmp_path, tied) -> None:
    model, optimizer = trained(tied)
    directory = save_like_accelerate(model, optimizer, tmp_path / "step_2")
    aliases = tied_names(model)
    assert aliases == ({"model.model.embed_tokens.weight": ["model.lm_head.weight"]} if tied else {})
    assert_same_states(_torch_states(directory, order_of(model), aliases), model, optimizer)


def test_fsdp2s_distributed_checkpoint_read_by_name_is_the_optimizers_state(tmp_path) -> None:
    """The layout accelerate's FSDP2 save_state writes (`model` and `optimizer` state dicts, name-keyed), read back
    without a process group."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model, optimizer = trained(tied=False)
    dcp.save({"model": model.state_dict()}, checkpoint_id=tmp_path / "pytorch_model_fsdp_0", no_dist=True)
    dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=tmp_path / "optimizer_0",
             no_dist=True)
    states = _fsdp2_states(tmp_path)
    assert sorted(states.names) == sorted(order_of(model))
    assert_same_states(states, model, optimizer)


def test_an_fsdp2_checkpoint_is_read_without_torchs_warning_of_no_process_group(tmp_path) -> None:
    """`open_sft export` of an FSDP2 checkpoint printed torch's 'UserWarning: torch.distributed is disabled,
    unavailable or uninitialized, assuming the intent is to load in a single process' (dcp.load warns so even when
    told no_dist=True): one process is what the reader means. The weights read are the saved ones."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from open_sft.export.checkpoint_weights import distributed_checkpoint

    model, _ = trained(tied=False)
    dcp.save({"model": model.state_dict()}, checkpoint_id=tmp_path / "pytorch_model_fsdp_0", no_dist=True)
    reader = distributed_checkpoint(tmp_path / "pytorch_model_fsdp_0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        weights = reader.load(sorted(reader.weights))
    assert not [w for w in caught if "torch.distributed is disabled" in str(w.message)]
    saved = {name.removeprefix("model."): tensor for name, tensor in model.state_dict().items()}  # the wrapper's
    assert weights.keys() == saved.keys() and len(saved) > 10
    assert all(torch.equal(weights[name], tensor) for name, tensor in saved.items())


def fake_zero_engine(optimizer, stage3: bool) -> SimpleNamespace:
    """What write_universal reads of a live DeepSpeed engine: the optimizer's groups, the stage, the batch."""
    return SimpleNamespace(optimizer=SimpleNamespace(optimizer=optimizer),
                           zero_optimization_partition_weights=lambda: stage3, train_batch_size=lambda: 8)


def test_written_in_the_universal_layout_and_read_back_the_state_is_the_same(tmp_path) -> None:
    model, optimizer = trained(tied=False)
    source = _torch_states(save_like_accelerate(model, optimizer, tmp_path / "step_2"), order_of(model))
    write_universal(source, tmp_path / "universal", fake_zero_engine(optimizer, stage3=False), world=2, step=2,
                    chunk=3)
    zero = tmp_path / "universal" / "pytorch_model" / "zero"
    assert sorted(p.name for p in zero.iterdir() if p.is_dir()) == sorted(order_of(model))
    assert {p.name for p in (zero / order_of(model)[0]).iterdir()} == {"fp32.pt", "exp_avg.pt", "exp_avg_sq.pt",
                                                                        "step.pt"}
    common = torch.load(zero / "optimizer_state.pt", weights_only=False)
    assert [g["weight_decay"] for g in common["param_groups"]] == [0.1, 0.0]  # the live optimizer's groups
    states = torch.load(tmp_path / "universal" / "pytorch_model" / "mp_rank_00_model_states.pt", weights_only=False)
    assert (states["global_steps"], states["global_samples"], states["dp_world_size"]) == (2, 16, 2)
    assert_same_states(universal_states(tmp_path / "universal"), model, optimizer)


def zero3_like(folder: Path, model, optimizer) -> None:
    """A universal folder as DeepSpeed writes it from ZeRO-3: each tensor flat, one step for the whole optimizer
    (zero/optimizer_state.pt), no step.pt."""
    params = dict(model.named_parameters())
    zero = folder / "pytorch_model" / "zero"
    for name in order_of(model):
        (zero / name).mkdir(parents=True)
        state = optimizer.state[params[name]]
        for key, tensor in (("fp32", params[name].detach()), ("exp_avg", state["exp_avg"]),
                            ("exp_avg_sq", state["exp_avg_sq"])):
            torch.save({"param": tensor.flatten().clone(), "cat_dim": 0}, zero / name / f"{key}.pt")
    torch.save({"optimizer_state_dict": {"state": {0: {"step": torch.tensor(2.0)}}}}, zero / "optimizer_state.pt")


@pytest.mark.parametrize("source", ["torch", "zero3"])
def test_loaded_into_another_torch_optimizer_it_steps_as_the_original_bitwise(tmp_path, source) -> None:
    """One process: the restored model and optimizer take the same next two steps as the originals (each parameter
    with its own step count: given one shared step tensor, as ZeRO-3's single step is read, torch's Adam would
    advance it once per parameter)."""
    model, optimizer = trained(tied=False)
    if source == "torch":
        states = _torch_states(save_like_accelerate(model, optimizer, tmp_path / "step_2"), order_of(model))
    else:
        zero3_like(tmp_path / "u", model, optimizer)
        states = universal_states(tmp_path / "u")
    fresh, fresh_optimizer = trained(tied=False, seed=5, steps=0)
    load_torch(states, fresh, fresh_optimizer, param_group_names(fresh))
    steps = [s["step"] for s in fresh_optimizer.state.values()]
    assert len({id(s) for s in steps}) == len(steps) == len(order_of(model))
    for seed in (11, 12):
        for m, opt in ((model, optimizer), (fresh, fresh_optimizer)):
            fake_gradients(m, seed)
            opt.step()
    for (name, a), (_, b) in zip(model.named_parameters(), fresh.named_parameters()):
        assert torch.equal(a, b), name


def identity(engine: str, **extra) -> dict:
    return {**IDENTITY_BEFORE_RECORDED, "engine": engine, "dataset_cache_key": "k", "micro_batch_size": 2,
            "gradient_accumulation_steps": 2, "world_size": 2, "seed": 1, "packing": False,
            "max_tokens_per_batch": None, "balanced": True, "adapters": "full model", **extra}


def test_the_check_lets_a_checkpoint_change_engine_between_zero_fsdp2_and_plain(tmp_path) -> None:
    for saved, now in (("deepspeed", "fsdp2"), ("fsdp2", "torch"), ("torch", "deepspeed")):
        check_compatible(tmp_path, identity(saved), identity(now))
        check_compatible(tmp_path, identity(saved, world_size=1, gradient_accumulation_steps=4), identity(now))
    with pytest.raises(UserError, match=r"the training engine .*: checkpoint 'pipeline', now 'torch'"):
        check_compatible(tmp_path, identity("pipeline"), identity("torch"))


def test_pipeline_stages_relaunched_without_them_are_refused_for_the_stages_not_the_engine(tmp_path) -> None:
    """A checkpoint of pipeline stages under DDP without --pipeline_parallel_size: the reason is the stages (the
    engine line read as if engines never resumed each other's checkpoints, which ZeRO, FSDP2 and DDP do)."""
    stages = identity("pipeline", pipeline_parallel_size="2 (1 per rank, layers balanced)")
    for saved, now in ((stages, identity("torch")), (identity("fsdp2"), {**stages, "world_size": 2})):
        with pytest.raises(UserError) as error:
            check_compatible(tmp_path, saved, now)
        lines = [line for line in str(error.value).splitlines() if line.startswith("  - ")]
        assert len(lines) == 1 and lines[0].startswith("  - --pipeline_parallel_size and its stages"), lines


@pytest.mark.parametrize("state, config, dtype, reason", [
    ({"identity": identity("deepspeed", adapters="LoRA rank 8, alpha 16, on q_proj")}, {}, torch.float32,
     "LoRA and QLoRA checkpoints resume under the engine that wrote them"),
    ({"identity": identity("deepspeed"), "config": {"train": {"use_8bit_optimizer": True}}}, {}, torch.float32,
     "--use_8bit_optimizer keeps quantized moments"),
    ({"identity": identity("fsdp2")}, {"train": {"use_8bit_optimizer": True}}, torch.float32,
     "--use_8bit_optimizer keeps quantized moments"),
    ({"identity": identity("torch"), "grad_scaler": {"scale": 65536.0}}, {}, torch.bfloat16,
     "fp16 keeps its loss scale in each engine's own state"),
    ({"identity": identity("torch")}, {}, torch.float16, "fp16 keeps its loss scale"),
])
def test_what_cannot_change_engine_is_refused_before_anything_loads(state, config, dtype, reason) -> None:
    assert reason in refusal(state, config, dtype)
    run = SimpleNamespace(train=SimpleNamespace(), to_dict=lambda: config)
    now = "fsdp2" if state["identity"]["engine"] != "fsdp2" else "deepspeed"
    with pytest.raises(UserError, match=r"cannot resume the .* checkpoint under ") as error:
        fit_to_checkpoint(run, identity(now), state, is_main=True, dtype=dtype)
    assert reason in str(error.value)


def test_a_full_model_in_bf16_or_fp32_changes_engine() -> None:
    assert refusal({"identity": identity("deepspeed"), "config": {"model": {"torch_dtype": "bfloat16"}}},
                   {"train": {"use_8bit_optimizer": False}}, torch.bfloat16) is None


@pytest.mark.parametrize("saved_stage3", [False, True])
def test_a_checkpoint_of_another_engine_or_zero_stage_is_loaded_by_conversion(tmp_path, saved_stage3) -> None:
    """DeepSpeed's own load reads only its own stage's files: ZeRO-1/2 ↔ 3 converts as another engine does."""
    files = tmp_path / "pytorch_model"
    files.mkdir()
    (files / ("zero_pp_rank_0_mp_rank_00_model_states.pt" if saved_stage3 else "mp_rank_00_model_states.pt")).touch()
    zero = ResumePoint(tmp_path, {"step": 2, "identity": identity("deepspeed")})

    def trainer(stage3: bool):
        engine = SimpleNamespace(zero_optimization_partition_weights=lambda: stage3)
        return SimpleNamespace(accelerator=SimpleNamespace(num_processes=2), model=engine,
                               engine=SimpleNamespace(checkpoint_io=lambda: "the engine's own"))

    assert isinstance(checkpoint_io(zero, trainer(False), identity("fsdp2")), CrossEngineResume)
    assert checkpoint_io(zero, trainer(saved_stage3), identity("deepspeed")) == "the engine's own"
    assert isinstance(checkpoint_io(zero, trainer(not saved_stage3), identity("deepspeed")), CrossEngineResume)
