#!/usr/bin/env python
"""In-process probes of scripts/gpu_check.py, one per invocation, each printing one JSON object last:

    python scripts/gpu_probes.py fused_ce  [--smoke]
    python scripts/gpu_probes.py packed    --model DIR
    python scripts/gpu_probes.py attention [--smoke]

- fused_ce: the chunked LM-head loss (open_sft.model.fused_ce) against plain cross-entropy and a float64
  reference, fp32 and bf16 autocast, loss and gradients; the time and peak memory of each path.
- packed: a packed micro-batch gives the padded batch's loss and gradients with the attention the run really
  installs on this device (open_sft.run installs open_sft.model.packed_attention), and positions that do not
  restart do not (so the check can fail); with a sliding window shorter than the examples (a Mistral of the
  same shape), packed rows give each example's own loss.
- attention: the candidates for packed rows on this device (sdpa with the block-diagonal mask transformers
  gives it, per-example sdpa, torch's variable-length flash attention, flex_attention with a document mask):
  time of forward + backward, error against a float64 per-example reference, and whether changing one
  example's keys and values moves any other example's output (it must not, bit for bit).
"""

from __future__ import annotations

import argparse
import inspect
import json
import random
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], repeat: int) -> float:
    """Median seconds of `repeat` calls after one warm-up."""
    fn()
    times = []
    for _ in range(repeat):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


# ------------------------------------------------------------------------------------------------------------
# fused_ce
# ------------------------------------------------------------------------------------------------------------
def _head_problem(n: int, d: int, v: int):
    g = torch.Generator(device="cpu").manual_seed(0)
    hidden = (torch.randn(n, d, generator=g) * 1.0).to(DEVICE).requires_grad_()
    weight = torch.nn.Parameter((torch.randn(v, d, generator=g) / d ** 0.5).to(DEVICE))  # an LM head's, below
    targets = torch.randint(0, v, (n,), generator=g).to(DEVICE)
    return hidden, weight, targets


def _loss_and_grads(fn, hidden, weight, bf16: bool):
    hidden.grad = weight.grad = None
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=bf16):
        loss = fn()
    loss.backward()
    return loss.detach(), hidden.grad.clone(), weight.grad.clone()


def probe_fused_ce(smoke: bool) -> dict:
    from open_sft.model.fused_ce import linear_cross_entropy_sum
    from open_sft.model.liger_loss import liger_loss_sum
    from open_sft.model.logits import LogitTransform

    n, d, v = (512, 64, 3000) if smoke else (16384, 2048, 50304)
    hidden, weight, targets = _head_problem(n, d, v)
    reference = F.cross_entropy(hidden.double() @ weight.double().t(), targets, reduction="sum")
    ref_value = float(reference.detach())
    ref_grads = torch.autograd.grad(reference, (hidden, weight))
    fused = lambda: linear_cross_entropy_sum(hidden, weight, None, targets)  # noqa: E731
    plain = lambda: F.cross_entropy(F.linear(hidden, weight).float(), targets, reduction="sum")  # noqa: E731
    result: dict = {"shape": {"rows": n, "hidden": d, "vocab": v}}
    candidates = [("fused", fused), ("plain", plain)]
    liger = _liger_head(weight)
    if liger is not None:  # --use_liger_kernel's loss: Liger's kernel through open_sft's mapping
        candidates.append(("liger", lambda: liger_loss_sum(liger, hidden, targets, LogitTransform())))
    for dtype, bf16 in (("fp32", False), ("bf16", True)):
        errors = {}
        for name, fn in candidates:
            loss, gh, gw = _loss_and_grads(fn, hidden, weight, bf16)
            errors[name] = {"loss": abs(float(loss) - ref_value) / abs(ref_value),
                            "grad_hidden": rel(gh, ref_grads[0]), "grad_weight": rel(gw, ref_grads[1])}
            if DEVICE == "cuda":
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            seconds = timed(lambda: _loss_and_grads(fn, hidden, weight, bf16), 1 if smoke else 5)
            errors[name]["seconds"] = seconds
            if DEVICE == "cuda":
                errors[name]["peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
        result[dtype] = errors
    # fp32: each to fp32 rounding of the float64 reference; bf16: the fused loss (and Liger's) no further from it
    # than the plain bf16 path (twice its error, plus bf16's own rounding as a floor).
    fp32_ok = all(max(e["loss"], e["grad_hidden"], e["grad_weight"]) < 1e-4 for e in result["fp32"].values())
    bf16 = result["bf16"]
    bf16_ok = all(bf16[name][k] <= 2 * bf16["plain"][k] + 4e-3
                  for name in bf16 for k in ("loss", "grad_hidden", "grad_weight"))
    transformed_ok = True
    if liger is not None:  # a cap and a scale (Gemma-2's, Cohere's): Liger's softcap and the folded scale
        transform = LogitTransform(scale=0.25, softcap=2.0)
        capped = {}
        for name, fn in (("fused", lambda: linear_cross_entropy_sum(hidden, weight, None, targets, transform=transform)),
                         ("liger", lambda: liger_loss_sum(liger, hidden, targets, transform))):
            capped[name] = _loss_and_grads(fn, hidden, weight, bf16=False)
        result["capped_fp32_liger_vs_fused"] = {k: rel(a, b) for k, a, b in
                                                zip(("loss", "grad_hidden", "grad_weight"), capped["liger"], capped["fused"])}
        transformed_ok = max(result["capped_fp32_liger_vs_fused"].values()) < 1e-4
    result["liger"] = "measured" if liger is not None else "not installed or no CUDA"
    result["tolerance"] = ("fp32: relative error < 1e-4; bf16: each candidate's error <= 2 x plain bf16 error + 4e-3; "
                           "Liger with a cap and a scale within 1e-4 of the fused loss (fp32)")
    result["pass"] = bool(fp32_ok and bf16_ok and transformed_ok)
    return result


def _liger_head(weight: torch.nn.Parameter):
    """An LM head holding `weight`, when Liger's kernel can run here."""
    if DEVICE != "cuda":
        return None
    try:
        from open_sft.model.liger_loss import kernel

        kernel()
    except ImportError:
        return None
    head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=DEVICE)
    head.weight = weight
    return head


