"""The MoE router's load-balancing (aux) loss: whether a run trains it, and the model's own function and numbers.

A transformers MoE forward adds `router_aux_loss_coef × aux` to its loss when its `output_router_logits` argument
says so, falling back to `config.output_router_logits`: HF's Trainer and open-instruct's finetune.py (its
`outputs.loss`) train the aux loss of a model whose config asks for it, with or without a flag. open_sft trains it
when --load_balancing_loss is on or, with the flag not given, when the config asks; `--no_load_balancing_loss`
(or `output_router_logits: false` through --additional_model_arguments) turns it off."""

from __future__ import annotations

import sys
from typing import Any, Callable, NamedTuple, Optional

from torch import nn

from open_sft.errors import UserError


EXPERT_COUNTS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")  # configs' names for it
ROUTING_BIASES = ("e_score_correction_bias", "expert_bias")  # DeepSeek-V3/GLM-4.5's, LFM2-MoE's per-expert bias


class RouterLoss(NamedTuple):
    function: Callable  # the modeling module's load_balancing_loss_func
    experts: int
    top_k: int
    coefficient: float  # router_aux_loss_coef


def router_loss_choice(flag: Optional[bool], config: Any) -> tuple[bool, Optional[str]]:
    """(train the router loss?, the log line saying why; None for a model that asks nothing of it). `flag`:
    --load_balancing_loss (None: not given). The flag decides where given; else the model's config does."""
    asks = getattr(config, "output_router_logits", None)
    if flag is None and not asks:
        return False, None
    coefficient = getattr(config, "router_aux_loss_coef", None)
    if flag is None:
        return True, (f"router load-balancing loss on: the model's config asks for it (output_router_logits: true, "
                      f"as transformers' own forward and HF's Trainer train it), weighted by its "
                      f"router_aux_loss_coef {coefficient}; --no_load_balancing_loss turns it off")
    if flag:
        return True, (f"router load-balancing loss on (--load_balancing_loss), weighted by the model's "
                      f"router_aux_loss_coef {coefficient}")
    if asks:
        return False, ("router load-balancing loss off (--no_load_balancing_loss), though the model's config asks "
                       "for it (output_router_logits: true): the run trains the language-model loss alone")
    return False, None


def _without_router_loss(causal_lm: nn.Module) -> str:
    """Why a model has no router loss, in words: a mixture of experts balanced by a per-expert bias on its router's
    scores (DeepSeek-V3, GLM-4.5, LFM2-MoE: aux-loss-free), another MoE whose transformers code has no aux loss,
    or a dense model."""
    tensors = dict(causal_lm.named_parameters()) | dict(causal_lm.named_buffers())
    bias = next((name for name in tensors if name.rsplit(".", 1)[-1] in ROUTING_BIASES), None)
    if bias is not None:
        return (f"is a mixture of experts balanced without an auxiliary loss: bias-based routing (a per-expert bias "
                f"on the router's scores, {bias.rsplit('.', 1)[-1]}) evens the experts' load instead")
    experts = next((getattr(causal_lm.config, name) for name in EXPERT_COUNTS
                    if isinstance(getattr(causal_lm.config, name, None), int)), None)
    if experts and experts > 1:
        return (f"is a mixture of {experts} experts whose transformers model computes no router auxiliary loss "
                "(no load_balancing_loss_func)")
    return "is not a mixture-of-experts model"


def router_loss(causal_lm: nn.Module, from_config: bool = False) -> RouterLoss:
    """(load_balancing_loss_func, experts, experts per token, coefficient) of an MoE model, read where its own
    forward reads them (Mixtral, Qwen2/3-MoE, OLMoE, GraniteMoE, gpt-oss: the function in its modeling module, the
    counts and router_aux_loss_coef on the ForCausalLM); a UserError for a model without a router loss (`from_config`:
    the loss was asked for by the model's config rather than the flag)."""
    function = getattr(sys.modules.get(type(causal_lm).__module__), "load_balancing_loss_func", None)
    parts = [getattr(causal_lm, name, None) for name in ("num_experts", "num_experts_per_tok", "router_aux_loss_coef")]
    if function is None or None in parts:
        family = getattr(causal_lm.config, "model_type", type(causal_lm).__name__)
        if from_config:
            raise UserError(f"model type {family!r}: its config asks for the router's aux loss (output_router_logits: "
                            "true), which open_sft cannot compute as its forward does (no load_balancing_loss_func "
                            "and expert counts); set --additional_model_arguments '{\"output_router_logits\": false}' "
                            "or pass --no_load_balancing_loss")
        raise UserError(f"--load_balancing_loss: model type {family!r} {_without_router_loss(causal_lm)}, so there "
                        "is no router load-balancing loss to add; drop the flag")
    return RouterLoss(function, *parts)
