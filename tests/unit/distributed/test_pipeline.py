"""Pipeline parallelism's pieces in one process: the stage split (stages chained by hand give the unsplit
model's loss and gradients, for several families), layer ranges, the flags' checks and the refusals, the
micro-batch shape fitting. The multi-rank runs are tests/integration/test_pipeline.py."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from open_sft.distributed.pipeline import check_stage_entry, owned_parameters, split_model
from open_sft.distributed.pipeline_plan import (PipelineLayout, parse_layers, pipeline_flag_problems, pipeline_problems,
                                                stage_ranges)
from open_sft.model.loss import TokenLossModel
from open_sft.training.pipeline_engine import fit_shape, schedule_shape
from tests.unit.model.flash_stub import flash_stub  # noqa: F401 (a fixture)

VOCAB = 96


def tiny(family: str) -> torch.nn.Module:
    from transformers import (GraniteConfig, GraniteForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM)

    torch.manual_seed(0)
    shape = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)
    if family == "qwen3_sliding":  # the layer types differ by stage: a stage must see its own slice of them
        return Qwen3ForCausalLM(Qwen3Config(**shape, head_dim=8, use_sliding_window=True, sliding_window=4,
                                            tie_word_embeddings=False,
                                            layer_types=["full_attention"] * 2 + ["sliding_attention"] * 2))
    if family == "granite":  # multiplies the embeddings in the backbone's forward
        return GraniteForCausalLM(GraniteConfig(**shape, embedding_multiplier=12.0))
    return LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=family == "llama_tied"))


def layout(position: int, size: int = 2, virtual: int = 1) -> PipelineLayout:
    return PipelineLayout(size, virtual, 1, position, 0, None, None, None)


def batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :3] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@pytest.mark.parametrize("family", ["llama", "llama_tied", "qwen3_sliding"])
@pytest.mark.parametrize("size,virtual", [(2, 1), (2, 2)])
def test_stages_chained_by_hand_give_the_unsplit_loss_and_gradients(family, size, virtual) -> None:
    whole = TokenLossModel(tiny(family))
    b = batch()
    reference = whole(**b)
    reference.backward()
    ranks = [TokenLossModel(copy.deepcopy(tiny(family))) for _ in range(size)]
    ranges = stage_ranges([1] * 4, size * virtual)
    modules = {}
    for position, model in enumerate(ranks):  # each "rank" its own copy, holding its stages only
        where = layout(position, size, virtual)
        modules.update(zip(where.stage_ids(), split_model(model, where, ranges, torch.device("cpu"))))
    x = b["input_ids"]
    kwargs = {"attention_mask": b["attention_mask"], "labels": b["labels"]}
    for index in range(size * virtual):
        x = modules[index](x, **kwargs)
    assert torch.equal(x[0], reference)
    x[0].backward()
    grads = {name: p.grad for model in ranks for name, p in owned_parameters(model) if p.grad is not None}
    if family == "llama_tied":  # one parameter in the unsplit model: its two copies' gradients add up
        grads["model.model.embed_tokens.weight"] = grads["model.model.embed_tokens.weight"] + \
            grads.pop("model.lm_head.weight")
    expected = {name: p.grad for name, p in whole.named_parameters()}
    assert grads.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=1e-6, msg=name)


def test_packed_rows_under_flash_attention_2_stay_apart_in_the_stages(flash_stub) -> None:
    """Each stage of a packed micro-batch of two rows under flash_attention_2 (flash-attn stood in for on CPU) tells
    flash-attn where each example starts, read off the micro-batch's position ids: the loss is each example's alone
    (without, each row was one causal sequence)."""
    from open_sft.data.batching import collate_packed
    from open_sft.data.labels import Example

    g = torch.Generator().manual_seed(3)
    examples = [Example(ids, ids) for ids in (torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (9, 5, 7))]
    packed = collate_packed(examples, pad_token_id=0, row_capacity=14)  # rows [9, 5] and [7] with 7 of padding
    model = tiny("llama")
    model.config._attn_implementation = "flash_attention_2"  # what loading sets where flash-attn exists
    alone = sum(TokenLossModel(model)(input_ids=torch.tensor([e.input_ids]), labels=torch.tensor([e.labels]))
                for e in examples)
    modules = {}
    for position in range(2):  # each "rank" its own copy, holding its stage only
        where = layout(position)
        modules.update(zip(where.stage_ids(), split_model(TokenLossModel(copy.deepcopy(model)), where,
                                                          stage_ranges([1] * 4, 2), torch.device("cpu"))))
    x = packed["input_ids"]
    for index in range(2):
        x = modules[index](x, position_ids=packed["position_ids"], labels=packed["labels"])
    assert {tuple(bounds) for kind, bounds, _ in flash_stub.calls if kind == "varlen"} == {(0, 9, 14, 21, 28)}
    torch.testing.assert_close(x[0], alone.detach(), rtol=1e-5, atol=0)


def test_a_rank_holds_only_its_stage_and_keeps_the_whole_models_names() -> None:
    model = TokenLossModel(tiny("llama"))
    names = [name for name, _ in model.named_parameters()]
    split_model(model, layout(1), stage_ranges([1] * 4, 2), torch.device("cpu"))
    owned = [name for name, _ in owned_parameters(model)]
    assert [name for name, _ in model.named_parameters()] == names  # the tree stays whole
    assert owned and all(".layers.2." in n or ".layers.3." in n or n.endswith(("norm.weight", "lm_head.weight"))
                         for n in owned)
    assert "model.model.norm.weight" in owned and "model.lm_head.weight" in owned
    assert not any("embed_tokens" in n or ".layers.0." in n for n in owned)


def test_a_family_whose_forward_changes_the_embeddings_is_refused() -> None:
    assert check_stage_entry(TokenLossModel(tiny("llama"))) is None
    assert check_stage_entry(TokenLossModel(tiny("qwen3_sliding"))) is None
    problem = check_stage_entry(TokenLossModel(tiny("granite")))
    assert problem is not None and "'granite' changes the embeddings" in problem


def test_stage_ranges_balance_parameters() -> None:
    assert stage_ranges([1] * 8, 2) == [range(0, 4), range(4, 8)]
    assert stage_ranges([1] * 7, 3) == [range(0, 3), range(3, 5), range(5, 7)]  # even; the earlier take the extra
    # embeddings on the first stage and the LM head on the last weigh like 3 layers each: fewer layers there
    assert stage_ranges([10] * 16, 4, first_extra=30, last_extra=30) == [range(0, 3), range(3, 9), range(9, 14),
                                                                         range(14, 16)]
    assert stage_ranges([10] * 4, 2, last_extra=25) == [range(0, 3), range(3, 4)]
    assert stage_ranges([5, 1, 1, 1, 1, 1], 2) == [range(0, 1), range(1, 6)]  # a heavy layer (MoE) alone
    assert stage_ranges([1] * 8, 3, [2, 6]) == [range(0, 2), range(2, 6), range(6, 8)]  # --pipeline_layers
    with pytest.raises(ValueError, match="need at least one of the model's 2 decoder layers"):
        stage_ranges([1, 1], 4)
    with pytest.raises(ValueError):
        stage_ranges([1] * 8, 2, [9])


def flags(**changes) -> SimpleNamespace:
    base = dict(pipeline_parallel_size=2, pipeline_virtual_stages=1, pipeline_schedule="1f1b", pipeline_layers=None)
    return SimpleNamespace(**{**base, **changes})


def test_flag_problems_name_the_flag_and_the_fix() -> None:
    assert pipeline_flag_problems(flags()) == []
    assert pipeline_flag_problems(flags(pipeline_layers="2")) == []
    assert parse_layers(" 3, 6 ") == [3, 6]
    assert "needs --pipeline_virtual_stages 2 or more" in pipeline_flag_problems(
        flags(pipeline_schedule="interleaved_1f1b"))[0]
    assert "needs --pipeline_schedule interleaved_1f1b" in pipeline_flag_problems(flags(pipeline_virtual_stages=2))[0]
    assert "gives 3 stages, the pipeline has 2" in pipeline_flag_problems(flags(pipeline_layers="2,3"))[0]
    assert "must increase" in pipeline_flag_problems(flags(pipeline_layers="3,2"))[0]
    assert "comma-separated layer indices" in pipeline_flag_problems(flags(pipeline_layers="a"))[0]
    assert "at least 1" in pipeline_flag_problems(flags(pipeline_parallel_size=0))[0]


def test_what_does_not_compose_is_refused_up_front() -> None:
    def config(**train) -> SimpleNamespace:
        t = dict(pipeline_parallel_size=2, sequence_parallel_size=1, load_balancing_loss=False,
                 auto_micro_batch_size=False)
        return SimpleNamespace(train=SimpleNamespace(**{**t, **train}), lora=SimpleNamespace(use_qlora=False),
                               model=SimpleNamespace(torch_dtype="float32"))

    assert pipeline_problems(config(), 4, False, 1) == []
    assert pipeline_problems(config(pipeline_parallel_size=1), 3, True, 2) == []
    assert "must divide the number of processes (3)" in pipeline_problems(config(), 3, False, 1)[0]
    assert "not under DeepSpeed" in pipeline_problems(config(), 2, True, 1)[0]
    assert "tensor parallelism" in pipeline_problems(config(), 2, False, 2)[0]
    assert "Ulysses" in pipeline_problems(config(sequence_parallel_size=2), 2, False, 1)[0]
    assert "--auto_micro_batch_size" in pipeline_problems(config(auto_micro_batch_size=True), 2, False, 1)[0]
    qlora = config()
    qlora.lora.use_qlora = True
    assert "use --use_lora" in pipeline_problems(qlora, 2, False, 1)[0]


def test_fit_shape_pads_without_loss_or_nan() -> None:
    padded = {"input_ids": torch.tensor([[5, 6, 7]]), "labels": torch.tensor([[-100, 6, 7]]),
              "attention_mask": torch.tensor([[1, 1, 1]])}
    grown = fit_shape(padded, 2, 5, pad_token_id=0)
    assert grown["input_ids"].tolist() == [[5, 6, 7, 0, 0], [0, 0, 0, 0, 0]]
    assert grown["labels"].tolist() == [[-100, 6, 7, -100, -100], [-100] * 5]
    assert grown["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0]]  # no row attends nothing
    packed = {"input_ids": torch.tensor([[5, 6, 7]]), "labels": torch.tensor([[-100, 6, -100]]),
              "position_ids": torch.tensor([[0, 1, 0]])}
    grown = fit_shape(packed, 2, 5, pad_token_id=0)
    assert grown["position_ids"].tolist() == [[0, 1, 0, 0, 1], [0, 1, 2, 3, 4]]
    assert fit_shape(packed, 1, 3, 0) is packed


def test_the_replicas_of_sharded_stages_agree_on_one_schedule_shape() -> None:
    """Packed micro-batches of two replicas with other rows and widths: alone each would pick its own shape (and
    one replica alone would build a new schedule, whose placeholder forward all-gathers the FSDP2 shards the other
    replica never joins); with `agree` (the max over the replicas) both pad to one shape, and the padding trains
    no token."""
    def packed(rows: int, width: int) -> dict[str, torch.Tensor]:
        labels = torch.arange(rows * width).reshape(rows, width) % 7
        return {"input_ids": labels + 1, "labels": labels, "position_ids": torch.arange(width).repeat(rows, 1)}

    replicas = [[packed(3, 100), packed(2, 90)], [packed(4, 70), packed(1, 130)]]
    alone = [schedule_shape(batches) for batches in replicas]
    assert alone == [(3, 128), (4, 192)]

    def replicas_max(values: list[int]) -> list[int]:  # what the all-reduce (max) over the replica group gives
        return [max(mine) for mine in zip(*alone)]

    agreed = [schedule_shape(batches, replicas_max) for batches in replicas]
    assert agreed == [(4, 192), (4, 192)]
    for batch in (b for batches in replicas for b in batches):
        grown = fit_shape(batch, 4, 192, pad_token_id=0)
        assert grown["labels"].shape == (4, 192)
        assert (grown["labels"] != -100).sum() == (batch["labels"] != -100).sum()


def test_the_preflight_counts_the_heaviest_stage_and_the_micro_batches_in_flight() -> None:
    from open_sft.preflight.pipeline_memory import stage_view

    model = tiny("llama")
    one_f_one_b = stage_view(model, SimpleNamespace(**vars(flags()), gradient_accumulation_steps=4))
    assert one_f_one_b.stages == 2 and one_f_one_b.layers == 2
    assert 0.5 <= one_f_one_b.fraction < 0.6  # two of four equal layers plus the embeddings (or the LM head)
    assert one_f_one_b.in_flight == 2  # 1F1B: the first stage holds one micro-batch per stage at most
    gpipe = stage_view(model, SimpleNamespace(**vars(flags(pipeline_schedule="gpipe")), gradient_accumulation_steps=4))
    assert gpipe.in_flight == 8  # GPipe: all the replica's micro-batches (2 ranks × 4)
    assert "pipeline parallel 2 stages × 3 data-parallel replica(s)" in gpipe.describe(3, "gpipe")


def test_a_split_the_model_cannot_take_is_a_user_error_before_training() -> None:
    """The preflight plans the split before the stages are built: --pipeline_layers past the model's last layer is
    the user's error there, naming the flag, not a traceback."""
    from open_sft.distributed.pipeline_plan import plan_stages
    from open_sft.errors import UserError
    from open_sft.preflight.pipeline_memory import stage_view

    ranges, sizes = plan_stages(tiny("llama"), flags())
    assert ranges == [range(0, 2), range(2, 4)] and len(sizes.layers) == 4 and sizes.first == sizes.last - 32
    with pytest.raises(UserError, match="--pipeline_parallel_size 2: 2 pipeline stages need at least one"):
        stage_view(tiny("llama"), SimpleNamespace(**vars(flags(pipeline_layers="9")), gradient_accumulation_steps=1))


