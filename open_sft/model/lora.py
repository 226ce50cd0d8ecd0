"""LoRA and QLoRA through peft: the adapter config and the 4-bit base. What a LoRA run saves is written by
open_sft.export.save.save_lora, and merged by open_sft.export.lora_merge.

Saving works from the gathered full state dict (keys as in `PeftModel.state_dict()`, e.g.
`base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight`), never from the live
modules, because under ZeRO-3 those hold only shards. The one exception is QLoRA's 4-bit base
weights, which are dequantized from their modules: QLoRA never runs under DeepSpeed, so they are whole.

Output directory of a LoRA / QLoRA run:
    adapter_config.json, adapter_model.safetensors   the adapter (peft format; base = --model_name_or_path)
    tokenizer files, generation_config.json
    merged/                                          only with --merge_lora_on_save: the full model
                                                     (config.json, model*.safetensors, tokenizer, generation
                                                     config) with W + (alpha/r)·B·A; a QLoRA base is
                                                     dequantized and the merge saved in bf16
The top level has no config.json: `AutoModelForCausalLM.from_pretrained(output_dir)` loads the base
named in adapter_config.json and applies the adapter, and it would do so on top of a merged model that
sat beside the adapter (the delta counted twice), so the merged model lives in its own directory. A run that
added tokens grew the embeddings to len(tokenizer) and its adapter holds their rows (trainable tokens), not the
frozen embedding: it loads onto the base resized to len(tokenizer) (peft's AutoPeftModelForCausalLM does so).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from typing import TYPE_CHECKING, Any, Iterator, Optional

import torch
from torch import nn
from transformers import BitsAndBytesConfig, PreTrainedModel

from open_sft.config.args import LoraArguments
from open_sft.errors import UserError
from open_sft.model.anatomy import decoder_layers, outside_text_path, param_numel
from open_sft.model.lora_targets import (describe, linear_routers, linear_targets_kept, parameter_targets,
                                        split_targets)

# peft is imported where a LoRA run calls it, not here: every run imports this module (load_model asks
# uses_lora), and `import peft` imports bitsandbytes, whose ops module sets up torch.compile, several seconds
# of CPU per rank at every start for runs that never touch an adapter.
if TYPE_CHECKING:
    from peft import LoraConfig, PeftModel

logger = logging.getLogger(__name__)

ADAPTER = "default"  # peft's adapter name; saved files drop it from the keys
PEFT_PREFIX = "base_model.model."  # PeftModel state-dict keys = this + the base model's keys
# peft's _check_lora_target_modules_mamba: LoRA on a layer of these names in these model types raises
PEFT_MAMBA_TYPES = frozenset({"falcon_h1", "mamba", "mamba2", "falcon_mamba", "nemotron_h"})
PEFT_MAMBA_REFUSED = frozenset({"out_proj", "conv1d"})
# Mamba mixers whose torch path reads dt_proj's weight directly (`dt_proj.weight @ time_step`, transformers 5.25):
# an adapter there never runs, so it trains nothing. Falcon-Mamba's and Jamba's call the layer when quantized.
WEIGHT_READ_DT_PROJ = {"mamba": True, "falcon_mamba": False, "jamba": False}  # model type: also when quantized


def uses_lora(args: LoraArguments) -> bool:
    return args.use_lora or args.use_qlora


def quantization_config(args: LoraArguments, fp16: bool = False) -> Optional[BitsAndBytesConfig]:
    """4-bit NF4 with double quantization and bf16 compute (fp16 where the run computes in fp16: GPUs without
    bf16), or None without --use_qlora."""
    if not args.use_qlora:
        return None
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.float16 if fp16 else torch.bfloat16)


def quantized_device() -> str:
    """Where this rank loads a 4-bit model: its GPU as accelerate picks it (the local rank modulo the GPUs this
    process sees: under SLURM's --gpus-per-task=1 each rank sees one, cuda:0, whatever its LOCAL_RANK), or the CPU."""
    if not torch.cuda.is_available():
        return "cpu"
    return f"cuda:{int(os.environ.get('LOCAL_RANK', '0')) % torch.cuda.device_count()}"


def lora_config(args: LoraArguments, trainable_tokens: Optional[dict[str, list[int]]] = None,
                dropout: Optional[float] = None, targets: Optional[tuple[Any, list[str]]] = None,
                exclude: Optional[str] = None) -> LoraConfig:
    """`targets`: (target_modules, target_parameters) as open_sft.model.lora_targets.split_targets resolves
    --lora_target_modules on the model; by default the flag's names as modules. `exclude`: modules peft leaves
    alone (a multimodal model's vision tower: outside_text_modules)."""
    from peft import LoraConfig

    names = args.lora_target_modules
    modules, parameters = targets or ("all-linear" if names == ["all-linear"] else list(names), [])
    return LoraConfig(
        r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout if dropout is None else dropout,
        bias="none", target_modules=modules, target_parameters=parameters or None, task_type="CAUSAL_LM",
        trainable_token_indices=trainable_tokens or None, exclude_modules=exclude,
    )


def outside_text_modules(model: PreTrainedModel, mamba_kept: Optional[list[str]] = None) -> Optional[str]:
    """A regex (peft's exclude_modules) of the modules text never runs, a multimodal model's vision tower and
    projector: adapters there would get no gradient (their q_proj and fc1 match all-linear and named targets); of
    the routers adapted as a weight that peft would also take for linear layers (lora_targets.linear_routers); and
    of `mamba_kept`, the Mamba blocks' layers all-linear leaves to peft's refusal (mamba_layers_refused)."""
    parts = {id(part) for part in outside_text_path(model).values()}
    names = [rf"{re.escape(name)}(\..*)?" for name, module in model.named_modules() if id(module) in parts]
    names += [re.escape(name) for name in linear_routers(model) + (mamba_kept or [])]
    return "|".join(f"({name})" for name in names) if names else None


def mamba_layers_refused(model: PreTrainedModel, names: list[str], quantized: bool = False) -> list[str]:
    """The layers all-linear leaves without an adapter on a model peft keeps LoRA off its Mamba blocks' out_proj and
    conv1d (Falcon-H1, Mamba, Mamba-2, Falcon-Mamba, Nemotron-H: peft refuses the whole adapter if one is targeted,
    as the fused Mamba kernels read those weights directly), and dt_proj where the mixer reads its weight itself
    (WEIGHT_READ_DT_PROJ: the adapter would get no gradient); none for targets the user named."""
    model_type = getattr(model.config, "model_type", None)
    left = set(PEFT_MAMBA_REFUSED) if model_type in PEFT_MAMBA_TYPES else set()
    if model_type in WEIGHT_READ_DT_PROJ and (WEIGHT_READ_DT_PROJ[model_type] or not quantized):
        left.add("dt_proj")
    if names != ["all-linear"] or not left:
        return []
    kept = [name for name, module in model.named_modules()
            if name.rsplit(".", 1)[-1] in left and isinstance(module, nn.Linear)]
    if kept:
        leaves = "/".join(sorted({name.rsplit(".", 1)[-1] for name in kept}))
        logger.info("all-linear leaves the Mamba blocks' %s without an adapter (%d of the linear layers): peft does "
                    "not adapt them in this model type, or the model reads the weight itself", leaves, len(kept))
    return kept


def trainable_token_rows(model: PreTrainedModel, new_ids: list[int]) -> dict[str, list[int]]:
    """peft's trainable tokens for the rows of tokens the run added (a chat template's end-of-turn token, say):
    under LoRA they would otherwise keep their mean initialisation and the model never learns to end a turn.
    The input embedding and an untied LM head by module name (peft wraps a tied head with the embedding)."""
    if not new_ids:
        return {}
    names = {id(module): name.rsplit(".", 1)[-1] for name, module in model.named_modules()}
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    rows = {names[id(embedding)]: list(new_ids)}
    tied = head is None or head.weight is embedding.weight
    if not tied:
        rows[names[id(head)]] = list(new_ids)
    return rows


def apply_lora(model: PreTrainedModel, args: LoraArguments, new_ids: Optional[list[int]] = None,
               dropout_given: bool = True) -> PeftModel:
    """Freeze the base model and inject LoRA adapters in place (and make the rows of `new_ids`, tokens the run
    added, trainable); returns the PeftModel. `dropout_given`: --lora_dropout was set by the user (else its
    default yields to 0 where peft adapts MoE experts' fused weights, which it trains only without dropout)."""
    from peft import get_peft_model, prepare_model_for_kbit_training

    from open_sft.model.base_record import base_model_record

    if args.use_qlora:
        # Activation checkpointing is load_model's (non-reentrant, so no input needs a gradient): peft enabling it
        # again warned on every QLoRA run with --gradient_checkpointing, by either name of its kwargs (peft 0.22
        # deprecates `gradient_checkpointing_kwargs`; peft 0.21 calls transformers' deprecated
        # `gradient_checkpointing_enable`)
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        _keep_4bit_layout_for_training(model)
    held = parameter_targets(model)  # an MoE's fused experts and plain router weights: peft target_parameters
    targets = split_targets(model, list(args.lora_target_modules))
    rows = trainable_token_rows(model, new_ids or [])
    check_head_bias_kept(model, rows, new_ids or [])
    try:
        dropout = None
        if not dropout_given and args.lora_dropout and targets[1]:
            logger.warning("LoRA dropout 0 for every adapter (not the default %g): --lora_target_modules %s adapts "
                           "this MoE model's %s, weights held as parameters, which peft trains only without dropout "
                           "(name the modules to adapt, e.g. --lora_target_modules q_proj k_proj v_proj o_proj, to "
                           "leave them out)", args.lora_dropout, " ".join(args.lora_target_modules),
                           ", ".join(targets[1]))
            dropout = 0.0
        exclude = outside_text_modules(model, mamba_layers_refused(model, list(args.lora_target_modules),
                                                                   args.use_qlora))
        with _trainable_tokens_off_cuda(model if rows else None), linear_targets_kept():
            peft_model = get_peft_model(model, lora_config(args, rows, dropout, targets, exclude))
        said = describe(peft_model, held)
        if said:
            logger.info("%s", said)
        peft_config = peft_model.peft_config[ADAPTER]  # a local base by its absolute path, loadable from anywhere
        peft_config.base_model_name_or_path = base_model_record(peft_config.base_model_name_or_path or "") or None
        if isinstance(peft_config.target_modules, (set, frozenset)):  # peft writes a set (all-linear resolved) in
            peft_config.target_modules = sorted(peft_config.target_modules)  # hash order: identical runs' differed
        if rows:
            logger.info("LoRA also trains the embedding rows of the %d added tokens (%s)", len(new_ids),
                        ", ".join(rows))
    except ValueError as exc:
        targets = " ".join(args.lora_target_modules)
        if _experts_need_no_dropout(exc):
            raise UserError(f"--lora_target_modules {targets} adapts this MoE model's experts, whose fused weights "
                            "peft trains only without dropout: pass --lora_dropout 0, or name the modules to adapt "
                            "(e.g. q_proj k_proj v_proj o_proj) to leave the experts out") from None
        fix = ("peft cannot adapt every linear layer of this model (a Mamba block's in/out projections, say): name "
               "the modules to adapt, e.g. --lora_target_modules q_proj k_proj v_proj o_proj"
               if args.lora_target_modules == ["all-linear"] else
               "name linear layers of the model (e.g. q_proj v_proj) or use all-linear")
        raise UserError(f"--lora_target_modules {targets}: {exc}; {fix}") from exc
    trainable = sum(param_numel(p) for p in peft_model.parameters() if p.requires_grad)
    total = sum(param_numel(p) for p in peft_model.parameters())
    logger.info("%s: %d trainable adapter parameters of %d (%.3f%%)", "QLoRA" if args.use_qlora else "LoRA",
                trainable, total, 100 * trainable / max(total, 1))
    return peft_model


def peft_drops_head_bias(model: PreTrainedModel) -> bool:
    """Whether this peft computes the LM head of `model` without its bias once the head holds trainable tokens (the
    rows of tokens a run added): peft before 0.22 does, on a model whose LM head has a bias (Phi-1/1.5/2, GPT-J,
    CodeGen), so every logit is off by the bias, and the export (which has it) is not the model peft computes."""
    import peft
    from packaging.version import Version

    head = model.get_output_embeddings()
    return (head is not None and getattr(head, "bias", None) is not None
            and Version(peft.__version__) < Version("0.22"))


def check_head_bias_kept(model: PreTrainedModel, rows: dict[str, list[int]], new_ids: list[int]) -> None:
    """A run that would train on logits without the LM head's bias (peft_drops_head_bias) is refused, with the fix."""
    import peft

    if not rows or not peft_drops_head_bias(model):
        return
    raise UserError(f"LoRA with tokens this run adds ({len(new_ids)}; their embedding rows train as peft trainable "
                    f"tokens) on a model whose LM head has a bias needs peft >= 0.22: peft {peft.__version__} "
                    "leaves the bias out of the logits it trains on, so the exported model (which has it) would not be "
                    "the trained one. Upgrade peft (pip install -U 'peft>=0.22'; it needs Python >= 3.11), or add no "
                    "tokens (a chat template whose tokens the tokenizer has; no --add_tokens/--add_special_tokens)")


def _keep_4bit_layout_for_training(model: torch.nn.Module) -> None:
    """bitsandbytes (0.48 on) repacks a 4-bit layer's weight for its AVX512-BF16 inference kernel the first time
    the layer runs in eval mode without grad on a CPU that has AVX512-BF16 (a QLoRA run's first evaluation), and
    keeps it so: every later forward, training included, then goes through that kernel, which has no backward,
    so the gradient through every frozen 4-bit layer to the adapters below it would be silently dropped (torch
    warns "an autograd kernel was not registered ... may lead to silently incorrect behavior"). A training run
    keeps the layout the backward needs; generation (open_sft generate/chat) loads its own model and keeps it."""
    import bitsandbytes as bnb

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False


@contextlib.contextmanager
def _trainable_tokens_off_cuda(model: Optional[torch.nn.Module]) -> Iterator[None]:
    """peft sets up the trainable rows of added tokens on a ZeRO-3-partitioned embedding by gathering it and
    broadcasting the rows from rank 0 into a buffer it places on CUDA ("only CUDA is implemented"), so a CPU run
    under ZeRO-3 (gloo) stopped there. Where there is no CUDA, each rank takes the rows from the gathered weight
    itself (every rank gathers the same whole weight), for the duration of get_peft_model."""
    partitioned = model is not None and any(getattr(p, "ds_numel", None) is not None for p in model.parameters())
    if not partitioned or torch.cuda.is_available():
        yield
        return
    import deepspeed
    from peft.tuners.trainable_tokens.layer import TrainableTokensLayer

    def rows_of_gathered(self, weight: torch.Tensor, rows: torch.Tensor, embed_dim: int) -> torch.Tensor:
        with deepspeed.zero.GatheredParameters([weight], modifier_rank=None):
            return weight[rows].clone()

    original = TrainableTokensLayer._collect_token_weights
    TrainableTokensLayer._collect_token_weights = rows_of_gathered
    try:
        yield
    finally:
        TrainableTokensLayer._collect_token_weights = original


def _experts_need_no_dropout(exc: ValueError) -> bool:
    """peft's refusal of dropout on parameters it wraps directly (ParamWrapper: MoE experts' fused 3-D weights)."""
    return "ParamWrapper" in str(exc) and "dropout" in str(exc)


def frozen_base_in_compute_dtype(model: nn.Module, compute_dtype: torch.dtype, source_config: Any,
                                 parallelism: Any) -> int:
    """LoRA's frozen base weights of the decoder layers kept in the compute dtype (bf16) instead of fp32, where the
    checkpoint (`source_config`) stored them in it, in one process or under DDP; returns the bytes saved.

    A frozen weight is never updated, so it needs no fp32 master copy: held in fp32, autocast casts it to bf16 at
    every forward (and, requiring no gradient, keeps no cached copy between passes), which on an 8B model is 16 GB
    more memory and a full read and write of the weights per micro-batch. Where the checkpoint holds bf16, the fp32
    copy is that bf16 value exactly, so the bf16 weight is the same number: the matmuls autocast runs see the same
    operands, and the losses and the adapters' gradients are bitwise those of the fp32 base (tested). Only the
    decoder layers' linear weights: the LM head, norms and embeddings keep their dtype (their outputs feed fp32
    work: the residual stream, the loss). Not under FSDP2 (it shards a layer's parameters as one dtype), DeepSpeed
    (it casts the whole model itself), TP, PP or SP."""
    from open_sft.model.precision import stored_dtype

    if (compute_dtype != torch.bfloat16 or stored_dtype(source_config) != torch.bfloat16
            or parallelism.engine not in ("single", "ddp") or parallelism.splits_model):
        return 0
    saved = 0
    for layer in decoder_layers(model):
        for module in layer.modules():
            if type(module) is not nn.Linear:
                continue
            for param in module.parameters(recurse=False):
                if not param.requires_grad and param.dtype == torch.float32:
                    param.data = param.data.to(compute_dtype)
                    saved += 2 * param.numel()
    if saved:
        logger.info("LoRA: the decoder layers' frozen base weights stay bf16, as the checkpoint stores them (no fp32 "
                    "master copy for weights that never change: %s less, no cast per forward)",
                    f"{saved / 2**30:.2f} GiB" if saved >= 2**30 else f"{saved / 2**20:.1f} MiB")
    return saved
