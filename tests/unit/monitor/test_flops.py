"""The two FLOP counts MFU is reported in, held to torch's own FLOP counter on real models: PaLM's count
(`mfu_palm`) is what a plain forward and backward computes; open_sft's strict count (`mfu`) is what its fused loss
computes with the varlen kernels' causal attention per example."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch.utils.flop_counter import FlopCounterMode

from open_sft.data.batching import collate, collate_packed, pop_counts
from open_sft.data.labels import IGNORE_INDEX, Example
from open_sft.model.anatomy import matmul_params, weight_numel
from open_sft.model.loss import TokenLossModel
from open_sft.monitor.metrics import FlopCounter, attention_width

SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=96, vocab_size=300)


def _model(config_class, **extra):
    torch.manual_seed(0)
    config = config_class(**{**SHAPE, **extra})
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager"), config


def _addmm_inplace(self_shape, a_shape, b_shape, out_shape=None, **kwargs) -> int:
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]  # the fused loss's weight gradient; torch counts addmm only


def _measured(model, batch: dict) -> int:
    """FLOPs torch counts in one forward and backward of `model` on `batch` (eager attention: full scores)."""
    with FlopCounterMode(display=False, custom_mapping={torch.ops.aten.addmm_: _addmm_inplace}) as counter:
        out = model(**batch)
        (out if isinstance(out, torch.Tensor) else out.loss).backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("config_class, extra", [
    (transformers.LlamaConfig, {"tie_word_embeddings": False}),
    (transformers.LlamaConfig, {"tie_word_embeddings": True}),  # a tied head's matmul counts as well
    (transformers.Qwen3Config, {"head_dim": 32}),  # heads × head size (128) is not the hidden size (64)
    # Gemma 4: a head size per layer (transformers 5's per_layer_config; reading config.head_dim raises), its
    # full-attention layer's twice its sliding layer's, and per-layer input embeddings
    (transformers.Gemma4TextConfig, {"head_dim": 16, "layer_types": ["sliding_attention", "full_attention"],
                                     "per_layer_config": {1: {"head_dim": 32}}, "sliding_window": 64,
                                     "vocab_size_per_layer_input": 300, "hidden_size_per_layer_input": 8}),
    # multi-head latent attention: scores 32 wide per head (qk_nope 24 + qk_rope 8), values 16; head_dim is 8
    # (DeepSeek-V3's layers dense here: torch counts no FLOPs in the experts' grouped matmul)
    (transformers.DeepseekV3Config, {"kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8,
                                     "qk_nope_head_dim": 24, "v_head_dim": 16, "first_k_dense_replace": 2,
                                     "num_key_value_heads": 4}),
    (transformers.MiniCPM3Config, {"kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8,
                                   "qk_nope_head_dim": 24, "v_head_dim": 16, "num_key_value_heads": 4}),
])
def test_palm_count_is_what_a_forward_and_backward_computes(config_class, extra) -> None:
    model, config = _model(config_class, **extra)
    tokens = 37
    ids = torch.randint(0, SHAPE["vocab_size"], (1, tokens))
    counter = FlopCounter(config, *matmul_params(model))
    assert counter.palm_flops(tokens, tokens**2) == _measured(model, {"input_ids": ids, "labels": ids})


def test_attention_width_of_a_config_with_a_head_size_per_layer() -> None:
    config = transformers.Gemma4TextConfig(**SHAPE, head_dim=16, layer_types=["sliding_attention", "full_attention"],
                                           per_layer_config={1: {"head_dim": 32}})
    assert attention_width(config) == (4 * 16 + 4 * 32) / 2


def test_palm_count_of_two_rows_sums_each_rows_square() -> None:
    """Two padded rows of 30 and 11 tokens: each token attends its own row's length (the padding is left out)."""
    model, config = _model(transformers.LlamaConfig)
    examples = [Example(list(range(10, 10 + n)), list(range(10, 10 + n))) for n in (30, 11)]
    batch = collate(examples, pad_token_id=0)
    lengths, rows = pop_counts(batch)
    assert rows.tolist() == [30, 11] and lengths.tolist() == [30, 11]
    counter = FlopCounter(config, *matmul_params(model))
    one_by_one = sum(_measured(model, {"input_ids": torch.tensor([e.input_ids]), "labels": torch.tensor([e.labels])})
                     for e in examples)
    assert counter.palm_flops(41, int((rows**2).sum())) == one_by_one