def test_the_pipelines_router_mask_counts_a_packed_rows_real_tokens() -> None:
    """The last stage's router loss counts what each micro-batch really has at the schedule's shape: an unpacked
    one's attention mask, a packed one's real positions (the padding after its short row left out, as the other
    engines' forward does), never the columns and rows fit_shape adds."""
    from open_sft.data.batching import collate, collate_packed, real_positions
    from open_sft.data.labels import Example
    from open_sft.training.pipeline_engine import router_mask

    examples = [Example(list(range(3, 3 + n)), list(range(3, 3 + n))) for n in (6, 2)]
    packed = collate_packed(examples, 0, row_capacity=6)
    packed["router_mask"] = real_positions(packed)
    assert router_mask(packed, 3, 8).tolist() == [[1] * 6 + [0, 0], [1, 1] + [0] * 6, [0] * 8]
    assert router_mask(collate(examples, 0), 2, 8).tolist() == [[1] * 6 + [0, 0], [1, 1] + [0] * 6]


class _Stage(torch.nn.Module):
    """A stage position's module: the whole model's parameters, those of other stages on the meta device."""

    def __init__(self, owned: dict[str, torch.Tensor], others: dict[str, torch.Tensor]):
        super().__init__()
        for name, tensor in {**owned, **{n: t.to("meta") for n, t in others.items()}}.items():
            self.register_parameter(name, torch.nn.Parameter(tensor.clone(), requires_grad=False))


