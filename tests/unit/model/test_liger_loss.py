"""--use_liger_kernel routes the LM-head loss through Liger's fused linear cross-entropy where it computes our
loss, with each family's cap and scale mapped onto Liger's arguments.

Liger's kernel is Triton and runs on CUDA only: here a reference of its documented semantics (logits = input @
weightᵀ + bias in the operands' dtype, capped by `softcap`, cross-entropy summed over targets other than
ignore_index, gradients accumulated in `accum_dtype`) stands in for it, so what is tested is open_sft's mapping
— the same families' losses and gradients as the model's own. tests/gpu_check/test_fused_ce.py holds the
real kernel to the same reference on a GPU (issue 31's device check)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from open_sft.model import liger_loss
from open_sft.model.loss import TokenLossModel
from tests.unit.model.test_logits import batch, their_loss_and_grads, tiny

calls: list[dict] = []


def reference_kernel(input, weight, target, bias=None, ignore_index=-100, reduction="mean", softcap=None,
                     accum_dtype=None, **rest):
    calls.append({"dtypes": (input.dtype, weight.dtype), "reduction": reduction, "softcap": softcap,
                  "accum_dtype": accum_dtype, "autocast": torch.is_autocast_enabled(input.device.type),
                  "ignore_index": ignore_index, "rest": rest})
    logits = F.linear(input, weight, bias).float()
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)


@pytest.fixture
def liger_here(monkeypatch):
    monkeypatch.setattr(liger_loss, "kernel", lambda: reference_kernel)
    monkeypatch.setattr(liger_loss, "on_cuda", lambda t: True)
    calls.clear()


def liger_loss_and_grads(model, ids, labels):
    wrapped = TokenLossModel(model, liger=True).train()
    wrapped.keep_token_losses = False  # one source: no per-position losses
    model.zero_grad(set_to_none=True)
    loss = wrapped(input_ids=ids, labels=labels) / int((labels[:, 1:] != -100).sum())
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["llama", "gemma2", "granite", "cohere", "phi"])
def test_liger_path_trains_the_models_own_loss(family, liger_here) -> None:
    """Gemma-2's cap goes in as Liger's softcap, Granite's and Cohere's scale into the hidden states (and Phi's
    LM-head bias): loss and every gradient equal the model's own."""
    model = tiny(family)
    ids, labels = batch()
    theirs, their_grads = their_loss_and_grads(model, ids, labels)
    ours, our_grads = liger_loss_and_grads(model, ids, labels)
    assert len(calls) == 1 and calls[0]["reduction"] == "sum" and calls[0]["accum_dtype"] == torch.float32
    assert calls[0]["softcap"] == (0.5 if family == "gemma2" else None)
    assert ours == pytest.approx(theirs, rel=1e-5)
    assert our_grads.keys() == their_grads.keys()
    for name, grad in their_grads.items():
        torch.testing.assert_close(our_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_under_autocast_liger_gets_operands_in_the_compute_dtype(liger_here) -> None:
    """fp32 master weights under bf16 autocast: Liger receives bf16 hidden states and weight, with autocast off
    inside (its out= products would not be cast), and the loss comes back in fp32."""
    model = tiny("granite")
    ids, labels = batch()
    wrapped = TokenLossModel(model, liger=True).train()
    wrapped.keep_token_losses = False
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = wrapped(input_ids=ids, labels=labels)
    assert calls[0]["dtypes"] == (torch.bfloat16, torch.bfloat16) and calls[0]["autocast"] is False
    assert loss.dtype == torch.float32
    loss.backward()
    assert model.lm_head.weight.grad.dtype == torch.float32 and model.lm_head.weight.grad.abs().sum() > 0


def test_where_liger_does_not_apply_our_loss_runs_and_the_log_says_why(liger_here, caplog) -> None:
    model = tiny("gemma2")
    ids, labels = batch()
    theirs, _ = their_loss_and_grads(model, ids, labels)
    trained = int((labels[:, 1:] != -100).sum())
    wrapped = TokenLossModel(model, liger=True).train()
    liger_loss._said.clear()
    with caplog.at_level(logging.INFO, logger="open_sft.model.liger_loss"):
        wrapped.keep_token_losses = True  # several sources: a loss per source needs each position's
        per_source = wrapped(input_ids=ids, labels=labels).detach()
        wrapped.eval()
        with torch.no_grad():
            evaluated = wrapped(input_ids=ids, labels=labels)
    assert calls == []
    assert float(per_source) / trained == pytest.approx(theirs, rel=1e-5)
    assert float(evaluated) / trained == pytest.approx(theirs, rel=1e-5)
    assert wrapped.token_losses is not None and float(wrapped.token_losses.sum()) == pytest.approx(float(evaluated))
    said = caplog.text
    assert "logs a loss per source" in said and "recomputing its logits in backward" in said
    assert "evaluation (a loss per source, no gradient)" in said


def test_the_reasons_liger_is_not_used() -> None:
    head, hidden = torch.nn.Linear(4, 8), torch.zeros(2, 4)
    assert "runs on CUDA only" in liger_loss.why_not(head, hidden, per_position=False, training=True)
    on_gpu = liger_loss.on_cuda
    try:
        liger_loss.on_cuda = lambda t: True
        assert liger_loss.why_not(head, hidden, per_position=False, training=True) is None

        class LoraLinear(torch.nn.Linear):
            pass

        assert "LoraLinear" in liger_loss.why_not(LoraLinear(4, 8), hidden, per_position=False, training=True)
    finally:
        liger_loss.on_cuda = on_gpu


def test_peak_bytes_follows_liger_kernels_chunking() -> None:
    """The preflight's figure for Liger's fused loss: the 1B benchmark's 16,384 rows of a 50,304 × 2,048 head take
    1,024-row chunks (Liger: next power of two of 16,384 / ceil(50,304 / 2,048) = 656); fp32 weight gradient,
    bf16 weight, bf16 hidden-state gradient, one chunk's logits in bf16 and fp32."""
    from open_sft.model.liger_loss import peak_bytes

    vocab, hidden = 50304, 2048
    assert peak_bytes(vocab, hidden, 16384, 2) == 6 * vocab * hidden + 2 * 16384 * hidden + 6 * 1024 * vocab
    assert peak_bytes(vocab, hidden, 3, 2) == 6 * vocab * hidden + 2 * 3 * hidden + 6 * 1 * vocab  # one small chunk


def test_the_preflight_counts_liger_loss_only_where_it_surely_runs(monkeypatch) -> None:
    from types import SimpleNamespace

    from open_sft.preflight.estimate import _liger_loss_applies

    def config(liger=True, lora=False, qlora=False):
        return SimpleNamespace(model=SimpleNamespace(use_liger_kernel=liger),
                               lora=SimpleNamespace(use_lora=lora, use_qlora=qlora))

    one, two = SimpleNamespace(source_names=["a"]), SimpleNamespace(source_names=["a", "b"])
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    assert _liger_loss_applies(config(), one)
    assert not any(_liger_loss_applies(c, d) for c, d in [(config(), two), (config(liger=False), one),
                                                          (config(lora=True), one), (config(qlora=True), one)])
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert not _liger_loss_applies(config(), one)
