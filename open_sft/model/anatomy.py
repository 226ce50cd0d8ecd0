"""A model's anatomy: the transformers model inside a peft one, its decoder (the backbone) and decoder layers,
and what a parameter holds also when ZeRO-3 has partitioned it. A leaf: it imports nothing else of open_sft's, so
loading, LoRA, the loss and every parallelism can ask it."""

from __future__ import annotations

import sys
from typing import Any, Optional

import torch
from torch import nn


def causal_lm_of(model: nn.Module) -> nn.Module:
    """The transformers model of a model or of a peft model around it (peft injects its adapters in place)."""
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


def backbone_of(causal_lm: nn.Module) -> nn.Module:
    """The decoder a causal LM's head sits on: the attribute its base_model_prefix names, or `model` where the
    class names another (Llama4ForCausalLM's prefix is language_model, its decoder `model`)."""
    backbone = getattr(causal_lm, causal_lm.base_model_prefix, None)
    if backbone is None or backbone is causal_lm:
        backbone = getattr(causal_lm, "model", None)
    if not isinstance(backbone, nn.Module):
        raise ValueError(f"{type(causal_lm).__name__} has no decoder at .{causal_lm.base_model_prefix} or .model")
    return backbone


def text_config(config):
    """The config of the text model: a causal LM's own; a multimodal model's text_config (Gemma-3 4B-27B,
    Gemma3ForConditionalGeneration, keep their sizes, vocabulary and positions there, none at the top)."""
    get_text_config = getattr(config, "get_text_config", None)
    return get_text_config(decoder=True) if callable(get_text_config) else config


def layer_values(config: Any, key: str, default: Any = None) -> list[Any]:
    """`key` of each decoder layer. A heterogeneous config (transformers 5's per_layer_config: Gemma 4's full-attention
    layers' head_dim, 512 beside its sliding layers' 256) gives it layer by layer, and reading such a key at the top
    raises (AmbiguousGlobalPerLayerAttributeError, no AttributeError: getattr's default does not catch it); any other
    config gives its one value for every layer."""
    if key in (getattr(config, "per_layer_attributes", None) or ()):
        return [getattr(layer, key, default) for layer in config.per_layer_config]
    return [getattr(config, key, default)] * (getattr(config, "num_hidden_layers", None) or 1)


def text_decoder_of(causal_lm: nn.Module) -> nn.Module:
    """The decoder text runs through: the backbone, or a multimodal backbone's language_model (Gemma3Model holds
    the vision tower, the projector and the language model; on text alone only the last runs)."""
    backbone = backbone_of(causal_lm)
    language_model = getattr(backbone, "language_model", None)
    return language_model if isinstance(language_model, nn.Module) else backbone


def outside_text_path(model: nn.Module) -> dict[str, nn.Module]:
    """The backbone's parts a text-only forward does not run, by name (a multimodal model's vision tower and
    projector; none for a causal LM)."""
    causal_lm = causal_lm_of(model)
    try:
        backbone, decoder = backbone_of(causal_lm), text_decoder_of(causal_lm)
    except ValueError:
        return {}
    return {} if decoder is backbone else {name: child for name, child in backbone.named_children()
                                           if child is not decoder}


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a transformers causal LM (or a peft model around one)."""
    causal_lm = causal_lm_of(model)
    try:
        backbone = text_decoder_of(causal_lm)
    except ValueError:
        backbone = None
    layers = getattr(backbone, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise ValueError(f"{type(causal_lm).__name__} has no decoder layers at "
                         f"{causal_lm.base_model_prefix}.layers to compile")
    return layers


def is_peft_model(model: torch.nn.Module) -> bool:
    # Without peft imported no PeftModel exists, and importing peft only to say so (it imports bitsandbytes, which
    # sets up torch.compile) would cost every run without LoRA seconds of CPU per rank at its end.
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def param_shape(param: torch.Tensor) -> torch.Size:
    """A parameter's full shape, also when ZeRO-3 has partitioned it (its own tensor is then empty)."""
    return getattr(param, "ds_shape", param.shape)


