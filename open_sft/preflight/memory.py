"""The memory model: the bytes one rank will need, by component, from the model's shape and the run's (put
together for a run, beside the memory a rank has: open_sft.preflight.estimate).

The memory model is analytic so that it can warn before an out-of-memory, not after:

- parameters, gradients and optimizer states follow from the parameter counts, the dtype, the ZeRO stage
  (stage 2 partitions gradients and optimizer states over ranks, stage 3 the parameters too), offload and
  LoRA/QLoRA (frozen base weights have no gradient or optimizer state; 4-bit weights count packed bytes);
- activations follow from the largest micro-batch (tokens), the model shape and gradient checkpointing.
  The per-token coefficients were measured with `torch.autograd.graph.saved_tensors_hooks` on
  transformers' Llama with SDPA (tests/test_preflight.py re-measures them so a library change that
  breaks them fails a test);
- on CPU the process itself (interpreter, libraries, the memory-mapped data touched so far) is part of
  the resident set: it is measured when the estimate is made, before the model is loaded
  (open_sft.preflight.estimate.runtime_bytes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

# Saved-for-backward elements per token, fp32, parameters excluded (see the module docstring): per decoder
# layer 10 × hidden + 4 × intermediate (norms upcast to fp32, q/k/v and rotary copies, SDPA output, the
# SwiGLU MLP), plus 2.4 × hidden outside the layers (embedding output, final norm). With a padding mask
# SDPA also keeps ~1.8 × width elements per token and layer. Fitted within 7 % over 48 shapes.
LAYER_HIDDEN_COEF, LAYER_INTERMEDIATE_COEF, OUTSIDE_HIDDEN_COEF, MASK_WIDTH_COEF = 10.0, 4.0, 2.4, 1.8
# Under bf16 autocast the matmul outputs are bf16 but norms and the residual stream stay fp32: measured
# 0.65 of the fp32 bytes.
BF16_ACTIVATION_FACTOR = 0.65
# Backward holds the gradients of activations next to the saved tensors it has not freed yet, and the CPU
# allocator keeps freed blocks: the peak resident activation memory measured on CPU runs was ~1.4 × the
# saved bytes in fp32 and ~1.8 × under bf16 autocast (backward also makes fp32 copies of bf16 gradients).
# Gradient checkpointing holds one recomputed layer (and its gradients) at a time.
ACTIVATION_PEAK_FACTOR = {False: 1.4, True: 1.8}  # by bf16
# On a GPU the caching allocator's peak counts live tensors only: Llama-3.2-1B-shaped, 4 × 4,096 packed bf16
# tokens on an H200 peaked at 52.2 GiB, the saved bytes above plus states and loss at 1.0 give 56.0 (+7 %).
GPU_ACTIVATION_PEAK_FACTOR = 1.0
RECOMPUTED_LAYER_FACTOR = 2.0
# Liger's SwiGLU recomputes its activation in backward instead of keeping two intermediate-wide tensors in the
# compute dtype (measured on that H200 run: 8.1 GiB less, 4 bytes per token, layer and intermediate unit).
LIGER_SAVED_BYTES_PER_INTERMEDIATE = 4
# --torch_compile (GPU): Inductor's partitioner keeps fewer tensors for backward and recomputes the cheap
# elementwise ones: the same H200 run (commit d7433b0) peaked at 40.17 GiB compiled against 52.16 eager, the
# decoder's saved bytes down to 0.59 of eager's. Not measured on CPU, where the estimate stays eager's.
COMPILED_SAVED_FACTOR = 0.6


@dataclass(frozen=True)
class ModelShape:
    params: int  # every parameter
    trainable: int  # parameters the optimizer updates
    param_bytes: int  # bytes of the parameters as loaded (4-bit weights: their packed bytes)
    largest_param: int  # elements of the largest single tensor (gathered whole under ZeRO-3)
    matmul_params: int  # trainable parameters of 2-D weights (autocast keeps a bf16 copy of each)
    hidden: int
    layers: int
    intermediate: int
    vocab: int
    heads: int = 1
    lora_dropout_inputs: int = 0  # summed input widths of LoRA layers with dropout (each keeps a copy)

    @classmethod
    def of(cls, model: torch.nn.Module) -> "ModelShape":
        from open_sft.model.anatomy import layer_values, param_numel, param_shape, text_config

        config = text_config(model.config)  # a multimodal model's sizes are its text model's

        params = list(model.parameters())  # full sizes, also of a model loaded partitioned (ZeRO-3 init)
        hidden = config.hidden_size
        return cls(
            params=sum(param_numel(p) for p in params),
            trainable=sum(param_numel(p) for p in params if p.requires_grad),
            param_bytes=sum(param_numel(p) * p.element_size() for p in params),
            largest_param=max(param_numel(p) for p in params),
            matmul_params=sum(param_numel(p) for p in params if p.requires_grad and len(param_shape(p)) == 2),
            hidden=hidden, layers=config.num_hidden_layers,
            intermediate=_mlp_width(config) or 4 * hidden, vocab=config.vocab_size,
            heads=max(layer_values(config, "num_attention_heads", 1)), lora_dropout_inputs=_lora_dropout_inputs(model),
        )


def _mlp_width(config: Any) -> Optional[int]:
    """The widest MLP a layer runs: Llama 4's dense layers (those not in `moe_layers`: every other one in Maverick)
    are `intermediate_size_mlp` wide, twice its experts' `intermediate_size`."""
    widths = [_widest(getattr(config, "intermediate_size", None))]
    moe_layers = getattr(config, "moe_layers", None)
    if getattr(config, "intermediate_size_mlp", None) and isinstance(moe_layers, (list, tuple)) \
            and len(set(moe_layers)) < config.num_hidden_layers:
        widths.append(config.intermediate_size_mlp)
    return max((w for w in widths if w), default=None)


