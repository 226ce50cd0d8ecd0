"""Tensor parallelism (TP) combined with FSDP2: accelerate's ParallelismConfig `tp_size`, transformers' tp_plan.

A launch asks for it the accelerate way, beside FSDP2:
`accelerate launch --use_fsdp --fsdp_version 2 --use_parallelism_config --parallelism_config_dp_shard_size D
--parallelism_config_tp_size T ...` (or configs/accelerate/fsdp2_tp.yaml). accelerate builds the
(dp_shard, tp) device mesh; here the model's own plan (`base_model_tp_plan`, for Llama-family models
colwise q/k/v/gate/up, rowwise o/down, the LM head's columns gathered) is applied on that mesh's "tp"
dimension with transformers' sharding styles; accelerate's `prepare` then makes every other parameter a
replicated DTensor of the same mesh and shards all of them with FSDP2 over "dp_shard". Optimizer state,
gradient clipping, torch.distributed.checkpoint and the full-state-dict export all work on those 2-D DTensors.

Why the plan is applied here and not by `from_pretrained(distributed_config=DistributedConfig(tp_size=T))`:
transformers 5 builds its own mesh of the whole world from DistributedConfig (and applies its own FSDP when
that mesh has a data-parallel dimension), while FSDP2's `fully_shard` needs the TP mesh and its own data-
parallel mesh cut from one device mesh, accelerate's. So the model is loaded whole (each rank reads the same
checkpoint) and each rank keeps its slice: `distribute_tensor(..., src_data_rank=None)` slices locally,
without a broadcast.

The data plan is the one of data parallelism over all ranks, as under sequence parallelism: every rank has
its own micro-batches, and a TP group of T ranks computes its members' micro-batches together, one after the
other (every rank of the group must see the same inputs). The global batch, the token-normalised loss and the
step plan are therefore those of the same world without TP; only the rank whose micro-batch a pass is counts
its loss and tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from open_sft.errors import UserError
from open_sft.model.anatomy import layer_values, text_config

if TYPE_CHECKING:
    from open_sft.distributed.parallelism import Parallelism

# transformers' style for a norm applied per attention head between a colwise and a rowwise layer (Qwen3's and
# Gemma 3's q_norm/k_norm): its parameter is whole on every rank, its input holds this rank's heads only
PER_HEAD = "replicated_with_grad_allreduce"
# the styles whose training under FSDP2 + TP the tests compare with one process (Llama, Qwen3 and OLMo2 plans)
VERIFIED_STYLES = {"colwise", "rowwise", "colwise_gather_output", "rowwise_split_input", "embedding_rowwise", PER_HEAD}


def untested_styles(styles: list[str]) -> str:
    """The sharding styles of a model's plan (DeepSeek-V3's mla_kv_a_proj, Llama 4's packed_rowwise) that the
    tests do not cover."""
    return (f"the model's tp_plan uses {', '.join(styles)}, which open_sft has not verified under FSDP2 + TP (only "
            + ", ".join(sorted(VERIFIED_STYLES)) + ")")


def tied_problem(flag: str) -> str:
    """Why a model whose LM head is its input embedding cannot be split: transformers' plan names the head's weight,
    which the model holds only under the embedding's name (its tp_plan would fail with KeyError 'lm_head.weight'),
    and sharding the embedding alone would leave the head a whole weight, no longer tied."""
    return (f"{flag}: the model ties its LM head to its input embeddings (tie_word_embeddings, as Llama-3.2 1B/3B, "
            "Qwen2.5 0.5B-3B, Qwen3 0.6B-4B and Gemma do), which tensor parallelism cannot split as one weight; drop "
            "TP and shard with FSDP2 alone")


def tensor_parallel_problems(parallelism: Parallelism, train: Any, lora: Any, model_config: Any) -> list[str]:
    """What `--parallelism_config_tp_size tp` cannot do with this run, each with its fix."""
    tp, world = parallelism.tp, parallelism.world_size
    if tp == 1:
        return []
    flag = f"--parallelism_config_tp_size {tp}"
    problems = []
    if not parallelism.fsdp:
        problems.append(f"{flag} runs combined with FSDP2: launch with `--use_fsdp --fsdp_version 2` "
                        "(configs/accelerate/fsdp2_tp.yaml)")
    if world % tp:
        problems.append(f"{flag} must divide the number of processes ({world})")
    elif parallelism.fsdp and parallelism.dp_shard < 2:
        replicas = parallelism.dp_replicate
        shards = world // (tp * replicas)
        fix = (f"pass --parallelism_config_dp_shard_size {shards} (dp_replicate × dp_shard × tp = {world} processes)"
               if shards >= 2 else f"launch at least {2 * tp * replicas} processes with dp_shard 2 or more")
        problems.append(f"{flag} needs FSDP2 to shard over at least 2 ranks (accelerate's rule for TP under FSDP): "
                        + fix)
    if train.sequence_parallel_size > 1:
        problems.append(f"{flag} with --sequence_parallel_size: Ulysses SP runs on DeepSpeed, TP on FSDP2; pick one")
    if lora.use_qlora:
        problems.append(f"{flag} with --use_qlora: 4-bit weights cannot be sliced into DTensors; use --use_lora")
    for name in ("num_attention_heads", "num_key_value_heads"):  # each layer's (Gemma 4's differ: per_layer_config)
        for heads in dict.fromkeys(h for h in layer_values(model_config, name) if h is not None):
            if heads % tp:
                problems.append(f"{flag} must divide the model's {name} ({heads}): each rank attends with 1/{tp} "
                                "of the heads")
    plan = getattr(model_config, "base_model_tp_plan", None) or {}
    if not plan:
        problems.append(f"{flag}: the model ({getattr(model_config, 'model_type', '?')}) has no tensor-parallel plan "
                        "in transformers (base_model_tp_plan); drop TP and shard with FSDP2 alone")
    elif getattr(text_config(model_config), "tie_word_embeddings", False):
        problems.append(tied_problem(flag))
    # the config's plan, before the model loads (the causal LM classes' own, for the LM head, use verified styles)
    untested = sorted(set(plan.values()) - VERIFIED_STYLES)
    if untested:
        problems.append(f"{flag}: {untested_styles(untested)}; drop TP and shard with FSDP2 alone")
    return problems


def apply(model: torch.nn.Module, tp_mesh: Any) -> list[str]:
    """Shard `model` (loaded whole, identical on every rank) with its transformers tp_plan over `tp_mesh`, the
    "tp" dimension of accelerate's device mesh; returns the names of the parameters the plan sharded.
    transformers resolves the plan (the model's `_tp_plan` and its config's `base_model_tp_plan`, expanded per
    layer), and its styles shard each weight and hook each module's forward."""
    from transformers.distributed import DistributedConfig
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    from open_sft.model.anatomy import is_peft_model

    causal_lm = model.get_base_model() if is_peft_model(model) else model
    tp_plan, _, _ = causal_lm._resolve_parallel_plans(DistributedConfig(tp_size=tp_mesh.size()))
    untested = sorted(set(tp_plan.values()) - VERIFIED_STYLES)
    if untested:
        raise UserError(f"tensor parallelism: {untested_styles(untested)}; drop --parallelism_config_tp_size and "
                        "shard the model with FSDP2 alone")
    parameters = dict(causal_lm.named_parameters())
    aliases = {name for name, _ in causal_lm.named_parameters(remove_duplicate=False)} - parameters.keys()
    if aliases & tp_plan.keys():  # tied weights the config did not announce (tensor_parallel_problems checks it)
        raise UserError(f"tensor parallelism: {tied_problem(f'--parallelism_config_tp_size {tp_mesh.size()}')} "
                        f"({', '.join(sorted(aliases & tp_plan.keys()))} is a second name of a weight)")
    modules = dict(causal_lm.named_modules())
    tp_plan = with_adapters(tp_plan, modules)
    for name, style in tp_plan.items():
        if style == PER_HEAD and name in modules:  # see ReplicateParallel: its input is marked sharded instead
            modules[name]._open_sft_heads_sharded = True
    apply_tensor_parallelism(causal_lm, tp_mesh, {n: s for n, s in tp_plan.items() if s != PER_HEAD})
    parameters = dict(causal_lm.named_parameters())
    return sorted(name for name in tp_plan if name in parameters)


