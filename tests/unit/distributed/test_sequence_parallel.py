"""The data side of --sequence_parallel_size: micro-batches shaped for Ulysses, the packed-example mask its
sdpa path needs, and the refusals (the training itself is tested on real ranks in tests/integration)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from open_sft.config.parse import parse_config
from open_sft.distributed.sequence_parallel import _document_mask, fit_for_ulysses, sequence_parallel_problems
from open_sft.training.steps import balances


def config(*flags: str):
    return parse_config(["--model_name_or_path", "m", "--dataset_mixer_list", "d.jsonl", "1.0", *flags])


def test_padded_micro_batch_gets_fixed_rows_and_a_divisible_length() -> None:
    batch = {"input_ids": torch.tensor([[5, 6, 7], [8, 9, 0]]), "labels": torch.tensor([[-100, 6, 7], [-100, 9, -100]]),
             "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]), "sources": torch.tensor([[1, 1, 1], [0, 0, 0]]),
             "lengths": torch.tensor([3, 2]), "row_lengths": torch.tensor([3, 2])}
    out = fit_for_ulysses(batch, size=2, rows=3, pad_token_id=0, width=5)
    # no mask: right padding
    assert set(out) == {"input_ids", "labels", "sources", "position_ids", "lengths", "row_lengths"}
    assert out["lengths"].tolist() == out["row_lengths"].tolist() == [3, 2]  # counts: passed through, not padded
    assert out["input_ids"].tolist() == [[5, 6, 7, 0, 0, 0], [8, 9, 0, 0, 0, 0], [0] * 6]  # 5 → 6, divisible by 2
    assert out["labels"].tolist() == [[-100, 6, 7, -100, -100, -100], [-100, 9, -100, -100, -100, -100], [-100] * 6]
    assert out["position_ids"].tolist() == [list(range(6))] * 3


def test_packed_row_keeps_its_restarting_positions() -> None:
    batch = {"input_ids": torch.tensor([[1, 2, 3, 4, 5]]), "labels": torch.tensor([[-100, 2, 3, -100, 5]]),
             "position_ids": torch.tensor([[0, 1, 2, 0, 1]]), "sources": torch.zeros(1, 5, dtype=torch.long)}
    out = fit_for_ulysses(batch, size=4, rows=1, pad_token_id=0)
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1, 5, 6, 7]]  # the padding continues: after every token


def test_document_mask_is_block_diagonal_and_causal() -> None:
    mask = _document_mask(torch.tensor([[0, 1, 2, 0, 1]]), 5)
    expected = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]])
    assert mask.shape == (1, 1, 5, 5) and mask[0, 0].int().tolist() == expected.tolist()
    assert _document_mask(torch.tensor([[0, 1, 2, 3]]), 4) is None  # one example: sdpa's is_causal path
    # With it, sdpa over the packed row equals attending each example on its own.
    q, k, v = (torch.randn(1, 2, 5, 4, generator=torch.Generator().manual_seed(s)) for s in (1, 2, 3))
    packed = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    first = F.scaled_dot_product_attention(q[..., :3, :], k[..., :3, :], v[..., :3, :], is_causal=True)
    second = F.scaled_dot_product_attention(q[..., 3:, :], k[..., 3:, :], v[..., 3:, :], is_causal=True)
    assert torch.allclose(packed, torch.cat([first, second], dim=2), atol=1e-6)


def test_what_sequence_parallelism_cannot_do_is_refused() -> None:
    model = SimpleNamespace(num_attention_heads=4)
    assert sequence_parallel_problems(1, 3, False, config("--use_qlora"), model, "eager") == []
    problems = " | ".join(sequence_parallel_problems(
        3, 4, False, config("--use_qlora", "--loss_normalization", "mean"), model, "eager"))
    for expected in ("runs on DeepSpeed Ulysses", "must divide the number of processes (4)", "--use_qlora",
                     "needs sdpa or flash_attention_2", "attention heads (4)", "--loss_normalization mean"):
        assert expected in problems, (expected, problems)
    assert sequence_parallel_problems(2, 4, True, config(), model, "sdpa") == []
    assert "--balance_micro_batches" in sequence_parallel_problems(
        2, 4, True, config("--balance_micro_batches", "true"), model, "sdpa")[0]
    assert sequence_parallel_problems(2, 4, True, config("--balance_micro_batches", "true", "--packing"), model,
                                      "sdpa") == []


def test_key_value_heads_must_divide_or_be_divided_by_the_size() -> None:
    """DeepSpeed's Ulysses needs kv % sp == 0 or sp % kv == 0, else a ValueError from prepare after the model
    loaded (Qwen2.5-7B: 28 heads, 4 key/value heads, under sp 7; Qwen2.5-14B: 40 and 8 under sp 5)."""
    qwen7b = SimpleNamespace(num_attention_heads=28, num_key_value_heads=4)
    assert sequence_parallel_problems(7, 7, True, config(), qwen7b, "sdpa") == [
        "--sequence_parallel_size 7 and the model's key/value heads (4): one must divide the other (each rank attends "
        "with 1/N of the heads, DeepSpeed Ulysses splits or repeats the key/value ones)"]
    qwen14b = SimpleNamespace(num_attention_heads=40, num_key_value_heads=8)
    assert len(sequence_parallel_problems(5, 5, True, config(), qwen14b, "sdpa")) == 1
    assert sequence_parallel_problems(2, 2, True, config(), qwen7b, "sdpa") == []  # 4 split over 2
    assert sequence_parallel_problems(4, 4, True, config(), qwen7b, "sdpa") == []  # 1 each
    assert sequence_parallel_problems(4, 4, True, config(), qwen14b, "sdpa") == []  # 2 each
    assert sequence_parallel_problems(8, 8, True, config(), SimpleNamespace(num_attention_heads=32,
                                                                             num_key_value_heads=2), "sdpa") == []


def test_balancing_is_off_for_padded_sequence_parallel_runs_by_default() -> None:
    assert balances(config("--sequence_parallel_size", "2").train) is False
    assert balances(config("--sequence_parallel_size", "2", "--packing").train) is True
    assert balances(config().train) is True


def test_ulysses_reads_a_head_width_from_a_config_holding_head_dim_none() -> None:
    """DeepSpeed's Ulysses registration takes `getattr(text_config, "head_dim", hidden // heads)`: Mixtral's config
    holds head_dim None, so every rank of `--sequence_parallel_size 2` on Mixtral crashed in torch.Size. It reads a
    copy stating the width the model computes with (hidden // heads); the model's own config is left as it was (an
    export writes it unchanged), and a config that states its width is passed as it is."""
    from transformers import LlamaConfig, MixtralConfig

    from open_sft.distributed.sequence_parallel import ulysses_config

    mixtral = MixtralConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=None)
    seen = ulysses_config(mixtral).get_text_config()
    assert getattr(seen, "head_dim", seen.hidden_size // seen.num_attention_heads) == 16  # DeepSpeed's expression
    assert mixtral.head_dim is None
    llama = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=32)
    assert ulysses_config(llama) is llama