def _widest(intermediate: Any) -> Optional[int]:
    """The MLP width the activations peak at: Gemma-3n's configs give one per layer."""
    if isinstance(intermediate, (list, tuple)):
        return max((int(x) for x in intermediate), default=None)
    return intermediate


def _lora_dropout_inputs(model: torch.nn.Module) -> int:
    """peft's LoRA layers apply dropout to their input before lora_A: a new tensor per layer, saved."""
    total = 0
    for module in model.modules():
        dropout = getattr(module, "lora_dropout", None)
        if isinstance(dropout, torch.nn.ModuleDict) and any(
                not isinstance(d, torch.nn.Identity) for d in dropout.values()):
            total += getattr(module, "in_features", 0)
    return total


@dataclass(frozen=True)
class RunShape:
    """What the estimate depends on besides the model."""

    world_size: int
    zero_stage: int  # 0 without DeepSpeed
    offload: bool
    bf16: bool  # bf16 autocast (or DeepSpeed bf16) activations
    micro_batch_tokens: int  # token positions of the largest micro-batch (padding included)
    trained_tokens: int  # trained positions of that micro-batch (the LM-head loss runs on these)
    gradient_checkpointing: bool
    reduce_bucket_size: int = 0  # elements (DeepSpeed)
    attention_width: int = 0  # padded width of that micro-batch when it needs a padding mask, else 0
    fsdp: bool = False  # FSDP2 full sharding (zero_stage is 0 then)
    tensor_parallel: int = 1  # FSDP2 + TP: a gathered block holds 1/tp of its attention and MLP weights
    on_gpu: bool = False  # CUDA: the allocator's peak, the fused loss's GPU chunks
    liger: bool = False  # --use_liger_kernel (Liger's SwiGLU keeps less)
    liger_loss: bool = False  # Liger's fused linear cross-entropy is the LM-head loss (open_sft.model.liger_loss)
    compiled: bool = False  # --torch_compile


@dataclass
class MemoryEstimate:
    runtime: int
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.runtime + self.parameters + self.gradients + self.optimizer + self.activations

    def to_dict(self) -> dict[str, Any]:
        return {"runtime_bytes": self.runtime, "parameters_bytes": self.parameters,
                "gradients_bytes": self.gradients, "optimizer_bytes": self.optimizer,
                "activations_bytes": self.activations, "total_bytes": self.total, "notes": self.notes}


