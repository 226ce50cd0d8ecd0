"""The chunked LM-head + cross-entropy equals the plain path (loss and gradients), skips -100
positions, tracks fp32 under bf16 autocast, and never creates a [tokens, vocab] tensor."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from open_sft.model.fused_ce import lm_head_loss_sum, linear_cross_entropy_sum
from open_sft.model.lm_head import supports_fused
from open_sft.data.batching import trained_index
from open_sft.model.loss import TokenLossModel

N, D, V = 50, 16, 300


def problem(seed: int = 0, bias: bool = False, ignored: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=g, dtype=torch.float64).float().requires_grad_()
    head = nn.Linear(D, V, bias=bias)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, D, generator=g) * 0.5)
        if bias:
            head.bias.copy_(torch.randn(V, generator=g))
    targets = torch.randint(0, V, (N,), generator=g)
    if ignored:
        targets[torch.randperm(N, generator=g)[:ignored]] = -100
    return hidden, head, targets


def grads(loss: torch.Tensor, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, tensors))


def value(loss: torch.Tensor) -> float:
    return float(loss.detach())


def plain(hidden, head, targets) -> torch.Tensor:
    return F.cross_entropy(head(hidden).float(), targets, reduction="sum")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk", [1, 7, 16, 50, 64])  # 7 does not divide 50; 64 is one chunk larger than N
def test_fused_equals_plain_fp32(chunk, bias) -> None:
    hidden, head, targets = problem(bias=bias)
    params = [hidden, head.weight] + ([head.bias] if bias else [])
    scale = 0.37  # the trainer multiplies the loss sum before backward: grad_output != 1
    expected = plain(hidden, head, targets)
    expected_grads = grads(expected * scale, *params)
    got = lm_head_loss_sum(head, hidden, targets, chunk_rows=chunk)
    assert got.dtype == torch.float32
    assert value(got) == pytest.approx(value(expected), rel=1e-5)
    for g, e in zip(grads(got * scale, *params), expected_grads):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-7)


def test_ignored_positions_are_skipped() -> None:
    hidden, head, targets = problem(ignored=17)
    keep = targets != -100
    expected = plain(hidden, head, targets)  # F.cross_entropy ignores -100 by default
    expected_grads = grads(expected, hidden, head.weight)
    with_ignored = linear_cross_entropy_sum(hidden, head.weight, None, targets, chunk_rows=8)
    skipped = linear_cross_entropy_sum(hidden[keep], head.weight, None, targets[keep], chunk_rows=8)
    assert value(with_ignored) == pytest.approx(value(expected), rel=1e-5)
    assert value(skipped) == pytest.approx(value(expected), rel=1e-5)
    got_grads = grads(with_ignored, hidden, head.weight)
    for g, e in zip(got_grads, expected_grads):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-7)
    assert float(got_grads[0][~keep].abs().max()) == 0.0
    # Nothing trained: zero loss and zero gradients, as the plain path gives.
    none = linear_cross_entropy_sum(hidden, head.weight, None, torch.full((N,), -100), chunk_rows=8)
    assert value(none) == 0.0
    assert all(float(g.abs().max()) == 0.0 for g in grads(none, hidden, head.weight))


def test_bf16_autocast_tracks_fp32() -> None:
    """bf16 matmuls, fp32 softmax: within 1 % of the fp32 loss (bf16 keeps 8 bits of mantissa) and
    gradients within 3 % of their largest entry; and as close to the plain bf16 path as to fp32."""
    hidden, head, targets = problem(bias=True)
    params = [hidden, head.weight, head.bias]
    fp32 = plain(hidden, head, targets)
    fp32_grads = grads(fp32, *params)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = lm_head_loss_sum(head, hidden, targets, chunk_rows=7)
        plain_bf16 = plain(hidden, head, targets)
    assert fused.dtype == torch.float32
    assert value(fused) != value(fp32)  # really computed in bf16
    assert value(fused) == pytest.approx(value(fp32), rel=1e-2)
    assert value(fused) == pytest.approx(value(plain_bf16), rel=1e-3)
    fused_grads = grads(fused, *params)
    for g, p, e, b in zip(fused_grads, params, fp32_grads, grads(plain_bf16, *params)):
        assert g.dtype == p.dtype
        assert float((g - e).abs().max()) < 0.03 * float(e.abs().max())
        assert float((g - b).abs().max()) < 0.03 * float(e.abs().max())


def test_tied_weight_gradients_add_up() -> None:
    """A head tied to the input embeddings: the embedding and head gradients add up through autograd."""
    g = torch.Generator().manual_seed(3)
    embed = nn.Embedding(V, D)
    head = nn.Linear(D, V, bias=False)
    head.weight = embed.weight
    with torch.no_grad():
        embed.weight.copy_(torch.randn(V, D, generator=g))
    ids = torch.randint(0, V, (N,), generator=g)
    targets = torch.randint(0, V, (N,), generator=g)
    expected_grad = grads(plain(torch.tanh(embed(ids)), head, targets), embed.weight)[0]
    got_grad = grads(lm_head_loss_sum(head, torch.tanh(embed(ids)), targets, chunk_rows=9), embed.weight)[0]
    torch.testing.assert_close(got_grad, expected_grad, rtol=1e-5, atol=1e-6)


class ShapeRecorder(TorchDispatchMode):
    """Records the shape of every tensor an ATen op returns (forward and backward alike)."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


