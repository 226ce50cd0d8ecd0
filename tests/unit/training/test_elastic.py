"""Resuming on another number of ranks (open_sft.training.elastic): the accumulation fitted to keep the global
batch, the refusals with their reasons, why the steps stay the same (the plans), and the random states of ranks a
checkpoint did not have, the ZeRO checkpoint through DeepSpeed's universal format. The real launches are in
tests/integration/test_fsdp.py (FSDP2 2 → 1, one process's on 2 DDP ranks) and tests/integration/test_checkpoint.py
(ZeRO-3 2 → 1)."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from open_sft.data.batching import BatchLayout, PackedPlan, UnpackedPlan
from open_sft.errors import UserError
from open_sft.training.checkpoint import ResumePoint
from open_sft.training.elastic import (describe, fit_to_checkpoint, fitted_accumulation, peek, reseed_new_ranks,
                                       rng_seed)
from open_sft.training.resume import IDENTITY_BEFORE_RECORDED, check_compatible


def identity(world: int, accumulation: int, micro: int = 2, **extra) -> dict:
    return {**IDENTITY_BEFORE_RECORDED, "engine": "torch", "dataset_cache_key": "k", "micro_batch_size": micro,
            "gradient_accumulation_steps": accumulation, "world_size": world, "seed": 1, "packing": False,
            "max_tokens_per_batch": None, "balanced": True, "adapters": "full model", **extra}


@pytest.mark.parametrize("saved, world, expected", [((2, 2), 1, 4), ((1, 4), 2, 2), ((2, 2), 4, 1), ((4, 1), 2, 2),
                                                    ((2, 3), 3, 2), ((3, 2), 2, 3)])
def test_the_relaunched_command_gets_the_accumulation_that_keeps_the_global_batch(saved, world, expected) -> None:
    # the same command relaunched: --gradient_accumulation_steps is the checkpoint's
    now = identity(world, saved[1])
    assert fitted_accumulation(identity(*saved), now, "token") == expected


def test_an_accumulation_given_for_the_new_ranks_is_kept_when_it_keeps_the_global_batch() -> None:
    assert fitted_accumulation(identity(2, 2), identity(1, 4), "token") == 4
    with pytest.raises(UserError, match=r"--gradient_accumulation_steps 3: micro-batch 2 × 3 × 1 ranks is not its "
                                        r"global batch of 8; pass the checkpoint's --gradient_accumulation_steps 2"):
        fitted_accumulation(identity(2, 2), identity(1, 3), "token")


def test_a_global_batch_the_new_ranks_cannot_hold_is_refused_naming_the_fix() -> None:
    with pytest.raises(UserError) as error:
        fitted_accumulation(identity(2, 1), identity(4, 1), "token")
    assert str(error.value) == (
        "cannot resume the 2-rank checkpoint on 4 process(es): its global batch of 4 (micro-batch 2 × accumulation "
        "1 × 2 ranks) is not a whole number of micro-batches of 2 on each of 4 ranks; launch a number of processes "
        "that divides 2, or start over with --resume_from_checkpoint none")


def test_a_packed_global_batch_is_counted_in_packed_micro_batches_when_refused() -> None:
    """Packed, a micro-batch is a token budget: the global batch of micro-batch 2 × 2 × 2 ranks is 4 packed
    micro-batches (the allowed path's words), not 8 of anything."""
    with pytest.raises(UserError) as error:
        fitted_accumulation(identity(2, 2, packing=True), identity(3, 2, packing=True), "token")
    assert str(error.value) == (
        "cannot resume the 2-rank checkpoint on 3 process(es): its global batch of 4 packed micro-batches "
        "(accumulation 2 × 2 ranks) is not a whole number of packed micro-batches on each of 3 ranks; launch a "
        "number of processes that divides 4, or start over with --resume_from_checkpoint none")
    with pytest.raises(UserError, match=r"--gradient_accumulation_steps 3: accumulation 3 × 1 ranks = 3 packed "
                                        r"micro-batches is not its global batch of 4; pass the checkpoint's "
                                        r"--gradient_accumulation_steps 2"):
        fitted_accumulation(identity(2, 2, packing=True), identity(1, 3, packing=True), "token")
    assert "keeps the global batch of 4 packed micro-batches" in describe(identity(2, 2, packing=True), 1, 4, True)


@pytest.mark.parametrize("saved_extra, now_extra, normalization, reason", [
    ({"engine": "pipeline", "pipeline_parallel_size": "2"}, {"engine": "pipeline", "pipeline_parallel_size": "2"},
     "token", "resumes only on its own 2 process"),
    ({"sequence_parallel_size": 2}, {"sequence_parallel_size": 2}, "token", "--sequence_parallel_size groups"),
    ({"tensor_parallel_size": 2}, {}, "token", "tensor parallelism groups"),
    ({}, {"balanced": True}, "mean", "--loss_normalization mean with --balance_micro_batches"),
])
def test_what_cannot_change_its_ranks_is_refused_with_the_reason(saved_extra, now_extra, normalization,
                                                                  reason) -> None:
    with pytest.raises(UserError, match="cannot resume the 2-rank checkpoint on 1 process") as error:
        fitted_accumulation(identity(2, 2, **saved_extra), identity(1, 2, **now_extra), normalization)
    assert reason in str(error.value)


def test_mean_loss_resumes_on_other_ranks_when_micro_batches_are_not_balanced() -> None:
    assert fitted_accumulation(identity(2, 2, balanced=False), identity(1, 2, balanced=False), "mean") == 4


def test_zero_checkpoints_resume_on_other_ranks_through_the_universal_format() -> None:
    from open_sft.training.portable import checkpoint_io
    from open_sft.training.universal import UniversalResume

    assert fitted_accumulation(identity(2, 2, engine="deepspeed"), identity(1, 2, engine="deepspeed"), "token") == 4

    def trainer(world: int):
        return SimpleNamespace(accelerator=SimpleNamespace(num_processes=world), model=None,
                               engine=SimpleNamespace(checkpoint_io=lambda: "the engine's own"))

    zero = ResumePoint(Path("c"), {"step": 2, "identity": identity(2, 2, engine="deepspeed")})
    now = {"engine": "deepspeed"}
    assert isinstance(checkpoint_io(zero, trainer(1), now), UniversalResume)
    assert checkpoint_io(zero, trainer(2), now) == "the engine's own"  # the same ranks: DeepSpeed's own files
    assert checkpoint_io(ResumePoint(Path("c"), {"step": 2, "identity": identity(2, 2)}), trainer(1),
                         {"engine": "torch"}) == "the engine's own"  # a plain checkpoint loads on any ranks as it is
    assert checkpoint_io(None, trainer(1), now) == "the engine's own"


def test_each_adam_state_gets_its_own_step_after_a_universal_load() -> None:
    from open_sft.training.universal import _unshare_steps

    params = [torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))]
    adam = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:]}])
    step = torch.tensor(2.0)
    for p in params:  # as DeepSpeed 0.19's ZeRO-3 universal load leaves them: one tensor for every group
        adam.state[p] = {"step": step, "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    _unshare_steps(SimpleNamespace(optimizer=adam))
    for p in params:
        p.grad = torch.ones_like(p)
    adam.step()
    assert [float(adam.state[p]["step"]) for p in params] == [3.0, 3.0]  # one shared tensor: advanced twice, 4


def test_the_one_log_line() -> None:
    assert describe(identity(2, 2), 4, 1, packed=False) == (
        "resuming a 2-rank checkpoint on 1 rank: gradient accumulation 2 -> 4 keeps the global batch of 8 sequences")
    assert describe(identity(1, 4), 2, 2, packed=True) == (
        "resuming a 1-rank checkpoint on 2 ranks: gradient accumulation 4 -> 2 keeps the global batch of 4 packed "
        "micro-batches")


def test_the_check_accepts_another_number_of_ranks_only_with_the_same_global_batch(tmp_path) -> None:
    check_compatible(tmp_path, identity(2, 2), identity(1, 4))  # refused before: world size 2, now 1
    check_compatible(tmp_path, identity(1, 4), identity(4, 1))
    with pytest.raises(UserError, match=r"the number of processes \(world size\): checkpoint 2, now 1"):
        check_compatible(tmp_path, identity(2, 2), identity(1, 2))
    check_compatible(tmp_path, identity(2, 2, engine="deepspeed"), identity(1, 4, engine="deepspeed"))
    with pytest.raises(UserError, match="the number of processes"):  # a pipeline's stages: not another world size
        check_compatible(tmp_path, identity(2, 2, engine="pipeline", pipeline_parallel_size="2"),
                         identity(1, 4, engine="pipeline", pipeline_parallel_size="2"))


def _config(accumulation: int, normalization: str = "token", load_balancing_loss=False, model=None):
    train = SimpleNamespace(gradient_accumulation_steps=accumulation, loss_normalization=normalization, packing=False,
                            load_balancing_loss=load_balancing_loss, auto_micro_batch_size=False)
    return SimpleNamespace(train=train, model=model)


def test_a_router_loss_with_balanced_micro_batches_is_refused_on_other_ranks(tmp_path) -> None:
    """The router's load-balancing loss is computed over each micro-batch's routing, and balancing groups a step's
    examples into micro-batches by the number of ranks: on other ranks the loss would change. Asked by the flag or,
    the flag not given, by the model's config (read before the model loads)."""
    from transformers import AutoConfig

    from open_sft.config.args import ModelArguments

    with pytest.raises(UserError) as error:
        fitted_accumulation(identity(2, 2), identity(1, 2), "token", router_loss=True)
    assert str(error.value) == (
        "cannot resume the 2-rank checkpoint on 1 process(es): the router's load-balancing loss with "
        "--balance_micro_batches: balancing groups a step's examples into micro-batches by the number of ranks, and "
        "the router loss is computed over each micro-batch's routing; relaunch on 2 process(es) (a run that may "
        "change its ranks: --balance_micro_batches false from its first step)")
    assert fitted_accumulation(identity(2, 2, balanced=False), identity(1, 2, balanced=False), "token",
                               router_loss=True) == 4
    AutoConfig.for_model("qwen3_moe", num_experts=4, num_experts_per_tok=2, output_router_logits=True,
                         hidden_size=32, num_hidden_layers=1, num_attention_heads=2).save_pretrained(tmp_path)
    asks = _config(2, load_balancing_loss=None, model=ModelArguments(model_name_or_path=str(tmp_path)))
    with pytest.raises(UserError, match="the router's load-balancing loss with --balance_micro_batches"):
        fit_to_checkpoint(asks, identity(1, 2), {"identity": identity(2, 2)}, is_main=True)
    with pytest.raises(UserError, match="the router's load-balancing loss with --balance_micro_batches"):
        fit_to_checkpoint(_config(2, load_balancing_loss=True), identity(1, 2), {"identity": identity(2, 2)}, True)


def test_fit_to_checkpoint_changes_only_the_accumulation_and_says_so_once(caplog, monkeypatch) -> None:
    import dataclasses

    monkeypatch.setattr(dataclasses, "replace", lambda obj, **kw: SimpleNamespace(**{**vars(obj), **kw}))
    caplog.set_level(logging.INFO, logger="open_sft.training.elastic")
    fitted = fit_to_checkpoint(_config(2), identity(1, 2), {"identity": identity(2, 2)}, is_main=True)
    assert fitted.train.gradient_accumulation_steps == 4 and fitted.train.loss_normalization == "token"
    assert [r.getMessage() for r in caplog.records] == [describe(identity(2, 2), 4, 1, packed=False)]
    config = _config(2)
    assert fit_to_checkpoint(config, identity(2, 2), {"identity": identity(2, 2)}, is_main=True) is config  # same ranks
    assert fit_to_checkpoint(config, identity(1, 2), None, is_main=True) is config  # fresh start
    assert fit_to_checkpoint(config, identity(1, 2, micro=4), {"identity": identity(2, 2)}, True) is config  # the
    # check refuses


def test_peek_reads_the_identity_of_the_checkpoint_a_resume_would_read(tmp_path) -> None:
    from open_sft.training.checkpoint import publish

    root = tmp_path / "checkpoints"
    for step, world in ((2, 2), (4, 1)):
        tmp = root / f"step_{step}.tmp"
        tmp.mkdir(parents=True)
        (tmp / "trainer_state.json").write_text(json.dumps({"step": step, "identity": identity(world, 2)}))
        publish(tmp, root / f"step_{step}", step)
    (root / "step_6").mkdir()  # no COMPLETE: never resumed from

    def config(setting: str, overwrite: bool = False):
        return SimpleNamespace(train=SimpleNamespace(output_dir=str(tmp_path)), checkpoint=SimpleNamespace(
            resume_from_checkpoint=setting, overwrite_output_dir=overwrite))

    assert peek(config("auto"))["identity"]["world_size"] == 1
    assert peek(config(str(root / "step_2")))["identity"]["world_size"] == 2
    assert peek(config("none")) is None and peek(config(str(root / "step_6"))) is None
    assert peek(config("auto", overwrite=True)) is None  # --overwrite_output_dir starts over


def test_a_rank_the_checkpoint_lacked_gets_random_states_from_seed_step_and_rank(tmp_path, caplog) -> None:
    (tmp_path / "random_states_0.pkl").write_bytes(b"")
    resume = ResumePoint(tmp_path, {"step": 6, "identity": identity(1, 4)})
    caplog.set_level(logging.INFO, logger="open_sft.training.elastic")
    draws = []
    for _ in range(2):
        reseed_new_ranks(resume, process_index=1, world=2, seed=1)
        draws.append((random.random(), float(torch.rand(1))))
    assert draws[0] == draws[1]  # deterministic
    torch.manual_seed(rng_seed(1, 6, 1))
    assert draws[0][1] == float(torch.rand(1))
    assert rng_seed(1, 6, 1) != rng_seed(1, 6, 2) != rng_seed(1, 7, 1)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    reseed_new_ranks(resume, process_index=0, world=2, seed=1)  # rank 0 keeps what load_state gave it
    assert torch.equal(torch.get_rng_state(), before)
    assert caplog.records[-1].getMessage() == ("the 1-rank checkpoint has no random state for rank(s) 1: theirs "
                                               "are derived from --seed, the step and the rank")


def test_a_resume_on_other_ranks_with_dropout_says_the_masks_differ(tmp_path, caplog) -> None:
    """Each rank draws dropout masks from its own random stream, and on other ranks a micro-batch is another rank's
    draw: the resumed steps cannot follow the uninterrupted run, which the line says, naming the dropout (LoRA's
    modules, a config's attention dropout); without dropout, or on the checkpoint's own ranks, nothing is said."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    plain = LlamaForCausalLM(LlamaConfig(**shape))
    lora = get_peft_model(LlamaForCausalLM(LlamaConfig(**shape)),
                          LoraConfig(r=2, lora_dropout=0.1, target_modules=["q_proj", "v_proj"]))
    attention = LlamaForCausalLM(LlamaConfig(**shape, attention_dropout=0.05))
    resume = ResumePoint(tmp_path, {"step": 6, "identity": identity(2, 2)})
    caplog.set_level(logging.INFO, logger="open_sft.training.elastic")
    said = []
    for model, world, rank in ((lora, 1, 0), (attention, 4, 0), (lora, 1, 1), (plain, 1, 0), (lora, 2, 0)):
        caplog.clear()
        reseed_new_ranks(resume, process_index=rank, world=world, seed=1, model=model)
        said.append([r.getMessage() for r in caplog.records if r.levelno == logging.WARNING])
    assert said[0] == ["the 2-rank checkpoint resumes on 1 rank(s) with dropout on (lora_dropout 0.1): each rank draws "
                       "its masks from its own random stream, so the steps from here train on other masks than the "
                       "uninterrupted run's (alike in distribution, not the same numbers; the losses and weights "
                       "follow it within rounding only without dropout, e.g. --lora_dropout 0 from the first step)"]
    assert "on 4 rank(s) with dropout on (attention_dropout 0.05)" in said[1][0]
    assert said[2:] == [[], [], []]  # another rank than the main one; no dropout; the checkpoint's own ranks


def _steps(plan, world: int, steps: int) -> list[tuple[list[int], list[list[int]]]]:
    """Each step's examples (sorted) and its micro-batches (each sorted, as a sorted list) over all ranks."""
    out = []
    for step in range(steps):
        micro = [sorted(m) for rank in range(world) for m in plan.micro_batches(0, step, rank)]
        out.append((sorted(i for m in micro for i in m), sorted(micro)))
    return out


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("balanced", [False, True])
def test_the_same_global_batch_on_other_ranks_trains_the_same_examples_at_every_step(packed, balanced) -> None:
    rng = random.Random(0)
    lengths = [rng.randint(10, 300) for _ in range(200)]

    def plan(accumulation: int, world: int):
        layout = BatchLayout(2, accumulation, world)
        if packed:
            return PackedPlan(lengths, layout, seed=3, max_tokens=512, balance=balanced)
        return UnpackedPlan(len(lengths), layout, seed=3, lengths=lengths if balanced else None)

    layouts = [_steps(plan(a, w), w, 10) for a, w in ((4, 1), (2, 2), (1, 4))]
    assert [examples for examples, _ in layouts[0]] == [examples for examples, _ in layouts[1]] \
        == [examples for examples, _ in layouts[2]]
    assert sum(len(examples) for examples, _ in layouts[0]) >= 70  # real steps, not empty ones
    if not balanced:  # slot k holds the same examples whatever the ranks: so do the micro-batches (mean loss)
        assert [m for _, m in layouts[0]] == [m for _, m in layouts[1]] == [m for _, m in layouts[2]]


def test_dropout_of_heads_a_causal_lm_does_not_have_is_not_said() -> None:
    """GPT-NeoX's config defaults classifier_dropout to 0.1 (a sequence-classification head's): a Pythia full fine-tune
    resumed on other ranks was told its masks differ and to use --lora_dropout 0. Only dropout its causal LM
    draws is said: nn.Dropout modules of p > 0 and the attention dropout its config gives as a function argument."""
    from transformers import (FalconConfig, FalconForCausalLM, GPT2Config, GPT2LMHeadModel, GPTNeoXConfig,
                              GPTNeoXForCausalLM)

    from open_sft.training.elastic import dropout_in

    shape = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    pythia = GPTNeoXForCausalLM(GPTNeoXConfig(**shape))
    assert pythia.config.classifier_dropout == 0.1 and dropout_in(pythia) == []
    assert dropout_in(GPTNeoXForCausalLM(GPTNeoXConfig(**shape, attention_dropout=0.2, hidden_dropout=0.1))) == [
        "attention_dropout 0.2", "emb_dropout 0.1", "hidden_dropout 0.1", "post_attention_dropout 0.1",
        "post_mlp_dropout 0.1"]
    # Falcon's (and Bloom's) hidden_dropout is a function argument on the residual stream, no nn.Dropout module
    falcon = dict(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2)
    assert dropout_in(FalconForCausalLM(FalconConfig(**falcon))) == []
    assert dropout_in(FalconForCausalLM(FalconConfig(**falcon, hidden_dropout=0.1))) == ["hidden_dropout 0.1"]
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0))
    assert gpt2.config.summary_first_dropout == 0.1 and dropout_in(gpt2) == []


