"""The fused_ce probe's measurement: the chunked LM-head loss (open_sft.model.fused_ce) against plain
cross-entropy and a float64 reference, fp32 and bf16 autocast, loss and gradients; the time and peak memory of
each path; on CUDA with Liger installed, Liger's fused linear cross-entropy as well (test_fused_ce.py holds them
to their tolerances)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.gpu_check.measure import DEVICE, rel, timed


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


def measure(smoke: bool) -> dict:
    """Each path's relative error to the float64 reference, per dtype (fp32, bf16), its seconds and peak memory;
    with Liger, Liger against the fused loss under a cap and a scale."""
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
    if liger is not None:  # a cap and a scale (Gemma-2's, Cohere's): Liger's softcap and the folded scale
        transform = LogitTransform(scale=0.25, softcap=2.0)
        capped = {}
        for name, fn in (("fused", lambda: linear_cross_entropy_sum(hidden, weight, None, targets, transform=transform)),
                         ("liger", lambda: liger_loss_sum(liger, hidden, targets, transform))):
            capped[name] = _loss_and_grads(fn, hidden, weight, bf16=False)
        result["capped_fp32_liger_vs_fused"] = {k: rel(a, b) for k, a, b in
                                                zip(("loss", "grad_hidden", "grad_weight"), capped["liger"], capped["fused"])}
    result["liger"] = "measured" if liger is not None else "not installed or no CUDA"
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