def param_numel(param: torch.Tensor) -> int:
    """The elements a parameter stores (a 4-bit one's packed bytes; a ZeRO-3 partitioned one's whole count)."""
    return getattr(param, "ds_numel", None) or param.numel()


def weight_numel(param: torch.Tensor) -> int:
    """The elements of the weight a parameter stands for: a bitsandbytes 4-bit weight stores two per byte in a
    [n / 2, 1] tensor, and its quant_state keeps the layer's shape (the matmul's FLOPs are of that shape)."""
    quant_state = getattr(param, "quant_state", None)
    shape = getattr(quant_state, "shape", None)
    return int(torch.Size(shape).numel()) if shape is not None else param_numel(param)


def _head_weight(model: nn.Module) -> torch.Tensor:
    """The LM head's weight parameter. peft's trainable-tokens wrapper (added tokens under LoRA) computes its
    `.weight` as the base merged with the trained rows, which fails on a ZeRO-3 partitioned (empty) base and is no
    parameter of the model: its base layer holds the parameter."""
    head = model.get_output_embeddings()
    token_adapter = getattr(head, "token_adapter", None)
    return (token_adapter.get_base_layer() if token_adapter is not None else head).weight


# what each MoE family's config calls its experts per token and its routed experts (transformers' attribute maps
# answer the first name for most: Ernie's moe_k, Hunyuan's moe_topk; DBRX keeps them in its ffn_config)
TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "moe_top_k", "top_k_experts", "moe_k", "num_experts_per_token")
EXPERTS_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def _first_int(configs: list[Any], keys: tuple[str, ...]) -> Optional[int]:
    for config in configs:
        for key in keys:
            value = getattr(config, key, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def active_experts(config: Any) -> Optional[tuple[int, int]]:
    """(experts each token is routed to, routed experts) of an MoE model's config; None for a dense one."""
    configs = [config, *(getattr(config, name) for name in ("text_config", "ffn_config")
                         if getattr(config, name, None) is not None)]
    top_k, experts = _first_int(configs, TOP_K_KEYS), _first_int(configs, EXPERTS_KEYS)
    return (top_k, experts) if top_k and experts and top_k < experts else None


def is_routed_expert(name: str, module: nn.Module) -> bool:
    """An MoE's bank of routed experts (transformers' fused `experts` modules, GraniteMoE's and JetMoE's
    ParallelExperts, an older ModuleList named experts), not a shared expert that every token runs."""
    leaf = name.rsplit(".", 1)[-1]
    kind = type(module).__name__
    return leaf == "experts" or (kind.endswith("Experts") and "Shared" not in kind and "shared" not in leaf)


def matmul_params(model: nn.Module) -> tuple[int, int]:
    """(the decoder's matmul weights one token computes with, the LM head's) in elements: every weight of two or
    more dimensions (a linear layer's, a router's, a 4-bit one's [n / 2, 1] bytes, counted at its layer's shape)
    but the embedding tables, whose lookups compute nothing; of an MoE's routed experts only the share a token
    is sent to (top-k of the experts: Qwen3-30B-A3B's 8 of 128); the LM head's counted also when it is tied to
    the input embedding (its matmul runs either way). peft's trained rows of added tokens are table rows too; a
    multimodal model's vision tower and projector compute nothing on text."""
    head = _head_weight(model)
    unused = {id(p) for part in outside_text_path(model).values() for p in part.parameters()}  # no FLOPs on text
    tables = unused | {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    tables |= {id(p) for m in model.modules() if hasattr(m, "trainable_tokens_delta")  # peft's trained rows
               for p in m.trainable_tokens_delta.parameters()}
    routing = active_experts(causal_lm_of(model).config)
    routed = {id(p) for name, m in model.named_modules() if routing and is_routed_expert(name, m)
              for p in m.parameters()}
    dense = experts = 0
    for name, p in model.named_parameters():  # (gpt-oss's experts keep their biases in [experts, out] tensors)
        if p is not head and id(p) not in tables and len(param_shape(p)) >= 2 and not name.endswith("bias"):
            if id(p) in routed:
                experts += weight_numel(p)
            else:
                dense += weight_numel(p)
    return dense + (experts * routing[0] // routing[1] if routing else 0), weight_numel(head)