def with_adapters(tp_plan: dict[str, str], modules: dict[str, torch.nn.Module]) -> dict[str, str]:
    """The plan for a model whose layers peft's LoRA wrapped: a planned module that is a LoRA layer keeps its
    style on the layer it wraps (`base_layer`), and one adapter matrix is sliced to match. Colwise (the output
    sliced): lora_B's output columns, so the adapter adds this rank's slice of the update; lora_A, full input
    to rank r, stays whole. Rowwise (the input sliced): lora_A's input rows, whose partial products the style
    sums as it does the base layer's; lora_B stays whole. The whole matrices are replicated (accelerate's
    `prepare` under TP)."""
    planned = {}
    for name, style in tp_plan.items():
        module = modules.get(name)
        if module is None or not hasattr(module, "base_layer") or not hasattr(module, "lora_A"):
            planned[name] = style
            continue
        if style not in ("colwise", "rowwise"):
            raise UserError(f"tensor parallelism: LoRA on {name}, which the model's tp_plan shards {style!r}, is not "
                            "supported; leave it out of --lora_target_modules")
        sliced = "lora_B" if style == "colwise" else "lora_A"
        targets = [f"{name}.base_layer"] + [f"{name}.{sliced}.{adapter}" for adapter in getattr(module, sliced)]
        for target in targets:
            for param, _ in modules[target].named_parameters(recurse=False):
                planned[f"{target}.{param}"] = style
            planned[target] = style
    return planned


