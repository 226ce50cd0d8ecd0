"""Whether a model keeps packed examples apart, checked when it is loaded for a --packing run.

A packed row holds several examples, told apart only by position_ids restarting. transformers turns that into a
block-diagonal mask (or open_sft's per-example attention splits the row) for the families whose mask is built
from position_ids; a family whose mask ignores them (gpt-oss, Bloom, MPT, XGLM, Granite-4.0-H's hybrid layers in
transformers 5) gives the whole row one causal mask, and every example attends to the ones packed before it: a
loss that trains, but not on the data (found by a family sweep). Families in VERIFIED are held to it by
tests/unit/model/test_packed_families.py; any other is checked here on the model itself: the hidden states of a
short example alone against the same example packed after another. A difference stops the run with the family
named, before any step is taken.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Iterator, Optional

import torch
from torch import nn

from open_sft.errors import UserError
from open_sft.model.anatomy import backbone_of, causal_lm_of, text_config, text_decoder_of
from open_sft.model.loss_parity import VERIFIED

if TYPE_CHECKING:
    from open_sft.config.args import TrainingArguments
    from open_sft.distributed.parallelism import Parallelism

logger = logging.getLogger(__name__)

# families whose packed examples attend to each other (tests/unit/model/test_packed_families.py holds each to its
# leak): refused by name also where the model is partitioned and the check cannot run
LEAKS = frozenset({"gpt_oss"})
FIRST, SECOND = 7, 9  # tokens of the example packed first and of the one checked after it
RTOL = {torch.float32: 1e-4, torch.float64: 1e-6}  # of the hidden states' scale; half precision: 2e-2


def _backbone(model: nn.Module) -> nn.Module:
    return backbone_of(causal_lm_of(model))


@contextlib.contextmanager
def _evaluating(model: nn.Module) -> Iterator[None]:
    """The model in eval mode (no dropout, no router noise) for a probe, back in its own mode after."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def _partitioned(model: nn.Module) -> bool:
    """Parameters that are not whole on this rank (ZeRO-3, FSDP2, TP): no forward outside the training engine."""
    from torch.distributed.tensor import DTensor

    return any(getattr(p, "ds_numel", None) is not None or isinstance(p, DTensor) for p in model.parameters())


@torch.no_grad()
def packing_leak(model: nn.Module) -> float:
    """How far the second of two packed examples' hidden states move from those it has alone, relative to their
    largest magnitude (0 for a model that keeps packed examples apart)."""
    config = text_config(model.config)
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (1, FIRST + SECOND), generator=generator).to(device)
    positions = torch.cat([torch.arange(FIRST), torch.arange(SECOND)])[None].to(device)
    backbone = _backbone(model)
    with _evaluating(model):
        alone = backbone(input_ids=ids[:, FIRST:], use_cache=False).last_hidden_state.float()
        packed = backbone(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state[:, FIRST:].float()
    return float((packed - alone).abs().max() / alone.abs().max().clamp_min(1e-12))


def packed_gradients_finite(model: nn.Module, padding: int = 5) -> bool:
    """Whether a packed row laid out as training lays it out (two examples, then the rest of the row as a block of
    pad tokens with positions of its own) back-propagates finite gradients. Gemma-3n's text model does not: a
    block of one repeated token gives NaN gradients (its padded batches are fine), so every packed step of it
    would be skipped as non-finite. Checked on the first decoder layer's trainable parameters (or the first few
    trainable ones): NaN reaches them from wherever it starts."""
    backbone = _backbone(model)
    layers = getattr(text_decoder_of(causal_lm_of(model)), "layers", None)
    first = layers[0] if isinstance(layers, nn.ModuleList) and len(layers) else backbone
    targets = [p for p in first.parameters() if p.requires_grad] or [
        p for p in backbone.parameters() if p.requires_grad and p.numel() < 2**24][:4]
    if not targets:
        return True
    config = text_config(model.config)
    device = next(model.parameters()).device
    pad = config.pad_token_id if isinstance(getattr(config, "pad_token_id", None), int) else 0
    generator = torch.Generator().manual_seed(1)
    ids = torch.cat([torch.randint(0, config.vocab_size, (1, FIRST + SECOND), generator=generator),
                     torch.full((1, padding), pad)], dim=1).to(device)
    positions = torch.cat([torch.arange(FIRST), torch.arange(SECOND), torch.arange(padding)])[None].to(device)
    with _evaluating(model), torch.enable_grad():
        hidden = backbone(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state
        grads = torch.autograd.grad(hidden.float().pow(2).mean(), targets, allow_unused=True)
    return all(g is None or bool(torch.isfinite(g).all()) for g in grads)


def check_packing(model: nn.Module) -> Optional[str]:
    """For a --packing run of a family outside VERIFIED: raises UserError when packed examples see each other;
    returns a log line (None for verified families)."""
    family = getattr(model.config, "model_type", type(model).__name__)
    if family in VERIFIED:
        return None
    if family in LEAKS:
        raise _leaking(family, "its eager attention mask is one causal mask over the whole row")
    if _partitioned(model):
        logger.warning("--packing: model type %r is not among the families open_sft has verified to keep packed "
                       "examples apart, and its parameters are partitioned here, so it is not checked at start; "
                       "check it once without ZeRO-3/FSDP/TP (a one-process run of a few steps)", family)
        return None
    dtype = next(model.parameters()).dtype
    try:
        leak = packing_leak(model)
    except TypeError as exc:  # a forward that takes no position_ids cannot be told where examples start
        raise UserError(f"--packing: model type {family!r} does not take position_ids ({exc}), which is how packed "
                        "examples are told apart; train without --packing") from None
    if leak > RTOL.get(dtype, 2e-2):
        raise _leaking(family, f"an example's hidden states moved by {leak:.2e} (relative) when another was packed "
                       "before it: its attention mask is not built from position_ids, or a recurrent layer carries its "
                       "state across examples")
    if not packed_gradients_finite(model):
        raise UserError(f"--packing: model type {family!r} gives non-finite gradients on a packed row (its block of pad "
                        "tokens), so every packed step would be skipped; train without --packing (padded batches are "
                        "fine); please report the model type")
    return f"--packing: model type {family!r} keeps packed examples apart (checked at start: {leak:.1e})"


def _leaking(family: str, why: str) -> UserError:
    return UserError(f"--packing: model type {family!r} lets packed examples attend to each other ({why}). Train "
                     "without --packing (padded batches keep examples apart); please report the model type")


def route_packed_rows(model: nn.Module, train: TrainingArguments, parallelism: Parallelism) -> None:
    """Packed rows' attention for the run (open_sft.model.packed_attention: per example, or torch's variable-length
    flash attention on a GPU), then, for --packing, the family checked to keep packed examples apart (on the whole
    model: not under pipeline parallelism, whose stages hold a part of it)."""
    from open_sft.model import packed_attention

    on_gpu = torch.cuda.is_available()
    if packed_attention.install(model, varlen=on_gpu) and train.packing:
        logger.info("packed rows attend one example at a time (%s)",
                    "torch's variable-length flash attention" if on_gpu and packed_attention.varlen_kernel()
                    else "sdpa has no variable-length kernel here")
    if train.packing and not parallelism.pp_enabled:
        note = check_packing(model)
        if note:
            logger.info("%s", note)