# ------------------------------------------------------------------------------------------------------------
# packed
# ------------------------------------------------------------------------------------------------------------
def _examples(vocab: int, lengths: list[int], seed: int = 0):
    from open_sft.data.labels import IGNORE_INDEX, Example

    rng = random.Random(seed)
    out = []
    for n in lengths:
        ids = [rng.randrange(10, vocab) for _ in range(n)]
        out.append(Example(ids, [IGNORE_INDEX if i < n // 4 else t for i, t in enumerate(ids)]))
    return out


def _model_loss(model, batch: dict, bf16: bool):
    model.zero_grad(set_to_none=True)
    batch = {k: v.to(DEVICE) for k, v in batch.items() if k != "lengths"}
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=bf16):
        loss = model(**batch)
    loss.backward()
    return float(loss), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _grad_error(grads: dict, reference: dict) -> float:
    return max(rel(grads[n], g) for n, g in reference.items() if float(g.norm()) > 0)


def probe_packed(model_dir: str) -> dict:
    from transformers import AutoModelForCausalLM

    from open_sft.data.batching import collate, collate_packed
    from open_sft.model import packed_attention
    from open_sft.model.loss import TokenLossModel

    causal_lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model = TokenLossModel(causal_lm.to(DEVICE)).train()
    examples = _examples(causal_lm.config.vocab_size, [37, 300, 5, 180, 64, 511, 90, 12])
    padded = collate(examples, pad_token_id=0)
    packed = collate_packed(examples, pad_token_id=0, row_capacity=640)
    wrong = dict(packed)
    wrong["position_ids"] = torch.arange(packed["input_ids"].shape[1]).expand_as(packed["input_ids"]).clone()
    fp32_loss, fp32_grads = _model_loss(model, padded, bf16=False)  # padded, before anything is installed
    bf16_pad_loss, bf16_pad_grads = _model_loss(model, padded, bf16=True)
    kernel, calls = packed_attention.varlen_kernel(), [0]
    if kernel is not None:  # count the calls that reach torch's variable-length kernel
        def counting(*args, **kwargs):
            calls[0] += 1
            return kernel(*args, **kwargs)

        counting.__signature__ = inspect.signature(kernel)
        packed_attention.varlen_kernel = lambda: counting
    installed = packed_attention.install(causal_lm, varlen=DEVICE == "cuda")
    result: dict = {"installed": installed, "rows": list(packed["input_ids"].shape)}
    for name, bf16, ref_loss, ref_grads in (("fp32", False, fp32_loss, fp32_grads),
                                            ("bf16", True, fp32_loss, fp32_grads)):
        before = calls[0]
        loss, grads = _model_loss(model, packed, bf16)
        result[name] = {"loss_rel_error": abs(loss - ref_loss) / ref_loss, "grad_rel_error": _grad_error(grads, ref_grads),
                        "varlen_kernel_calls": calls[0] - before}
    result["attention"] = "varlen_flash (bf16)" if result["bf16"]["varlen_kernel_calls"] else "per_example_sdpa"
    result["bf16_padded"] = {"loss_rel_error": abs(bf16_pad_loss - fp32_loss) / fp32_loss,
                             "grad_rel_error": _grad_error(bf16_pad_grads, fp32_grads)}
    wrong_loss, _ = _model_loss(model, wrong, bf16=False)
    result["wrong_positions_loss_rel_change"] = abs(wrong_loss - fp32_loss) / fp32_loss
    pad = result["bf16_padded"]
    result["sliding_window"] = _sliding_window(causal_lm.config)
    result["tolerance"] = ("fp32 packed vs padded: loss < 1e-5, gradients < 1e-4 relative; bf16 packed no further "
                           "from fp32 than bf16 padded is (2x + 1e-3); positions that do not restart move the loss "
                           "> 1e-4; a sliding window shorter than the examples: packed = each example alone (fp32 "
                           "1e-5 / 1e-4, bf16 within 2e-2) and the window moves the loss > 1e-4")
    result["pass"] = bool(result["fp32"]["loss_rel_error"] < 1e-5 and result["fp32"]["grad_rel_error"] < 1e-4
                          and result["bf16"]["loss_rel_error"] <= 2 * pad["loss_rel_error"] + 1e-3
                          and result["bf16"]["grad_rel_error"] <= 2 * pad["grad_rel_error"] + 1e-3
                          and result["wrong_positions_loss_rel_change"] > 1e-4 and result["sliding_window"]["pass"])
    return result


def _sliding_window(config, window: int = 64) -> dict:
    """A Mistral of the packed model's shape with a sliding window shorter than most examples, its packed rows
    through the attention installed above (a window takes per-example calls with a banded mask, on GPU too),
    against each example alone through the model's own masked attention."""
    from transformers import MistralConfig, MistralForCausalLM

    from open_sft.data.batching import collate, collate_packed
    from open_sft.model.loss import TokenLossModel

    def mistral(sliding_window):
        torch.manual_seed(0)
        return TokenLossModel(MistralForCausalLM(MistralConfig(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
            num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.num_key_value_heads, sliding_window=sliding_window,
            attn_implementation="sdpa")).to(DEVICE)).train()

    examples = _examples(config.vocab_size, [37, 300, 5, 180, 130], seed=1)
    packed = collate_packed(examples, pad_token_id=0, row_capacity=400)

    def alone(model, bf16):
        total, grads = 0.0, {}
        for example in examples:
            loss, g = _model_loss(model, collate([example], pad_token_id=0), bf16)
            total += loss
            grads = {n: grads.get(n, 0) + t for n, t in g.items()}
        return total, grads

    model = mistral(window)
    ref_loss, ref_grads = alone(model, bf16=False)
    result = {"window": window, "lengths": [len(e.input_ids) for e in examples]}
    for name, bf16 in (("fp32", False), ("bf16", True)):
        loss, grads = _model_loss(model, packed, bf16)
        result[name] = {"loss_rel_error": abs(loss - ref_loss) / ref_loss, "grad_rel_error": _grad_error(grads, ref_grads)}
    full_loss, _ = alone(mistral(None), bf16=False)
    result["window_moves_loss"] = abs(full_loss - ref_loss) / ref_loss
    result["pass"] = bool(result["fp32"]["loss_rel_error"] < 1e-5 and result["fp32"]["grad_rel_error"] < 1e-4
                          and result["bf16"]["loss_rel_error"] < 2e-2 and result["window_moves_loss"] > 1e-4)
    return result


# ------------------------------------------------------------------------------------------------------------
# attention candidates
# ------------------------------------------------------------------------------------------------------------
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


def probe_attention(smoke: bool) -> dict:
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
    ok = {n: r for n, r in result.items() if isinstance(r, dict) and "ms_forward_backward" in r
          and r["cross_example_change"] == 0.0 and r["rel_error"] < 2e-2}
    result["fastest_correct"] = min(ok, key=lambda n: ok[n]["ms_forward_backward"]) if ok else None
    result["tolerance"] = "relative error < 2e-2 of the fp32 per-example result; other examples' outputs unchanged"
    result["pass"] = result["fastest_correct"] is not None and all(
        r.get("cross_example_change", 0.0) == 0.0 for r in result.values() if isinstance(r, dict))
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("probe", choices=["fused_ce", "packed", "attention"])
    parser.add_argument("--model", help="model directory (packed)")
    parser.add_argument("--smoke", action="store_true", help="CPU-sized shapes")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.probe == "fused_ce":
        result = probe_fused_ce(args.smoke)
    elif args.probe == "packed":
        result = probe_packed(args.model)
    else:
        result = probe_attention(args.smoke)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
