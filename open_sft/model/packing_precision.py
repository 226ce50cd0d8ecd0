"""What the packing check (open_sft.model.packing_check) measures where half precision cannot tell whether packed
examples are kept apart: a routed model whose expert choice rounding flipped is measured again in fp32.

Two things make that measure sound and affordable. On a GPU fp32 takes the per-example attention, not torch's
variable-length kernel that half-precision packed rows train with, so an fp32 measure alone would pass a faulty
kernel (or multi-head latent attention's zero-padded values): `first_attention_move` holds the kernel to the
per-example attention at the first attention layer, before any router, in the run's dtype. And converting the
whole model to fp32 doubles a bf16 model's memory (an 8B: 16 GB more): `fp32_by_layer` upcasts one decoder layer
at a time.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Iterable, Iterator, Optional

import torch
from torch import nn

from open_sft.model.anatomy import backbone_of, causal_lm_of, text_decoder_of


def _floating(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [t for t in tensors if t.is_floating_point()]


def _upcast(tensors: list[torch.Tensor], converted: list[tuple[torch.Tensor, torch.dtype]]) -> None:
    """Each tensor's data in fp32 in place, recorded in `converted` one by one (an out-of-memory part way leaves the
    record of those converted, for `_restore`)."""
    for tensor in tensors:
        converted.append((tensor, tensor.dtype))
        tensor.data = tensor.data.float()


def _restore(converted: list[tuple[torch.Tensor, torch.dtype]]) -> None:
    """Back to their own dtypes (exact: fp32 holds every half-precision value, and a forward changes no weight)."""
    for tensor, dtype in converted:
        tensor.data = tensor.data.to(dtype)
    converted.clear()


@contextlib.contextmanager
def in_fp32(model: nn.Module) -> Iterator[None]:
    """All of the model's floating-point parameters and buffers in fp32 for a probe, back in their own dtypes after:
    twice a bf16 model's memory, but backward passes see fp32 weights too."""
    converted: list[tuple[torch.Tensor, torch.dtype]] = []
    try:
        _upcast(_floating(itertools.chain(model.parameters(), model.buffers())), converted)
        yield
    finally:
        _restore(converted)


@contextlib.contextmanager
def fp32_by_layer(model: nn.Module) -> Iterator[None]:
    """The backbone computing in fp32 with one decoder layer's weights in fp32 at a time: what lies outside the
    layers (embeddings, final norm, rotary buffers) in fp32 for the probe, each layer's parameters and buffers upcast
    as it starts (a forward pre-hook) and back in their own dtype as it ends. Memory: the model in its own dtype, its
    embeddings once more in fp32 and one layer's weights (an 8B in bf16: ~17.5 GB, not 32). Forward passes only: a
    backward would meet the layers' weights back in half precision. A model with no `layers` list is converted whole."""
    layers = getattr(text_decoder_of(causal_lm_of(model)), "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        with in_fp32(model):
            yield
        return
    inside = {id(t) for t in itertools.chain(layers.parameters(), layers.buffers())}
    backbone = backbone_of(causal_lm_of(model))
    outside = [t for t in _floating(itertools.chain(backbone.parameters(), backbone.buffers())) if id(t) not in inside]
    converted: list[tuple[torch.Tensor, torch.dtype]] = []
    running: list[tuple[torch.Tensor, torch.dtype]] = []  # the layer in progress

    def start(layer: nn.Module, _inputs: tuple) -> None:
        _restore(running)  # a layer that raised before it ended
        _upcast(_floating(itertools.chain(layer.parameters(), layer.buffers())), running)

    def end(_layer: nn.Module, _inputs: tuple, _output: object) -> None:
        _restore(running)

    hooks = [h for layer in layers for h in (layer.register_forward_pre_hook(start), layer.register_forward_hook(end))]
    try:
        _upcast(outside, converted)
        yield
    finally:
        for hook in hooks:
            hook.remove()
        _restore(running)
        _restore(converted)


class _Stop(Exception):
    """Raised by the recording attention function once it has the first layer's output: nothing after it runs."""


def _first_attention(backbone: nn.Module, ids: torch.Tensor, positions: Optional[torch.Tensor]) -> Optional[
        torch.Tensor]:
    """The output of the first call of the "sdpa" attention function in a forward pass of `ids` ([batch, row, heads,
    the values' head_dim]), the pass stopped there; None where no call reached it."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    installed, outputs = ALL_ATTENTION_FUNCTIONS["sdpa"], []

    def recording(*args, **kwargs):
        outputs.append(installed(*args, **kwargs)[0])
        raise _Stop

    ALL_ATTENTION_FUNCTIONS["sdpa"] = recording
    try:
        backbone(input_ids=ids, position_ids=positions, use_cache=False)
    except _Stop:
        pass
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = installed
    return outputs[0].float() if outputs else None


@torch.no_grad()
def first_attention_move(model: nn.Module, ids: torch.Tensor, lengths: list[int]) -> Optional[float]:
    """How far the first attention layer's outputs for the examples of `ids` ([1, row]) packed in one row (torch's
    variable-length kernel, on a GPU in half precision) are from each example's attended alone (per-example sdpa),
    relative to their largest magnitude; None where packed rows do not go through open_sft's packed attention
    (open_sft.model.packed_attention). Run under the autocast of the run's dtype, in eval mode."""
    from open_sft.model import packed_attention

    if not packed_attention.installed() or getattr(model.config, "_attn_implementation", None) != "sdpa":
        return None
    backbone = backbone_of(causal_lm_of(model))
    positions = torch.cat([torch.arange(n) for n in lengths])[None].to(ids.device)
    packed = _first_attention(backbone, ids, positions)
    alone = [_first_attention(backbone, part, None) for part in ids.split(lengths, dim=1)]
    if packed is None or any(a is None for a in alone):
        return None
    reference = torch.cat(alone, dim=1)
    return float((packed - reference).abs().max() / reference.abs().max().clamp_min(1e-12))
