"""What the packing check (open_sft.model.packing_check) measures where half precision cannot tell whether packed
examples are kept apart: a model whose hidden states rounding moved past half precision's tolerance, with nothing
depending on the example packed before (a routed model whose expert choice rounding flipped; a deep dense one,
rounding adding up over its layers: tiny 32-layer OLMo-3 and EXAONE-4 in bf16, 3.3e-2), is measured again in fp32.

Two things make that measure sound and affordable. On a GPU fp32 takes the per-example attention, not torch's
variable-length kernel that half-precision packed rows train with, so an fp32 measure alone would pass a faulty
kernel (or multi-head latent attention's zero-padded values): `attention_moves` holds the kernel to the
per-example attention at the first layer of each kind of attention (full, sliding with its window), in the run's
dtype, on that layer's own inputs. And converting the whole model to fp32 doubles a bf16 model's memory (an 8B:
16 GB more): `fp32_by_layer` upcasts one decoder layer at a time.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Callable, Iterable, Iterator, Optional

import torch
from torch import nn

from open_sft.model.anatomy import backbone_of, causal_lm_of, text_config, text_decoder_of


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
    """Raised by the recording attention function once each kind of attention layer has been compared: nothing
    after it runs."""


def _layer_type(config: object, module: nn.Module) -> Optional[str]:
    """The kind of attention layer `module` is (its config's `layer_types` entry: full_attention,
    sliding_attention, ...), or None where the config does not say."""
    layer_types, index = getattr(config, "layer_types", None), getattr(module, "layer_idx", None)
    if isinstance(layer_types, (list, tuple)) and isinstance(index, int) and 0 <= index < len(layer_types):
        return str(layer_types[index])
    kind = getattr(module, "attention_type", None)
    return kind if isinstance(kind, str) else None


# `layer_types` kinds whose layers call no attention function (transformers' names: Mamba, gated delta net and
# lightning layers are linear_attention, LFM2's convolutions conv, Nemotron-H's expert layers moe; mamba and
# recurrent as older configs say): waiting for them ran the whole forward pass. An unknown kind is still waited for
# (it costs the rest of the pass, where skipping it could leave an attention kind uncompared).
NOT_ATTENTION = frozenset({"linear_attention", "conv", "moe", "mamba", "recurrent", "sparse", "dense"})


def _kinds(config: object) -> set[Optional[str]]:
    """The kinds of attention layer the forward pass holds: once each has been compared, it stops."""
    layer_types = getattr(config, "layer_types", None)
    if not isinstance(layer_types, (list, tuple)) or not layer_types:
        return {None}
    return {str(k) for k in layer_types} - NOT_ATTENTION


def _alone(attention: Callable, module: nn.Module, qkv: list[torch.Tensor], mask: Optional[torch.Tensor],
           lengths: list[int], kwargs: dict) -> torch.Tensor:
    """Each example of a packed [1, heads, row, head_dim] call attended alone on the call's own queries, keys and
    values, by the attention function the packed attention wraps (given no position ids, it hands an example's call
    on): through the example's block of the row's mask (what transformers built from the positions: causal, within a
    window or a chunk), or, where the row got none, causal within the layer's window. [1, row, heads, head_dim]."""
    from open_sft.model.packed_attention import window_mask

    window = kwargs.get("sliding_window")
    rest = {k: v for k, v in kwargs.items() if k not in ("position_ids", "is_causal")}
    outputs, start = [], 0
    for n in lengths:
        part = [t[:, :, start:start + n] for t in qkv]
        if mask is not None and mask.dim() == 4:
            block = mask[..., start:start + n, start:start + n]
        else:
            block = window_mask(n, window, part[0].device) if isinstance(window, int) and n > window else None
        outputs.append(attention(module, *part, block, **rest)[0])
        start += n
    return torch.cat(outputs, dim=1)


def _label(module: nn.Module, layer_type: Optional[str], window: Optional[int], call: int, longest: int) -> str:
    """"layer 1 (sliding_attention, window 4)": the layer (its call's number where the module does not say), its kind,
    and its window, "not reached" where no example of the probe is longer than it (`longest`)."""
    index = getattr(module, "layer_idx", None)
    where = f"layer {index if isinstance(index, int) else call}"
    reached = "" if not isinstance(window, int) or longest > window else " not reached"
    said = [s for s in (layer_type, f"window {window}{reached}" if isinstance(window, int) else None) if s]
    return f"{where} ({', '.join(said)})" if said else where


@torch.no_grad()
def attention_moves(model: nn.Module, ids: torch.Tensor, lengths: list[int]) -> Optional[dict[str, float]]:
    """At the first layer of each kind of attention (full, sliding with its window: `layer_types`), how far the
    packed attention of the examples of `ids` ([1, row]) in one row (torch's variable-length kernel, on a GPU in half
    precision) is from each example attended alone (`_alone`: per-example sdpa) on the same queries, keys and values,
    relative to the latter's largest magnitude, by the layer's label (`_label`); the forward pass stopped once every
    kind was compared. The layer's own inputs, not a pass of each example alone: the layers before a kind's first
    would move those by rounding. None where packed rows do not go through open_sft's packed attention
    (open_sft.model.packed_attention). Run under the autocast of the run's dtype, in eval mode."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from open_sft.model import packed_attention

    if not packed_attention.installed() or getattr(model.config, "_attn_implementation", None) != "sdpa":
        return None
    config = text_config(model.config)
    expected, done, moves, calls = _kinds(config), set(), {}, []
    installed = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def recording(module, query, key, value, attention_mask, **kwargs):
        out = installed(module, query, key, value, attention_mask, **kwargs)
        layer_type, window = _layer_type(config, module), kwargs.get("sliding_window")
        calls.append(layer_type)
        if (layer_type, window) not in done:
            done.add((layer_type, window))
            alone = _alone(installed, module, [query, key, value], attention_mask, lengths, kwargs).float()
            moves[_label(module, layer_type, window, len(calls) - 1, max(lengths))] = float(
                (out[0].float() - alone).abs().max() / alone.abs().max().clamp_min(1e-12))
        if {kind for kind, _ in done} >= expected:
            raise _Stop
        return out

    positions = torch.cat([torch.arange(n) for n in lengths])[None].to(ids.device)
    ALL_ATTENTION_FUNCTIONS["sdpa"] = recording
    try:
        backbone_of(causal_lm_of(model))(input_ids=ids, position_ids=positions, use_cache=False)
    except _Stop:
        pass
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = installed
    return moves or None
