"""What LoRA adapts: --lora_target_modules as peft's target_modules and target_parameters.

An MoE keeps its experts as fused weights of an experts module (transformers 5: Mixtral's, Qwen3-MoE's, OLMoE's and
gpt-oss's `experts.gate_up_proj` / `experts.down_proj`, [experts, ...] tensors) and often its router as a plain
weight (gpt-oss's `router.weight`): linear maps that are no nn.Linear, so peft's all-linear finds them only where
its own v4-to-v5 conversion knows the family (Mixtral, the Qwen2-MoE kin), and never gpt-oss's, which left ~97 % of
gpt-oss's decoder weights without an adapter. peft adapts such a weight as a parameter (`target_parameters`, its
ParamWrapper, as OpenAI's gpt-oss LoRA recipe does), without dropout. Here all-linear names them too, and a user may
name them (or their module: `experts`, `router`) in --lora_target_modules.

peft converts the LoRA config of the MoE families whose experts transformers 5 fused (DeepSeek-V2/V3, GLM-4.5,
Qwen3-Next, ERNIE-4.5-MoE, Hunyuan-A13B, ... the "qwen2_moe" and "mixtral" patterns) from v4's expert names to v5's:
every target named gate_proj, up_proj or down_proj becomes the experts' fused parameter, and the nn.Linear layers of
those names that are no experts (the dense layers before the first MoE layer, the shared experts) were left without
an adapter: all-linear on DeepSeek-V3 adapted the attention and the routed experts only. `linear_targets_kept` keeps
them wherever open_sft hands peft a config (a run's get_peft_model, generate/chat/compare's and merge-lora's
PeftModel.from_pretrained). peft 0.22 keeps them itself (the union kept here then adds nothing); setup.cfg still
admits 0.21."""

from __future__ import annotations

import contextlib
import importlib
import logging
from typing import Iterator, Optional, Union

from torch import nn

from open_sft.model.anatomy import is_routed_expert, param_shape

logger = logging.getLogger(__name__)
_CONVERSION = "peft.utils.transformers_weight_conversion"
_warned: set[str] = set()  # the missing peft function is said once a process

# the module types peft's LoRA adapts as modules (its supported layers)
_PEFT_LAYER_TYPES = ("Linear", "Embedding", "Conv1d", "Conv2d", "Conv3d", "Conv1D", "MultiheadAttention", "Linear4bit",
                     "Linear8bitLt")


def parameter_targets(model: nn.Module) -> dict[str, str]:
    """Full parameter name → owning module's name, of the linear maps held as plain parameters: the routed
    experts' fused weights (three dimensions, floating point; not their [experts, out] biases, nor a quantized
    bank's blocks and scales) and the weight of a router beside them that is no nn.Linear ([experts, hidden])."""
    found: dict[str, str] = {}
    modules = dict(model.named_modules())
    for name, module in modules.items():
        if not is_routed_expert(name, module) or type(module).__name__ == "ParamWrapper":
            continue
        banks = {f"{name}.{p}": name for p, t in module.named_parameters(recurse=False)  # not MXFP4's uint8 blocks
                 if len(param_shape(t)) == 3 and t.dtype.is_floating_point}
        if not banks:
            continue
        found.update(banks)
        experts = param_shape(module.get_parameter(next(iter(banks)).rsplit(".", 1)[-1]))[0]
        parent = name.rpartition(".")[0]
        for sibling_name, sibling in modules.items():
            weight = getattr(sibling, "weight", None)
            if (sibling_name.rpartition(".")[0] == parent and sibling_name != name
                    and isinstance(weight, nn.Parameter) and type(sibling).__name__ not in _PEFT_LAYER_TYPES
                    and len(param_shape(weight)) == 2 and param_shape(weight)[0] == experts):
                found[f"{sibling_name}.weight"] = sibling_name
    return found


def linear_routers(model: nn.Module) -> list[str]:
    """The routers parameter_targets adapts as a weight that are nn.Linear subclasses with a forward of their own
    (Llama-4's Llama4Router returns scores and logits): peft's all-linear would wrap them as layers too, which peft
    refuses beside the weight ('not a valid target'), and a LoRA layer around one fails on its tuple. Module names,
    for peft's exclude_modules."""
    modules = dict(model.named_modules())
    return sorted({owner for owner in parameter_targets(model).values()
                   if isinstance(modules[owner], nn.Linear) and type(modules[owner]) is not nn.Linear})


def _ends_with(full: str, name: str) -> bool:
    return full == name or full.endswith("." + name)


