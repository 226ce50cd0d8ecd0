"""The MoE router's aux loss where the model's config asks for it (output_router_logits: true): transformers'
forward, HF's Trainer and open-instruct's finetune.py train it without a flag, and so does open_sft;
--no_load_balancing_loss turns it off. A model that asks for it and has no router loss is refused."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from open_sft.config.parse import parse_config
from open_sft.errors import UserError
from open_sft.model.loss import TokenLossModel
from open_sft.model.router_loss import router_loss_choice

SMALL = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 64,
         "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
QWEN3_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 1,
             "mlp_only_layers": [], "router_aux_loss_coef": 0.5}


def tiny(family: str, **extra) -> torch.nn.Module:
    config = AutoConfig.for_model(family, **{**SMALL, **extra})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :4] = -100
    return ids, labels


@pytest.mark.parametrize(("flag", "asks", "on", "says"), [
    (None, False, False, None),
    (None, True, True, "the model's config asks for it"),
    (True, False, True, "(--load_balancing_loss)"),
    (True, True, True, "(--load_balancing_loss)"),
    (False, True, False, "off (--no_load_balancing_loss), though the model's config asks"),
    (False, False, False, None),
])
def test_the_flag_decides_where_given_else_the_models_config(flag, asks, on, says) -> None:
    config = SimpleNamespace(output_router_logits=asks, router_aux_loss_coef=0.5)
    got_on, line = router_loss_choice(flag, config)
    assert got_on is on
    assert (line is None) if says is None else (says in line and ("0.5" in line) is on), line


def test_the_flag_parses_on_off_and_not_given() -> None:
    base = ["--model_name_or_path", "m", "--dataset_mixer_list", "a.jsonl", "1.0"]
    assert parse_config(base).train.load_balancing_loss is None
    assert parse_config(base + ["--load_balancing_loss"]).train.load_balancing_loss is True
    assert parse_config(base + ["--no_load_balancing_loss"]).train.load_balancing_loss is False
    assert parse_config(base + ["--load_balancing_loss", "false"]).train.load_balancing_loss is False


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_a_config_asking_for_router_logits_trains_the_models_own_loss() -> None:
    """Not given the flag, our loss and gradients are the model's own forward's (which reads the config), aux
    included; --no_load_balancing_loss gives the language-model loss alone, as output_router_logits=False does."""
    model = tiny("qwen3_moe", **QWEN3_MOE, output_router_logits=True).train()
    ids, labels = batch()
    trained = int((labels[:, 1:] != -100).sum())
    for flag, theirs in ((None, {}), (False, {"output_router_logits": False})):
        model.zero_grad(set_to_none=True)
        own = model(input_ids=ids, labels=labels, use_cache=False, **theirs)
        own.loss.backward()
        expected = _grads(model)
        wrapped = TokenLossModel(model, load_balancing=flag).train()
        assert (wrapped.router is not None) is (flag is None)
        model.zero_grad(set_to_none=True)
        ours = wrapped(input_ids=ids, labels=labels) / trained
        ours.backward()
        assert float(ours.detach()) == pytest.approx(float(own.loss.detach()), rel=1e-5), flag
        for name, grad in expected.items():
            got = dict(model.named_parameters())[name].grad
            assert float((got - grad).norm() / grad.norm().clamp_min(1e-12)) < 1e-5, (flag, name)
    with torch.no_grad():
        with_aux = model(input_ids=ids, labels=labels, use_cache=False)
    assert float(with_aux.aux_loss) * 0.5 > 1e-3 * float(with_aux.loss)  # the router term is really in there
    wrapped = TokenLossModel(model, load_balancing=None).train()
    wrapped(input_ids=ids, labels=labels)
    assert float(wrapped.aux_sum) / trained == pytest.approx(float(with_aux.aux_loss), rel=1e-5)  # as aux_loss


def test_a_config_asking_for_a_router_loss_the_model_has_not_is_refused_with_the_fix() -> None:
    model = tiny("llama")
    model.config.output_router_logits = True
    with pytest.raises(UserError, match="its config asks for the router's aux loss.*output_router_logits"):
        TokenLossModel(model, load_balancing=None)
    assert TokenLossModel(model, load_balancing=False).router is None


MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 16}
MLA = {"kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8}


@pytest.mark.parametrize(("family", "extra", "why"), [
    ("deepseek_v3", {**MOE, **MLA, "n_routed_experts": 4, "first_k_dense_replace": 0, "n_group": 1, "topk_group": 1},
     "is a mixture of experts balanced without an auxiliary loss: bias-based routing (a per-expert bias on the "
     "router's scores, e_score_correction_bias) evens the experts' load instead"),
    ("glm4_moe", {**MOE, "n_routed_experts": 4, "first_k_dense_replace": 0, "n_group": 1, "topk_group": 1},
     "is a mixture of experts balanced without an auxiliary loss: bias-based routing (a per-expert bias on the "
     "router's scores, e_score_correction_bias) evens the experts' load instead"),
    ("lfm2_moe", {**MOE, "num_experts": 4, "num_dense_layers": 0, "layer_types": ["full_attention", "conv"]},
     "is a mixture of experts balanced without an auxiliary loss: bias-based routing (a per-expert bias on the "
     "router's scores, expert_bias) evens the experts' load instead"),
    ("deepseek_v2", {**MOE, **MLA, "n_routed_experts": 4, "first_k_dense_replace": 0},
     "is a mixture of 4 experts whose transformers model computes no router auxiliary loss "
     "(no load_balancing_loss_func)"),
    ("llama", {}, "is not a mixture-of-experts model"),
])
def test_load_balancing_on_a_model_without_a_router_loss_says_why(family, extra, why) -> None:
    """An aux-loss-free MoE (DeepSeek-V3, GLM-4.5, LFM2-MoE) was refused as "not a mixture-of-experts model
    transformers trains with one": the refusal stays, and says the family is an MoE balanced by bias-based routing,
    so there is no loss to add and the flag should be dropped."""
    with pytest.raises(UserError) as refused:
        TokenLossModel(tiny(family, **extra), load_balancing=True)
    assert str(refused.value) == (f"--load_balancing_loss: model type {family!r} {why}, so there is no router "
                                  "load-balancing loss to add; drop the flag")


@pytest.mark.parametrize(("flag", "asks", "refused"), [(None, True, True), (False, True, False), (None, False, False)])
def test_auto_micro_batch_size_refuses_a_router_loss_the_models_config_turns_on(flag, asks, refused) -> None:
    """The router loss is computed over each micro-batch's routing: --auto_micro_batch_size's other split would train
    another loss. The flag is refused with --load_balancing_loss up front (open_sft.config.checks); the config's
    own request is known once the model is, where the micro-batch is chosen."""
    from open_sft.preflight.auto_batch import fit_micro_batch, refuse_a_router_loss

    model = tiny("qwen3_moe", **QWEN3_MOE, output_router_logits=asks)
    if not refused:
        refuse_a_router_loss(flag, model)
        return
    config = SimpleNamespace(train=SimpleNamespace(load_balancing_loss=flag, per_device_train_batch_size=8,
                                                   gradient_accumulation_steps=1))
    with pytest.raises(UserError, match=r"--auto_micro_batch_size: the model's config trains the router's "
                                        r"load-balancing loss \(output_router_logits: true\).*pass "
                                        r"--no_load_balancing_loss"):
        fit_micro_batch(config, model, None, None, False, 0, SimpleNamespace(world_size=1, distributed=False))


def test_the_router_loss_of_packed_rows_counts_their_real_tokens_not_the_padding() -> None:
    """Examples of 40 and 12 tokens: one padded micro-batch, one packed row of 52, and two packed rows (40, and
    12 + 28 padding) route the same tokens, so their aux losses and router gradients are equal; the padding after
    the short row was routed and averaged in, and took router gradient. The trainer's micro-batches (StepBatches)
    carry the rows' real positions, a filler's too (taken before its counts are zeroed: no position would be NaN)."""
    from types import SimpleNamespace

    from open_sft.data.batching import collate, collate_packed, pop_counts, real_positions
    from open_sft.data.labels import Example
    from open_sft.training.micro_batches import StepBatches

    model = tiny("qwen3_moe", **QWEN3_MOE)
    loss_model = TokenLossModel(model, load_balancing=True).train()
    generator = torch.Generator().manual_seed(1)
    examples = [Example(ids, ids) for ids in (torch.randint(3, 96, (n,), generator=generator).tolist()
                                              for n in (40, 12))]
    trained = 50  # 39 + 11: each example's first token has no label

    def aux_and_router_grads(batch: dict, masked: bool) -> tuple[float, torch.Tensor]:
        inputs = {**batch, **({"router_mask": real_positions(batch)} if masked else {})}
        pop_counts(inputs)
        model.zero_grad(set_to_none=True)
        loss_model(**inputs).backward()
        routers = torch.cat([p.grad.flatten() for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")])
        return float(loss_model.aux_sum) / trained, routers

    padded = aux_and_router_grads(collate(examples, 0), masked=False)
    one_row = aux_and_router_grads(collate_packed(examples, 0, row_capacity=52), masked=True)
    two_rows = collate_packed(examples, 0, row_capacity=40)
    assert two_rows["row_lengths"].tolist() == [40, 12] and two_rows["input_ids"].shape == (2, 40)
    assert real_positions(two_rows).sum(dim=1).tolist() == [40, 12]
    masked = aux_and_router_grads(two_rows, masked=True)
    unmasked = aux_and_router_grads(collate_packed(examples, 0, row_capacity=40), masked=False)
    for same in (one_row, masked):
        assert same[0] == pytest.approx(padded[0], rel=1e-6)
        assert float((same[1] - padded[1]).norm() / padded[1].norm()) < 1e-5
    assert abs(unmasked[0] - padded[0]) > 1e-4  # what counting the padding did, to the loss and its gradient
    assert float((unmasked[1] - padded[1]).norm() / padded[1].norm()) > 1e-4

    data = SimpleNamespace(example=lambda i: examples[i], source=lambda i: 0)
    args, steps = SimpleNamespace(packing=True), SimpleNamespace(max_seq_length=40)
    for routed in (True, False):
        batches = StepBatches(data, steps, args, 0, 0, routed=routed)
        real, filler = batches.collate([0, 1]), batches.collate([0, 1], loss_free=True)
        assert ("router_mask" in real) is routed and ("router_mask" in filler) is routed
    assert real_positions(two_rows).equal(StepBatches(data, steps, args, 0, 0, routed=True).collate([0, 1])[
        "router_mask"])
    assert filler["row_lengths"].sum() == 0
    assert StepBatches(data, steps, args, 0, 0, routed=True).collate([0, 1], loss_free=True)["router_mask"].sum() == 52


def ulysses_cut(batch: dict, rank: int, size: int) -> dict:
    """Rank `rank`'s slice of a micro-batch as DeepSpeed's UlyssesSPDataLoaderAdapter cuts it: the labels become
    `shift_labels` (each position's target, shifted before the cut), then every [rows, length] tensor is cut along
    the sequence."""
    batch = {k: v for k, v in batch.items() if k not in ("lengths", "row_lengths")}
    labels = torch.nn.functional.pad(batch.pop("labels"), (0, 1), value=-100)
    batch["shift_labels"] = labels[..., 1:]
    chunk = batch["input_ids"].shape[1] // size
    return {k: v[:, chunk * rank:chunk * (rank + 1)] for k, v in batch.items()}


def test_under_sequence_parallelism_each_slice_routes_its_real_tokens_alone() -> None:
    """Ulysses SP drops the attention mask and pads a micro-batch to its group's width: packed (40 + 12 tokens in one
    row) and padded (two rows) micro-batches carried no router_mask, so each slice routed every position it held,
    the padding too. They carry their real positions, grown with 0, cut as the input ids are: a slice's aux loss is
    that of its real tokens alone, and a slice of padding alone drops its mask (no position: NaN) and adds 0."""
    from open_sft.data.labels import Example
    from open_sft.distributed.sequence_parallel import slice_inputs
    from open_sft.training.micro_batches import StepBatches

    generator = torch.Generator().manual_seed(1)
    examples = [Example(ids, ids) for ids in (torch.randint(3, 96, (n,), generator=generator).tolist()
                                              for n in (40, 12))]
    data = SimpleNamespace(example=lambda i: examples[i], source=lambda i: 0, lengths=lambda: [40, 12])
    packed_steps = SimpleNamespace(plan=SimpleNamespace(max_tokens=52))
    padded_steps = SimpleNamespace(layout=SimpleNamespace(micro_batch_size=2))
    packed = StepBatches(data, packed_steps, SimpleNamespace(packing=True), 0, 0, sp_size=2, routed=True)
    padded = StepBatches(data, padded_steps, SimpleNamespace(packing=False), 0, 0, sp_size=2, routed=True)
    row = packed.collate([0, 1], width=64)
    assert row["router_mask"].tolist() == [[1] * 52 + [0] * 12] and row["input_ids"].shape == (1, 64)
    rows = padded.collate([0, 1], width=128)
    assert rows["router_mask"].tolist() == [[1] * 40 + [0] * 88, [1] * 12 + [0] * 116]
    assert "attention_mask" not in rows and rows["input_ids"].shape == (2, 128)
    assert "router_mask" not in StepBatches(data, packed_steps, SimpleNamespace(packing=True), 0, 0,
                                            sp_size=2).collate([0, 1], width=64)

    model = tiny("qwen3_moe", **QWEN3_MOE)
    loss_model = TokenLossModel(model, load_balancing=True).train()

    def aux(inputs: dict) -> float:
        loss_model(**inputs)
        return float(loss_model.aux_sum)

    # positions 32-63: 8 of the first example, the 12 of the second, 12 of padding
    second = slice_inputs(ulysses_cut(row, 1, 2))
    assert second["router_mask"].sum() == 20 and "sources" not in second
    real = {k: v[:, :20] for k, v in second.items() if k != "router_mask"}
    assert aux(second) == pytest.approx(aux(real), rel=1e-5)
    assert abs(aux({k: v for k, v in second.items() if k != "router_mask"}) - aux(real)) > 1e-4 * aux(real)  # the bug
    empty = ulysses_cut(packed.collate([0, 1], width=128), 1, 2)  # positions 64-127: padding alone
    with torch.no_grad():
        assert math.isnan(float(loss_model(**{k: v for k, v in empty.items() if k != "sources"})))
        assert "router_mask" not in slice_inputs(empty) and float(loss_model(**slice_inputs(empty))) == 0.0