def _model_states(model: ModelShape, run: RunShape) -> tuple[int, int, int, list[str]]:
    """Bytes of parameters, gradients and optimizer states per rank."""
    ws, trainable = run.world_size, model.trainable
    notes = []
    adam = 8 * trainable  # exp_avg and exp_avg_sq in fp32
    if run.fsdp:
        return _fsdp_states(model, run, adam)
    if run.zero_stage == 0:
        params = model.param_bytes + (2 * model.matmul_params if run.bf16 else 0)  # autocast's bf16 copies
        grads = 4 * trainable
        # torch's foreach/fused AdamW keeps one parameter-sized temporary while it steps (on CPU, where the peak
        # is resident memory; on a GPU the fused step's temporaries are not live with the activations' peak)
        return params, grads, adam + (0 if run.on_gpu else 4 * trainable), notes
    frozen_bytes = model.param_bytes - 4 * trainable  # LoRA: the frozen base, as loaded
    low = 2 if run.bf16 else 4  # DeepSpeed casts the module to bf16 when bf16 is on
    master = 4 * trainable // ws  # fp32 master partition (a separate copy even in fp32)
    if run.zero_stage >= 3:
        gathered = low * model.largest_param * 2  # the live gathered parameters of the current module
        params = (low * trainable + max(frozen_bytes, 0) * low // 4) // ws + master + gathered
        notes.append("ZeRO-3: parameters partitioned over ranks, gathered one module at a time")
    else:
        params = low * trainable + max(frozen_bytes, 0) * low // 4 + master
    grads = (low + 4) * trainable // ws + low * model.largest_param + low * run.reduce_bucket_size
    optimizer = adam // ws
    if run.offload:
        notes.append("offload: optimizer states and master weights live in host memory (counted here)")
    return params, grads, optimizer, notes


def _fsdp_states(model: ModelShape, run: RunShape, adam: int) -> tuple[int, int, int, list[str]]:
    """FSDP2 full sharding: every parameter, gradient and optimizer state sharded over the ranks; a transformer
    block gathered (in the compute dtype) while it runs and the next one prefetched; the root unit (embeddings,
    final norm, LM head) gathered for the whole step."""
    ws, trainable = run.world_size, model.trainable
    block = max(model.params - 2 * model.vocab * model.hidden, 0) // max(model.layers, 1)
    root = max(model.params - model.layers * block, 0)
    low = 2 if run.bf16 else 4
    frozen_bytes = max(model.param_bytes - 4 * trainable, 0)
    block //= run.tensor_parallel  # under TP FSDP2 gathers a block's slices only (its norms are counted sliced too)
    params = (4 * trainable + frozen_bytes) // ws + low * (root + 2 * block)
    grads = 4 * trainable // ws + 4 * min(trainable, root + block)  # the unit's full gradient before reduce-scatter
    notes = [f"FSDP2: parameters, gradients and optimizer states sharded over {ws} rank(s), one transformer block "
             "gathered at a time" + (f" (its 1/{run.tensor_parallel} tensor-parallel slice)"
                                     if run.tensor_parallel > 1 else "")]
    if run.offload:
        notes.append("offload: sharded parameters, gradients and optimizer states live in host memory (counted here)")
    return params, grads, adam // ws + 4 * trainable // ws, notes


def saved_activation_bytes(model: ModelShape, run: RunShape) -> int:
    """Bytes the decoder's forward keeps for backward on the largest micro-batch (without checkpointing;
    with it, the layer inputs plus one recomputed layer and its gradients)."""
    per_layer = LAYER_HIDDEN_COEF * model.hidden + LAYER_INTERMEDIATE_COEF * model.intermediate
    per_layer += MASK_WIDTH_COEF * run.attention_width
    outside = OUTSIDE_HIDDEN_COEF * model.hidden
    factor = BF16_ACTIVATION_FACTOR if run.bf16 else 1.0
    tokens = run.micro_batch_tokens
    if run.gradient_checkpointing:  # layer inputs (the fp32 residual stream) + one layer at a time
        saved = tokens * (4 * model.hidden * model.layers + 4 * factor * (RECOMPUTED_LAYER_FACTOR * per_layer + outside))
    else:
        eager = tokens * 4 * factor * (model.layers * per_layer + outside)
        saved = eager
        if run.liger:
            saved -= tokens * model.layers * LIGER_SAVED_BYTES_PER_INTERMEDIATE * model.intermediate
        if run.compiled and run.on_gpu:  # with Liger too, the larger of the two (that pairing was not measured)
            saved = max(saved, COMPILED_SAVED_FACTOR * eager) if run.liger else COMPILED_SAVED_FACTOR * eager
    return int(saved + tokens * 5 * model.lora_dropout_inputs)  # LoRA: fp32 dropout output + its bool mask


def activation_bytes(model: ModelShape, run: RunShape) -> int:
    """Peak activation memory of one micro-batch's forward and backward, the fused LM-head loss included
    (its fp32 weight gradient and the logits of one chunk of rows; see open_sft/model/fused_ce.py)."""
    from open_sft.model import fused_ce, liger_loss

    compute_bytes = 2 if run.bf16 else 4
    loss = liger_loss.peak_bytes(model.vocab, model.hidden, run.trained_tokens, compute_bytes) if run.liger_loss \
        else fused_ce.peak_bytes(model.vocab, model.hidden, run.trained_tokens, compute_bytes, on_gpu=run.on_gpu)
    factor = GPU_ACTIVATION_PEAK_FACTOR if run.on_gpu else ACTIVATION_PEAK_FACTOR[run.bf16]
    return int(factor * saved_activation_bytes(model, run) + loss)


def estimate_memory(model: ModelShape, run: RunShape, runtime: int) -> MemoryEstimate:
    params, grads, optimizer, notes = _model_states(model, run)
    return MemoryEstimate(runtime, params, grads, optimizer, activation_bytes(model, run), notes)