@pytest.mark.parametrize("rank", [0, 1])
def test_the_export_gathers_stage_weights_one_tensor_at_a_time(monkeypatch, rank) -> None:
    """The export gathered each stage's whole state dict as one object onto rank 0 (gather_object): under NCCL every
    stage's weights were pickled into buffers on rank 0's GPU at once (pp × a stage: CUDA out of memory at the end
    of an 8B run). Only names, shapes and dtypes travel as objects; each tensor goes alone, from its stage to rank 0's
    CPU memory."""
    from open_sft.training import pipeline_state

    torch.manual_seed(0)
    stages = [{"embed": torch.randn(4, 3)}, {"mid": torch.randn(5).to(torch.bfloat16)},
              {"head": torch.randn(2, 3), "norm": torch.randn(3)}]
    whole = {name: t for stage in stages for name, t in stage.items()}
    dist, gathered, received, sent = torch.distributed, [], [], []

    def gather_object(obj, parts, dst, group):
        gathered.append(obj)
        if parts is not None:
            parts[:] = [{n: (tuple(t.shape), t.dtype) for n, t in stage.items()} for stage in stages]

    def recv(buffer, src, group):
        name = next(n for n in stages[src] if n not in {r[1] for r in received})
        received.append((src, name, tuple(buffer.shape), buffer.dtype))
        buffer.copy_(stages[src][name])

    for name, fake in {"get_rank": lambda: rank, "gather_object": gather_object, "get_backend": lambda group: "gloo",
                       "get_process_group_ranks": lambda group: [0, 1, 2], "recv": recv,
                       "send": lambda tensor, dst, group: sent.append((dst, tensor.clone()))}.items():
        monkeypatch.setattr(dist, name, fake)
    layout = SimpleNamespace(replica=0, size=3, pipe_group="pipe")
    model = _Stage(stages[rank], {n: t for n, t in whole.items() if n not in stages[rank]})
    result = pipeline_state.gather_state_dict(SimpleNamespace(layout=layout), model)
    assert gathered == [{n: (tuple(t.shape), t.dtype) for n, t in stages[rank].items()}]  # no tensor in an object
    if rank == 0:
        assert received == [(1, "mid", (5,), torch.bfloat16), (2, "head", (2, 3), torch.float32),
                            (2, "norm", (3,), torch.float32)]
        assert result.keys() == whole.keys() and all(torch.equal(result[n], whole[n]) for n in whole)
        assert all(t.device.type == "cpu" for t in result.values()) and sent == []
    else:
        assert result == {} and received == []
        assert [(dst, t.dtype) for dst, t in sent] == [(0, torch.bfloat16)] and torch.equal(sent[0][1], whole["mid"])