class ReplicateParallel:
    """What accelerate 1.15's FSDP2 + TP `prepare` imports from transformers.integrations.tensor_parallel (removed
    in transformers 5) to hook each module that owns a parameter outside the tp_plan (embeddings, norms):
    accelerate makes the parameter a replicated DTensor of the TP mesh, and this hook turns the module's tensor
    inputs into replicated DTensors and its outputs back into plain tensors, so the layers around it (which
    exchange plain tensors, as transformers' TP styles do) are untouched. Every rank of a TP group computes the
    same replicated gradient for such a parameter: the gradient reaching it was all-reduced by the colwise
    layers' input redistribution.

    A per-head norm (`PER_HEAD`) gets its input marked sharded on the heads dimension instead: its weight's
    gradient is then a partial sum over this rank's heads, which DTensor knows to add up across the TP group
    (FSDP2 redistributes it to the parameter's replicated placement). transformers' own style for it all-reduces
    a plain tensor's gradient in a hook, which cannot run on accelerate's DTensor parameter."""

    def prepare_module_tp(self, module: torch.nn.Module, mesh: Any) -> None:
        if getattr(module, "_open_sft_replicated", False):  # accelerate calls once per parameter of a module
            return
        from torch.distributed.tensor import DTensor, Replicate, Shard

        heads_sharded = getattr(module, "_open_sft_heads_sharded", False)  # [..., heads, head_dim]

        def to_dtensor(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
                placement = Shard(value.ndim - 2) if heads_sharded else Replicate()
                return DTensor.from_local(value, mesh, [placement], run_check=False)
            return value

        def to_local(value: Any) -> Any:
            return value.to_local() if isinstance(value, DTensor) else value

        def before(_module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            return tuple(to_dtensor(a) for a in args), {k: to_dtensor(v) for k, v in kwargs.items()}

        def after(_module: Any, _args: Any, output: Any) -> Any:
            return tuple(to_local(o) for o in output) if isinstance(output, tuple) else to_local(output)

        module.register_forward_pre_hook(before, with_kwargs=True)
        module.register_forward_hook(after)
        module._open_sft_replicated = True


def provide_replicate_parallel() -> None:
    """Give accelerate's FSDP2 + TP `prepare` the ReplicateParallel it imports, when transformers lacks it."""
    import transformers.integrations.tensor_parallel as hf_tensor_parallel

    if not hasattr(hf_tensor_parallel, "ReplicateParallel"):
        hf_tensor_parallel.ReplicateParallel = ReplicateParallel


def group_ranks(accelerator: Any) -> list[int]:
    """The global ranks of this rank's TP group, in TP order (all ranks compute the same inputs)."""
    return torch.distributed.get_process_group_ranks(accelerator.torch_device_mesh["tp"].get_group())


def shard_model(accelerator: Any, model: torch.nn.Module, tp: int) -> str:
    """Apply the model's tp_plan on the accelerator's "tp" mesh dimension (of `tp` ranks); the log line saying what
    was sharded."""
    names = apply(model, accelerator.torch_device_mesh["tp"])
    provide_replicate_parallel()
    return (f"tensor parallel {tp}: {len(names)} weights sharded by the model's tp_plan (this rank holds 1/{tp} of "
            f"each); TP group ranks {group_ranks(accelerator)}")
