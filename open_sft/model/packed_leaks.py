"""Families whose packed examples see each other: those known by name (LEAKS, each held to its leak by
tests/unit/model/test_packing_leaks.py), and a recurrent layer found by the model's structure alone, which holds
where the packing check (open_sft.model.packing_check) cannot run the model (ZeRO-3's partitioned loading, FSDP)."""

from __future__ import annotations

import re
from typing import Optional

from torch import nn

from open_sft.model.anatomy import causal_lm_of, text_config, text_decoder_of

# families whose packed examples see each other, and why (tests/unit/model/test_packing_leaks.py holds each to its
# leak): refused by name, also where the model is partitioned and the check cannot run. The recurrent ones:
# transformers resets their state only where flash-attention's cu_seq_lens are passed, which packed rows do not pass
RECURRENT = ("its recurrent layers (Mamba, a short convolution or linear attention) carry their state from one "
             "example into the next")
LEAKS = {"gpt_oss": "its eager attention mask is one causal mask over the whole row", **dict.fromkeys((
    "lfm2", "lfm2_moe", "falcon_h1", "bamba", "jamba", "granitemoehybrid", "nemotron_h", "zamba2", "qwen3_next",
    "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "minimax", "kimi_linear", "olmo_hybrid", "mamba",
    "mamba2", "falcon_mamba", "recurrent_gemma", "xlstm", "zamba", "lfm3", "bailing_hybrid", "glm5_next",
    "glm5_next_text", "qwen4_exp", "qwen4_exp_text", "inkling_text", "inkling_mm_model", "inkling2", "inkling2_text",
    "inkling2_loop", "inkling2_loop_text", "lara_mini", "zaya", "rwkv"), RECURRENT)}

_RECURRENT_WORDS = ("mamba", "conv", "linear_attention", "recurrent", "ssm", "rwkv", "lstm")
# in a model type or a layer's class name (remote code: RWKV-5/6/7's rwkv5..7, an Rwkv7Attention block), which layer
# types and Conv1d modules do not show
_RECURRENT_NAMES = ("mamba", "rwkv", "recurrent", "lstm", "ssm", "hyena", "retnet")
_WORD_START = re.compile(r"(?<=[a-z0-9])[A-Z]|(?<=[A-Z])[A-Z](?=[a-z])|(?<=[A-Za-z])[0-9]")


def recurrent_layers(model: nn.Module) -> Optional[str]:
    """What marks a recurrent layer in the text model, by structure alone (it holds under ZeRO-3's partitioning):
    its config's layer types (`layer_types`, `layers_block_type`, `block_types`) naming a Mamba, convolution,
    linear-attention or recurrent layer, an nn.Conv1d module (a short causal convolution), or a model type or layer
    class named for one (RWKV, Mamba, an SSM, ...); None without."""
    config = text_config(model.config)
    family = str(getattr(model.config, "model_type", "")).lower()
    if any(word in family for word in _RECURRENT_NAMES):
        return f"its model type {family!r} names a recurrent layer"
    for key in ("layer_types", "layers_block_type", "block_types"):
        kinds = getattr(config, key, None)
        named = sorted({k for k in kinds if any(w in str(k).lower() for w in _RECURRENT_WORDS)}) if isinstance(
            kinds, (list, tuple)) else []
        if named:
            return f"its config's {key} holds {', '.join(map(str, named))}"
    for name, module in text_decoder_of(causal_lm_of(model)).named_modules():
        if isinstance(module, nn.Conv1d):
            return f"its layer {name} is a convolution"
        if _names_recurrent(type(module).__name__):
            return f"its {f'layer {name}' if name else 'decoder'} is a {type(module).__name__}"
    return None


def _names_recurrent(class_name: str) -> bool:
    """A recurrent word that begins one of the class name's CamelCase words (NemotronHMamba2Mixer, xLSTMBlock,
    Rwkv7Attention): inside SeedOssModel, GptOssModel and CohereCompassModel, "ssm" spans two words."""
    starts = {0} | {match.start() for match in _WORD_START.finditer(class_name)}
    lower = class_name.lower()
    return any(lower.startswith(word, start) for word in _RECURRENT_NAMES for start in starts)