def split_targets(model: nn.Module, names: list[str]) -> tuple[Union[str, list[str]], list[str]]:
    """(peft's target_modules, its target_parameters) for --lora_target_modules `names`. all-linear: every linear
    layer but the LM head and every parameter_targets weight (as `experts.gate_up_proj`: module leaf and parameter).
    A name matching such a weight (`gate_up_proj`, `experts.down_proj`) or its module (`experts`, `mlp.router`) is a
    parameter target; a name matching a layer peft adapts stays a module target (it may be both)."""
    targets = parameter_targets(model)
    if names == ["all-linear"]:
        short = dict.fromkeys(".".join(full.split(".")[-2:]) for full in targets)
        return "all-linear", list(short)
    layers = [n for n, m in model.named_modules() if type(m).__name__ in _PEFT_LAYER_TYPES]
    modules, parameters = [], []
    for name in names:
        weights = [full for full, owner in targets.items() if _ends_with(full, name) or _ends_with(owner, name)]
        if weights:
            parameters += [name] if any(_ends_with(w, name) for w in weights) else \
                [f"{name}.{w.rsplit('.', 1)[-1]}" for w in dict.fromkeys(weights)]
        if not weights or any(_ends_with(layer, name) for layer in layers):
            modules.append(name)
    return modules, list(dict.fromkeys(parameters))


def adapted_parameters(peft_model: nn.Module) -> list[str]:
    """The parameters peft adapted as parameters (its ParamWrapper), by name without the wrappers' base_layer."""
    names = []
    for name, module in peft_model.named_modules():
        if type(module).__name__ == "ParamWrapper":
            names.append(f"{name.replace('.base_layer', '')}.{module.parameter_name}")
    return sorted(set(names))


def describe(peft_model: nn.Module, before: dict[str, str]) -> Optional[str]:
    """One log line: which fused expert / router weights LoRA adapts (by their names in a layer), and which it
    leaves frozen; None for a model without such weights."""
    if not before:
        return None
    adapted = {full.removeprefix("base_model.model.") for full in adapted_parameters(peft_model)}

    def kinds(names) -> str:
        return ", ".join(dict.fromkeys(".".join(n.split(".")[-2:]) for n in sorted(names))) or "none"

    left = [full for full in before if full not in adapted]
    return (f"LoRA on this MoE's weights held as parameters (peft target_parameters, no dropout): adapted "
            f"{kinds(adapted)} ({len(adapted)} tensors); without an adapter {kinds(left)} ({len(left)} tensors)")


# v4's expert projection names, which peft's conversion maps to the fused experts' parameters (not the router's gate)
_PROJECTIONS = frozenset({"gate_proj", "up_proj", "down_proj", "w1", "w2", "w3"})


@contextlib.contextmanager
def linear_targets_kept() -> Iterator[None]:
    """peft's v4-to-v5 MoE conversion of a LoRA config, keeping the targets that name nn.Linear layers of the model
    (a shared expert's or a dense layer's gate_proj / up_proj / down_proj) beside the experts' fused parameters it
    maps them to. For the duration of a get_peft_model or PeftModel.from_pretrained."""
    try:
        conversion = importlib.import_module(_CONVERSION)
    except ImportError:
        conversion = None
    original = getattr(conversion, "_convert_peft_config_moe", None)
    if original is None:  # a private function of peft's: another version may not have it
        _say_not_kept()
        yield
        return

    def keeping_linear_layers(peft_config, model: nn.Module) -> None:
        given = peft_config.target_modules
        original(peft_config, model)
        converted = peft_config.target_modules
        if given is None or isinstance(converted, str) or converted == given or (
                isinstance(given, str) and given.lower() != "all-linear"):
            return  # a family peft does not convert (its targets as given), or a regex
        linear = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, nn.Linear)}
        named = linear if isinstance(given, str) else set(given)
        kept = {name for name in named if _leaf(name) in _PROJECTIONS & linear}
        if kept:
            peft_config.target_modules = set(peft_config.target_modules or ()) | kept

    conversion._convert_peft_config_moe = keeping_linear_layers
    try:
        yield
    finally:
        conversion._convert_peft_config_moe = original


def _say_not_kept() -> None:
    if not _warned:
        _warned.add(_CONVERSION)
        logger.warning("this peft has no %s._convert_peft_config_moe, which open_sft wraps to keep the LoRA targets "
                       "that name nn.Linear gate_proj/up_proj/down_proj layers beside an MoE's fused experts: where "
                       "peft maps those names to the experts (DeepSeek-V2/V3, GLM-4.5, Qwen3-Next, ERNIE-4.5-MoE, "
                       "...), the dense first layers' MLP and the shared experts may be left without an adapter; "
                       "check which modules carry an adapter (peft 0.21 has the function)", _CONVERSION)


def _leaf(name: str) -> str:
    return name.rsplit(".", 1)[-1]