def test_strict_count_is_what_the_fused_loss_and_per_example_causal_attention_compute() -> None:
    """A packed row of two examples with half their tokens trained, through open_sft's loss model: torch counts the
    LM head on the trained positions only (the fused loss) and, with eager attention, the whole row's scores; the
    strict count's attention is each example's causal half (what the varlen kernels compute)."""
    model, config = _model(transformers.LlamaConfig, tie_word_embeddings=True)
    examples = [Example(list(range(10, 10 + n)), [IGNORE_INDEX] * (n // 2) + list(range(10 + n // 2, 10 + n)))
                for n in (20, 13)]
    batch = collate_packed(examples, pad_token_id=0, row_capacity=64)
    lengths, rows = pop_counts(batch)
    assert rows.tolist() == [33] and sorted(lengths.tolist()) == [13, 20]
    trained = int((batch["labels"] != IGNORE_INDEX).sum())
    assert trained == 17
    counter = FlopCounter(config, *matmul_params(model))
    squares, row_squares = int((lengths**2).sum()), int((rows**2).sum())
    attention = 12 * config.num_hidden_layers * attention_width(config)
    eager_extra = attention * row_squares - attention * squares / 2  # the whole row's scores, not each causal half
    assert counter.step_flops(33, trained, squares) + eager_extra == _measured(TokenLossModel(model), batch)
    # the PaLM count is the larger: the head on every token, attention over the whole row, both directions
    assert counter.palm_flops(33, row_squares) > counter.step_flops(33, trained, squares)


def test_a_4bit_weight_counts_the_layer_it_stands_for() -> None:
    """bitsandbytes keeps a 4-bit weight as [n / 2, 1] bytes; its FLOPs are those of the layer's [out, in]."""
    import bitsandbytes as bnb

    layer = bnb.nn.Linear4bit(64, 128, bias=False, quant_type="nf4").to("cpu")
    assert layer.weight.numel() == 64 * 128 // 2
    assert weight_numel(layer.weight) == 64 * 128


@pytest.mark.parametrize("tied", [False, True])
def test_counts_of_a_lora_model_with_trainable_token_rows_under_zero3_partitioning(tied) -> None:
    """Added tokens under LoRA: peft wraps the embedding (and an untied head) in its trainable-tokens wrapper, whose
    `.weight` merges the trained rows into the base. Under ZeRO-3 the base is an empty partition (its shape in
    ds_shape) and that merge failed before step 1; the counts are the plain model's, read from the base layers."""
    from peft import LoraConfig, get_peft_model

    model, _ = _model(transformers.LlamaConfig, tie_word_embeddings=tied)
    expected = matmul_params(model)
    rows = {"embed_tokens": [297, 298, 299]} | ({} if tied else {"lm_head": [297, 298, 299]})
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], trainable_token_indices=rows))
    backbone, head = matmul_params(peft_model)
    assert head == expected[1] and backbone == expected[0] + sum(
        p.numel() for n, p in peft_model.named_parameters() if "lora_" in n)
    for param in peft_model.parameters():  # what ZeRO-3's partitioning leaves on a rank: an empty tensor
        param.ds_shape, param.ds_numel = param.shape, param.numel()
        param.data = torch.empty(0, dtype=param.dtype)
    assert matmul_params(peft_model) == (backbone, head)


MOE = {  # each family's expert and top-k fields, as its config names them
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "mlp_only_layers": []},
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,  # + a shared expert
                  "shared_expert_intermediate_size": 48, "mlp_only_layers": []},
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16},  # experts' biases: no matmul
    "granitemoe": {"num_local_experts": 4, "num_experts_per_tok": 2},
}


@pytest.mark.parametrize("family", sorted(MOE))
def test_an_moe_counts_the_experts_each_token_is_routed_to(family) -> None:
    """Of an MoE's routed experts a token runs top-k (Qwen3-30B-A3B: 8 of 128, 2.7B of its 29.9B decoder matmul
    weights): torch counts, with transformers' eager experts (each expert's matmuls on the tokens routed to it),
    exactly the PaLM count, the router and a shared expert on every token."""
    config = transformers.AutoConfig.for_model(family, **SHAPE, **MOE[family])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                          experts_implementation="eager").train()
    tokens = 37
    ids = torch.randint(0, SHAPE["vocab_size"], (1, tokens))
    backbone, head = matmul_params(model)
    every_expert = sum(p.numel() for n, p in model.named_parameters() if p.dim() >= 2 and not n.endswith("bias")
                       and p is not model.get_output_embeddings().weight and "embed" not in n)
    assert backbone < every_expert  # half the experts (2 of 4) left out
    counter = FlopCounter(config, backbone, head)
    assert counter.palm_flops(tokens, tokens**2) == _measured(model, {"input_ids": ids, "labels": ids,
                                                                       "use_cache": False})


@pytest.mark.parametrize("family, fields, expected", [
    ("llama", {}, None),
    ("qwen3_moe", {"num_experts": 128, "num_experts_per_tok": 8}, (8, 128)),
    ("deepseek_v3", {"n_routed_experts": 256, "num_experts_per_tok": 8}, (8, 256)),
    ("ernie4_5_moe", {"moe_num_experts": 64, "moe_k": 6}, (6, 64)),
    ("hunyuan_v1_moe", {"num_experts": 16, "moe_topk": 2}, (2, 16)),
    ("dbrx", {"ffn_config": {"moe_num_experts": 16, "moe_top_k": 4}}, (4, 16)),
])
def test_each_families_expert_fields_are_read(family, fields, expected) -> None:
    from open_sft.model.anatomy import active_experts

    assert active_experts(transformers.AutoConfig.for_model(family, **fields)) == expected


@pytest.mark.parametrize("family, sizes", [
    ("mamba", {"state_size": 8}),
    ("mamba2", {"num_heads": 8, "head_dim": 16, "state_size": 8, "n_groups": 1, "chunk_size": 8}),
    ("rwkv", {"context_length": 64, "attention_hidden_size": 64}),
    ("xlstm", {"embedding_dim": 64, "num_heads": 4, "num_blocks": 2, "qk_dim_factor": 0.5, "v_dim_factor": 1.0}),
])
def test_a_model_without_attention_heads_counts_its_matmuls_alone(family, sizes) -> None:
    """Mamba's, Mamba-2's, RWKV's and xLSTM's configs name no attention heads (Mamba-2's num_heads are its SSM's):
    every run of them stopped at start with a TypeError from the MFU count's attention width (found by a family
    sweep). They have no attention scores to count: PaLM's count is 6 × the matmul weights per token."""
    config = transformers.AutoConfig.for_model(family, vocab_size=96, hidden_size=64, num_hidden_layers=2, **sizes)
    assert getattr(config, "num_attention_heads", None) is None
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    backbone, head = matmul_params(model)
    counter = FlopCounter(config, backbone, head)
    assert attention_width(config) == 0 and counter.attention == 0
    assert counter.palm_flops(37, 37**2) == 6 * (backbone + head) * 37
    assert counter.step_flops(37, 30, 37**2) == 6 * backbone * 37 + 6 * head * 30
