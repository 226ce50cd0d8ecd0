"""The packed probe's measurement: a packed micro-batch against the padded batch's loss and gradients with the
attention the run really installs on this device (open_sft.run installs open_sft.model.packed_attention), and
positions that do not restart (so the check can fail); with a sliding window shorter than the examples (a Mistral
of the same shape), packed rows against each example alone (test_packed.py holds them to their tolerances)."""

from __future__ import annotations

import inspect
import random

import torch

from tests.gpu_check.measure import DEVICE, rel


def _examples(vocab: int, lengths: list[int], seed: int = 0):
    from open_sft.data.labels import IGNORE_INDEX, Example

    rng = random.Random(seed)
    out = []
    for n in lengths:
        ids = [rng.randrange(10, vocab) for _ in range(n)]
        out.append(Example(ids, [IGNORE_INDEX if i < n // 4 else t for i, t in enumerate(ids)]))
    return out


def _model_loss(model, batch: dict, bf16: bool):
    from open_sft.data.batching import COUNT_KEYS

    model.zero_grad(set_to_none=True)
    batch = {k: v.to(DEVICE) for k, v in batch.items() if k not in COUNT_KEYS}
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=bf16):
        loss = model(**batch)
    loss.backward()
    return float(loss), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _grad_error(grads: dict, reference: dict) -> float:
    return max(rel(grads[n], g) for n, g in reference.items() if float(g.norm()) > 0)


def measure(model_dir: str) -> dict:
    """Packed rows against the padded batch (fp32 and bf16, loss and gradients) with the attention the run
    installs on this device, the loss of positions that do not restart, and a sliding window (`_sliding_window`).
    What it installs (process-wide) is undone before it returns."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from open_sft.model import packed_attention

    causal_lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    sdpa, varlen_kernel = ALL_ATTENTION_FUNCTIONS["sdpa"], packed_attention.varlen_kernel
    try:
        result = _packed_against_padded(causal_lm)
        result["sliding_window"] = _sliding_window(causal_lm.config)
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"], packed_attention.varlen_kernel = sdpa, varlen_kernel
    return result


def _packed_against_padded(causal_lm) -> dict:
    from open_sft.data.batching import collate, collate_packed
    from open_sft.model import packed_attention
    from open_sft.model.loss import TokenLossModel

    model = TokenLossModel(causal_lm.to(DEVICE)).train()
    examples = _examples(causal_lm.config.vocab_size, [37, 300, 5, 180, 64, 511, 90, 12])
    padded = collate(examples, pad_token_id=0)
    packed = collate_packed(examples, pad_token_id=0, row_capacity=640)
    wrong = dict(packed)
    wrong["position_ids"] = torch.arange(packed["input_ids"].shape[1]).expand_as(packed["input_ids"]).clone()
    fp32_loss, fp32_grads = _model_loss(model, padded, bf16=False)  # padded, before anything is installed
    bf16_pad_loss, bf16_pad_grads = _model_loss(model, padded, bf16=True)
    calls = _count_varlen_calls(packed_attention)
    installed = packed_attention.install(causal_lm, varlen=DEVICE == "cuda")
    result: dict = {"installed": installed, "rows": list(packed["input_ids"].shape)}
    for name, bf16 in (("fp32", False), ("bf16", True)):
        before = calls[0]
        loss, grads = _model_loss(model, packed, bf16)
        result[name] = {"loss_rel_error": abs(loss - fp32_loss) / fp32_loss,
                        "grad_rel_error": _grad_error(grads, fp32_grads), "varlen_kernel_calls": calls[0] - before}
    result["attention"] = "varlen_flash (bf16)" if result["bf16"]["varlen_kernel_calls"] else "per_example_sdpa"
    result["bf16_padded"] = {"loss_rel_error": abs(bf16_pad_loss - fp32_loss) / fp32_loss,
                             "grad_rel_error": _grad_error(bf16_pad_grads, fp32_grads)}
    wrong_loss, _ = _model_loss(model, wrong, bf16=False)
    result["wrong_positions_loss_rel_change"] = abs(wrong_loss - fp32_loss) / fp32_loss
    return result


def _count_varlen_calls(packed_attention) -> list[int]:
    """A counter of the calls that reach torch's variable-length kernel (where there is one), put in place of
    packed_attention.varlen_kernel's answer."""
    kernel, calls = packed_attention.varlen_kernel(), [0]
    if kernel is not None:
        def counting(*args, **kwargs):
            calls[0] += 1
            return kernel(*args, **kwargs)

        counting.__signature__ = inspect.signature(kernel)
        packed_attention.varlen_kernel = lambda: counting
    return calls


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
    return result

