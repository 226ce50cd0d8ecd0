"""The attention probe's measurement: the candidates for packed rows on this device (sdpa with the block-diagonal
mask transformers gives it, per-example sdpa, torch's variable-length flash attention, flex_attention with a
document mask), each timed, checked against an fp32 per-example reference and for cross-example attention
(test_attention.py holds them to their tolerances)."""

from __future__ import annotations

import random
from typing import Callable

import torch
import torch.nn.functional as F

from tests.gpu_check.measure import DEVICE, rel, timed


def _packed_lengths(rows: int, width: int, seed: int = 0) -> list[int]:
    """Example lengths of alpaca-like rows (40-700 tokens at a width of 4,096, in proportion at others) packed into
    `rows` rows of `width`, each row's rest a padding block of its own, as collate_packed lays them out."""
    rng = random.Random(seed)
    lengths = []
    for _ in range(rows):
        used = 0
        while True:
            n = rng.randint(max(1, width * 40 // 4096), width * 700 // 4096)
            if used + n > width:
                break
            lengths.append(n)
            used += n
        if width > used:
            lengths.append(width - used)
    return lengths


def _candidates() -> dict[str, Callable]:
    from open_sft.model import packed_attention

    def mask_sdpa(q, k, v, lengths):
        segment = torch.repeat_interleave(torch.arange(len(lengths), device=q.device),
                                          torch.tensor(lengths, device=q.device)).view(q.shape[0], -1)
        causal = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool, device=q.device).tril()
        mask = (segment[:, :, None] == segment[:, None, :]) & causal
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=True).transpose(1, 2)

    def per_example(q, k, v, lengths):
        outs = []
        flat = [t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3]) for t in (q, k, v)]
        for a, b, c in zip(*(t.split(lengths) for t in flat)):
            outs.append(F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (a, b, c)),
                                                       is_causal=True, enable_gqa=True)[0].transpose(0, 1))
        return torch.cat(outs).view(q.shape[0], q.shape[2], q.shape[1], q.shape[3])

    found = {"sdpa_block_mask": mask_sdpa, "per_example_sdpa": per_example}
    kernel = packed_attention.varlen_kernel()
    if kernel is not None and DEVICE == "cuda":
        found["varlen_flash"] = lambda q, k, v, lengths: packed_attention._varlen_call(kernel, q, k, v, lengths, None)
    if DEVICE == "cuda":
        found["flex_attention"] = _flex_candidate()
    return found


def _flex_candidate() -> Callable:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention)

    def flex(q, k, v, lengths):
        doc = torch.repeat_interleave(torch.arange(len(lengths), device=q.device),
                                      torch.tensor(lengths, device=q.device)).view(q.shape[0], -1)

        def document_causal(b, h, qi, ki):
            return (doc[b, qi] == doc[b, ki]) & (qi >= ki)

        block = create_block_mask(document_causal, q.shape[0], None, q.shape[2], q.shape[2], device=q.device)
        return compiled(q, k, v, block_mask=block, enable_gqa=True).transpose(1, 2)

    return flex


def measure(smoke: bool) -> dict:
    """Each candidate's forward + backward time, its relative error to the fp32 per-example result, and how far
    changing the keys of one example moved any other example's output; a candidate that cannot run here is
    reported with its error."""
    batch, heads, kv_heads, dim, width = (2, 4, 2, 16, 256) if smoke else (4, 32, 8, 64, 4096)
    lengths = _packed_lengths(batch, width)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(batch, h, width, dim, generator=g).to(DEVICE, dtype) for h in (heads, kv_heads, kv_heads))
    candidates = _candidates()
    reference = candidates["per_example_sdpa"](q.float(), k.float(), v.float(), lengths)
    moved = k.clone()
    moved[0, :, : lengths[0]] += 1.0  # the keys of row 0's first example
    result: dict = {"shape": {"batch": batch, "heads": heads, "kv_heads": kv_heads, "head_dim": dim, "row": width,
                              "examples": len(lengths), "dtype": str(dtype).replace("torch.", "")}}
    for name, fn in candidates.items():
        try:
            out = fn(q, k, v, lengths)
            other = fn(q, moved, v, lengths)
            # every output but those of the example whose keys moved: [batch, row, heads, dim]
            leak = float((other.reshape(-1, heads, dim)[lengths[0]:] - out.reshape(-1, heads, dim)[lengths[0]:])
                         .abs().max())
            grads_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]

            def step():
                fn(*grads_in, lengths).float().pow(2).sum().backward()

            seconds = timed(step, 3 if smoke else 10)
            result[name] = {"ms_forward_backward": seconds * 1e3, "rel_error": rel(out, reference),
                            "cross_example_change": leak}
        except Exception as exc:  # a candidate this torch cannot run is reported, not fatal
            result[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return result