def largest_output(fn) -> int:
    recorder = ShapeRecorder()
    with recorder:
        fn()
    return max(torch.Size(s).numel() for s in recorder.shapes)


@pytest.mark.parametrize("autocast", [False, True])
def test_never_creates_full_logits(autocast) -> None:
    """No op output of forward or backward exceeds chunk × vocab elements (the plain path does make [N, V])."""
    hidden, head, targets = problem()
    chunk = 8

    def run(loss_fn):
        def step():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = loss_fn()
            (loss * 0.5).backward()
        return step

    assert largest_output(run(lambda: plain(hidden, head, targets))) >= N * V  # the recorder sees it
    largest = largest_output(run(lambda: lm_head_loss_sum(head, hidden, targets, chunk_rows=chunk)))
    assert largest <= max(chunk * V, V * D), largest


def test_no_gradient_work_under_no_grad() -> None:
    """Evaluation runs under no_grad: one matmul per chunk (logits), none for gradients, same value."""
    hidden, head, targets = problem()
    expected = float(plain(hidden, head, targets).detach())
    recorder = ShapeRecorder()
    with torch.no_grad(), recorder:
        loss = lm_head_loss_sum(head, hidden, targets, chunk_rows=7)
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    assert sum(op in ("mm", "addmm") for op in recorder.ops) == -(-N // 7)
    assert not loss.requires_grad


def test_only_plain_linear_heads_are_fused() -> None:
    class Subclass(nn.Linear):  # e.g. bitsandbytes' Linear4bit
        pass

    assert supports_fused(nn.Linear(4, 8))
    assert not supports_fused(Subclass(4, 8))
    with pytest.raises(TypeError, match="plain nn.Linear"):
        lm_head_loss_sum(Subclass(4, 8), torch.zeros(2, 4), torch.zeros(2, dtype=torch.long))
    head = nn.Linear(4, 8)
    lm_head_loss_sum(head, torch.zeros(2, 4), torch.zeros(2, dtype=torch.long))
    assert "forward" not in head.__dict__  # the temporary forward is removed again
    assert head(torch.zeros(2, 4)).shape == (2, 8)


def test_hooks_of_the_head_fire_around_the_fused_loss() -> None:
    """ZeRO-3 gathers the head's weight in its forward pre-hook: the fused loss must run inside that call."""
    hidden, head, targets = problem()
    events = []
    head.register_forward_pre_hook(lambda module, args: events.append("pre"))
    head.register_forward_hook(lambda module, args, out: events.append(("post", out.shape)))
    lm_head_loss_sum(head, hidden, targets)
    assert events == ["pre", ("post", torch.Size([]))]


def tiny_batch(model_dir, seed: int, rows: int, length: int, prompt: int):
    """The tiny model in fp32 and a random batch whose first `prompt` positions carry no label."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, model.config.vocab_size, (rows, length), generator=g)
    labels = input_ids.clone()
    labels[:, :prompt] = -100
    return model, input_ids, labels


def test_token_loss_model_fused_equals_plain(tiny_model_dir) -> None:
    model, input_ids, labels = tiny_batch(tiny_model_dir, 0, 3, 40, 15)
    labels[2] = -100
    results = []
    for fused in (False, True):
        wrapped = TokenLossModel(model, fused_loss=fused)
        model.zero_grad(set_to_none=True)
        loss = wrapped(input_ids=input_ids, labels=labels)
        loss.backward()
        results.append((value(loss), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (plain_loss, plain_grads), (fused_loss, fused_grads) = results
    assert fused_loss == pytest.approx(plain_loss, rel=1e-5)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("chunk", [7, 64])
def test_token_losses_are_each_positions_loss_and_leave_the_sum_as_it_was(chunk) -> None:
    """Per-source losses read each trained position's loss out of the same pass: they match F.cross_entropy per
    position, and the returned sum (and its gradient) is bit-for-bit the sum computed without them."""
    hidden, head, targets = problem(ignored=9)
    kept = torch.empty(int((targets != -100).sum()), dtype=torch.float32)
    with_losses = lm_head_loss_sum(head, hidden, targets, chunk_rows=chunk, token_losses=kept)
    without = lm_head_loss_sum(head, hidden, targets, chunk_rows=chunk)
    assert value(with_losses) == value(without)
    for a, b in zip(grads(with_losses, hidden, head.weight), grads(without, hidden, head.weight)):
        assert torch.equal(a, b)
    keep = targets != -100
    expected = F.cross_entropy(head(hidden[keep]).float(), targets[keep], reduction="none")
    torch.testing.assert_close(kept, expected.detach(), rtol=1e-5, atol=1e-6)
    assert float(kept.sum()) == pytest.approx(value(without), rel=1e-6)
    with pytest.raises(ValueError, match="token_losses holds 3 values"):
        lm_head_loss_sum(head, hidden, targets, token_losses=torch.empty(3))


def test_token_loss_model_keeps_token_losses_on_both_paths(tiny_model_dir) -> None:
    model, input_ids, labels = tiny_batch(tiny_model_dir, 1, 2, 30, 10)
    kept = []
    for fused in (False, True):
        wrapped = TokenLossModel(model, fused_loss=fused)
        assert wrapped(input_ids=input_ids, labels=labels) is not None and wrapped.token_losses is None
        wrapped.keep_token_losses = True
        loss = wrapped(input_ids=input_ids, labels=labels)
        assert wrapped.token_losses.shape == (2 * 20,) and not wrapped.token_losses.requires_grad
        assert float(wrapped.token_losses.sum()) == pytest.approx(value(loss), rel=1e-5)
        kept.append(wrapped.token_losses)
    torch.testing.assert_close(kept[1], kept[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fused", [False, True])
def test_trained_positions_found_on_the_host_select_what_the_mask_selects(tiny_model_dir, fused) -> None:
    """The trainer hands the loss the trained positions as the host found them (batching.trained_index), so a GPU
    need not count a boolean mask: the same rows in the same order, so the loss, every gradient and each position's
    loss are bitwise those of the mask (a row without labels, and the last position trained, included)."""
    model, input_ids, labels = tiny_batch(tiny_model_dir, 2, 3, 30, 10)
    labels[1] = -100
    labels[2, 20:25] = -100
    index = trained_index(labels)
    assert index.tolist() == [p for r in range(3) for p in range(r * 30, r * 30 + 29) if labels[r, p % 30 + 1] != -100]
    results = []
    for given in (None, index):
        wrapped = TokenLossModel(model, fused_loss=fused)
        wrapped.keep_token_losses = True
        model.zero_grad(set_to_none=True)
        loss = wrapped(input_ids=input_ids, labels=labels, trained_index=given)
        loss.backward()
        results.append((loss.detach(), wrapped.token_losses, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss_a, kept_a, grads_a), (loss_b, kept_b, grads_b) = results
    assert torch.equal(loss_a, loss_b) and torch.equal(kept_a, kept_b) and kept_a.shape == (2 * 20 - 5,)
    for name, grad in grads_a.items():
        assert torch.equal(grads_b[name], grad), name


@pytest.mark.parametrize("gap", [50.0, 120.0, 1000.0])
def test_a_target_far_below_its_rows_best_keeps_its_exact_loss(gap) -> None:
    """The loss is read as log(p_target) off one softmax; a target whose probability is below fp32's normal
    range (gaps of 120 and 1000 nats) takes its row's log-softmax instead, so the loss stays finite and exact."""
    hidden, head, targets = problem()
    with torch.no_grad():
        head.weight[targets[0]] = head.weight[targets[0]] - gap * hidden[0] / hidden[0].norm() ** 2
    expected = plain(hidden, head, targets)
    kept = torch.empty(N)
    got = lm_head_loss_sum(head, hidden, targets, chunk_rows=7, token_losses=kept)
    assert float(kept[0]) > gap * 0.9
    assert value(got) == pytest.approx(value(expected), rel=1e-6)
    torch.testing.assert_close(kept, F.cross_entropy(head(hidden).float(), targets, reduction="none"),
                               rtol=1e-6, atol=1e-5)
    for g, e in zip(grads(got, hidden, head.weight), grads(expected, hidden, head.weight)):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


@pytest.fixture
def gpu_layout(monkeypatch):
    """The chunk layout a CUDA device takes (whole-chunk matmuls and softmax, log-sum-exp), run here on CPU."""
    from open_sft.model import fused_ce

    monkeypatch.setattr(fused_ce, "gpu_layout", lambda t: True)


@pytest.mark.parametrize("gap", [0.0, 120.0, 1000.0])
@pytest.mark.parametrize("chunk", [7, 64])
def test_gpu_layout_equals_plain(gpu_layout, chunk, gap) -> None:
    """The GPU layout's log-sum-exp loss and its gradient equal the plain path in fp32 (a target 1,000 nats below
    its row's best included: no tiny-probability check is needed there), and its bf16 loss tracks the plain bf16."""
    hidden, head, targets = problem(bias=True)
    with torch.no_grad():
        head.weight[targets[0]] = head.weight[targets[0]] - gap * hidden[0] / hidden[0].norm() ** 2
    params = [hidden, head.weight, head.bias]
    expected = plain(hidden, head, targets)
    kept = torch.empty(N)
    got = lm_head_loss_sum(head, hidden, targets, chunk_rows=chunk, token_losses=kept)
    assert value(got) == pytest.approx(value(expected), rel=1e-6)
    torch.testing.assert_close(kept, F.cross_entropy(head(hidden).float(), targets, reduction="none"),
                               rtol=1e-6, atol=1e-5)
    for g, e in zip(grads(got * 0.37, *params), grads(expected * 0.37, *params)):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = lm_head_loss_sum(head, hidden, targets, chunk_rows=chunk)
        plain_bf16 = plain(hidden, head, targets)
    assert value(fused) == pytest.approx(value(plain_bf16), rel=1e-3)


def test_gpu_layout_takes_bigger_chunks() -> None:
    """A GPU's chunk holds 512 MiB of logits (a CPU's 128 MiB): 5,242 bf16 rows of a 51,200 vocabulary."""
    from open_sft.model.fused_ce import default_chunk_rows, peak_bytes

    assert default_chunk_rows(51200, 2) == 1310
    assert default_chunk_rows(51200, 2, on_gpu=True) == 5242
    assert peak_bytes(51200, 2048, 100_000, 2, on_gpu=True) > peak_bytes(51200, 2048, 100_000, 2)