def test_dropout_a_config_gives_in_a_sub_config_or_as_pdrop_is_said() -> None:
    """DBRX applies resid_pdrop, emb_pdrop and its attn_config's attn_pdrop as function arguments, no nn.Dropout
    module: a DBRX run with them resumed on other ranks was not warned that its masks differ. They are read, and a
    sub-config given as a plain dict (MPT's remote code keeps attn_config so) is read too."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from open_sft.training.elastic import dropout_in

    shape = dict(d_model=32, n_heads=4, n_layers=1, vocab_size=64, max_seq_len=64,
                 ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 2, "moe_top_k": 1})
    attention = {"kv_n_heads": 2, "rope_theta": 10000.0}
    quiet = AutoModelForCausalLM.from_config(AutoConfig.for_model("dbrx", **shape, attn_config=attention))
    assert dropout_in(quiet) == []
    dbrx = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "dbrx", **shape, attn_config={**attention, "attn_pdrop": 0.2}, resid_pdrop=0.1, emb_pdrop=0.05))
    assert dropout_in(dbrx) == ["attn_config.attn_pdrop 0.2", "emb_pdrop 0.05", "resid_pdrop 0.1"]
    quiet.config.attn_config = {"attn_pdrop": 0.3, "attn_impl": "torch"}
    assert dropout_in(quiet) == ["attn_config.attn_pdrop 0.3"]
    quiet.config.vq_config = {"dropout": 0.1}  # an image tokenizer's (Chameleon's), not the text path's
    assert dropout_in(quiet) == ["attn_config.attn_pdrop 0.3"]


def _auto_config(micro: int, accumulation: int, normalization: str = "token"):
    train = SimpleNamespace(per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation,
                            loss_normalization=normalization, packing=False, auto_micro_batch_size=True)
    return SimpleNamespace(train=train)


def _auto_state(micro: int, accumulation: int, world: int, flags: tuple[int, int], **extra) -> dict:
    """A checkpoint of an --auto_micro_batch_size run: its identity has the split auto chose (micro, accumulation on
    world ranks), its settings the flags the command gave."""
    from open_sft.training.run_settings import SETTINGS_KEY

    settings = {"per_device_train_batch_size": flags[0], "gradient_accumulation_steps": flags[1]}
    return {"step": 10, "identity": identity(world, accumulation, micro=micro, **extra),
            "config": {SETTINGS_KEY: [{"from_step": 1, "settings": settings}]}}


def test_an_auto_micro_batch_checkpoint_resumes_on_other_ranks_and_other_memory(tmp_path, caplog,
                                                                                monkeypatch) -> None:
    """review ckpt 1: `--per_device_train_batch_size 8 --auto_micro_batch_size` on 2 ranks, auto chose 4 × 2. Requeued
    on 1 rank it was refused 'the number of processes (world size): checkpoint 2, now 1' (fit_to_checkpoint compared
    auto's micro-batch with the flag's and fitted nothing); on larger GPUs, '--per_device_train_batch_size: checkpoint
    4, now 8; --gradient_accumulation_steps: checkpoint 2, now 1' though the command was the same. Under auto the
    launch trains the checkpoint's global batch (16) on its ranks, auto splitting each rank's share; the check
    accepts another split of the same global batch (unpacked, the loss not a mean of micro-batch means)."""
    import dataclasses

    monkeypatch.setattr(dataclasses, "replace", lambda obj, **kw: SimpleNamespace(**{**vars(obj), **kw}))
    caplog.set_level(logging.INFO, logger="open_sft.training.elastic")
    state, saved = _auto_state(4, 2, 2, flags=(8, 1)), identity(2, 2, micro=4)
    fitted = fit_to_checkpoint(_auto_config(8, 1), identity(1, 1, micro=8), state, is_main=True).train
    assert (fitted.per_device_train_batch_size, fitted.gradient_accumulation_steps) == (4, 4)  # 16 on the one rank
    assert fitted.auto_micro_batch_size
    assert caplog.records[-1].getMessage() == (
        "--auto_micro_batch_size resumes the 2-rank checkpoint's global batch of 16 sequences on 1 rank: 16 per rank "
        "(the checkpoint's split: micro-batch 4 × accumulation 2), split by the memory estimate")
    check_compatible(tmp_path, saved, identity(1, 2, micro=8), free_split=True)  # auto then chose 8 × 2
    fitted = fit_to_checkpoint(_auto_config(8, 1), identity(2, 1, micro=8), state, is_main=True).train
    assert (fitted.per_device_train_batch_size, fitted.gradient_accumulation_steps) == (4, 2)  # the same 2 ranks
    check_compatible(tmp_path, saved, identity(2, 1, micro=8), free_split=True)  # larger GPUs: auto chose 8 × 1
    with pytest.raises(UserError, match=r"--per_device_train_batch_size: checkpoint 4, now 8"):
        check_compatible(tmp_path, saved, identity(2, 1, micro=8))  # a run whose split is the math's
    with pytest.raises(UserError, match=r"--per_device_train_batch_size: checkpoint 4, now 2"):
        check_compatible(tmp_path, saved, identity(2, 1, micro=2), free_split=True)  # another global batch


def test_an_auto_micro_batch_resume_refuses_an_accumulation_that_is_not_the_commands_nor_keeps_the_batch(
        monkeypatch) -> None:
    """The checkpoint's flags (8 × 1 on 2 ranks, auto chose 4 × 2) resume on 1 rank: the command's accumulation or
    one that keeps the global batch of 16 is fitted; another is refused as without auto."""
    import dataclasses

    monkeypatch.setattr(dataclasses, "replace", lambda obj, **kw: SimpleNamespace(**{**vars(obj), **kw}))
    state = _auto_state(4, 2, 2, flags=(8, 1))
    fitted = fit_to_checkpoint(_auto_config(8, 2), identity(1, 2, micro=8), state, is_main=True).train  # 8 × 2 × 1
    assert (fitted.per_device_train_batch_size, fitted.gradient_accumulation_steps) == (4, 4)
    with pytest.raises(UserError, match=r"cannot resume the 2-rank checkpoint on 1 process\(es\) with "
                                        r"--gradient_accumulation_steps 3: micro-batch 8 × 3 × 1 ranks is not its "
                                        r"global batch of 16; pass the command's --gradient_accumulation_steps 1"):
        fit_to_checkpoint(_auto_config(8, 3), identity(1, 3, micro=8), state, is_main=True)
    with pytest.raises(UserError, match=r"its global batch of 16 .* is not a whole number of examples on each of 3 "
                                        r"ranks; launch a number of processes that divides 16"):
        fit_to_checkpoint(_auto_config(8, 1), identity(3, 1, micro=8), state, is_main=True)
