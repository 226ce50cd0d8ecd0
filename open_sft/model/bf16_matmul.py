"""bf16 numerics at fp32 speed, for CPUs whose bf16 matmuls are emulated in software.

Without avx512_bf16/AMX, PyTorch's CPU bf16 GEMMs run far below fp32 (measured on AVX2: bf16
`F.linear` ~6-13× slower than fp32, and the `grad @ weight` layout of a linear's input gradient ~150×),
so a bf16 step there is dominated by a few pathological kernels. A bf16 matmul with fp32 accumulation
(what oneDNN's native bf16 kernels compute) equals an fp32 matmul of the same bf16-rounded operands up
to summation order: so here each nn.Linear rounds its input, weight and output to bf16 exactly as
autocast would, and multiplies in fp32, where the CPU is fast. What autocast saves for backward (bf16
activations) and the dtypes downstream (bf16 outputs, gradients cast back to the parameters' dtype)
stay the same; only the kernels change. torch's autocast cannot be told to pick other kernels, hence
this module. The fused LM-head loss does the same (`fused_ce`, flag set on the head by `install`).
"""

from __future__ import annotations

import os
import types
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from open_sft.errors import UserError

ENV = "OPEN_SFT_BF16_MATMULS"  # auto (measured, the default) | fp32 | native
MODES = ("auto", "fp32", "native")
FLAG = "_open_sft_bf16_via_fp32"  # set on each installed module; read by the fused LM-head loss


def mode_from_env() -> str:
    mode = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise UserError(f"{ENV}={mode!r} is not one of {', '.join(MODES)} (auto: fp32 kernels where the probe "
                        "measures bf16 matmuls slower than fp32)")
    return mode


def _rounded(t: torch.Tensor) -> torch.Tensor:
    """`t` rounded to bf16, as an fp32 tensor for the fast kernels."""
    return t.to(torch.bfloat16).to(torch.float32)


class _Bf16LinearViaFp32(torch.autograd.Function):
    """F.linear under bf16 autocast (bf16 operands and result, fp32 accumulation), multiplied in fp32."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            x16 = x.to(torch.bfloat16)
            out = F.linear(x16.to(torch.float32), _rounded(weight), None if bias is None else _rounded(bias))
        # The parameter itself is saved, not a cast copy: ZeRO-3 frees and re-gathers it around backward.
        ctx.save_for_backward(x16, weight)
        ctx.dtypes = (x.dtype, None if bias is None else bias.dtype)
        return out.to(torch.bfloat16)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x16, weight = ctx.saved_tensors
        x_dtype, bias_dtype = ctx.dtypes
        need_x, need_w, need_b = ctx.needs_input_grad
        grad_x = grad_w = grad_b = None
        with torch.autocast(grad.device.type, enabled=False):
            g = _rounded(grad)  # the incoming gradient of a bf16 output is bf16
            if need_x:
                grad_x = (g @ _rounded(weight)).to(torch.bfloat16).to(x_dtype)
            if need_w or need_b:
                g2 = g.reshape(-1, g.shape[-1])
            if need_w:
                grad_w = (g2.t() @ x16.reshape(-1, x16.shape[-1]).to(torch.float32)).to(torch.bfloat16)
                grad_w = grad_w.to(weight.dtype)
            if need_b:
                grad_b = g2.sum(0).to(torch.bfloat16).to(bias_dtype)
        return grad_x, grad_w, grad_b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    return _Bf16LinearViaFp32.apply(x, weight, bias)


def _bf16_autocast(device: str) -> bool:
    return torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == torch.bfloat16


def _forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    # Only where the matmul would be bf16: autocast to bf16, or bf16 weights (DeepSpeed's bf16 mode).
    device = x.device.type
    bf16 = _bf16_autocast(device) if torch.is_autocast_enabled(device) else module.weight.dtype == torch.bfloat16
    return linear(x, module.weight, module.bias) if bf16 else F.linear(x, module.weight, module.bias)


def _sdpa_via_fp32(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: Optional[torch.Tensor], **kwargs):
    """transformers' sdpa attention with bf16 inputs run in fp32 (the CPU flash kernel's bf16 backward is
    ~25x slower than fp32 where bf16 is emulated), its output rounded back to bf16."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    device = query.device.type
    # Under autocast, sdpa casts its (often fp32, after rotary) inputs to bf16: the same rounding here.
    if not (_bf16_autocast(device) or query.dtype == torch.bfloat16):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()
    with torch.autocast(device, enabled=False):
        out, weights = sdpa_attention_forward(module, _rounded(query), _rounded(key), _rounded(value),
                                              attention_mask, **kwargs)
    return out.to(torch.bfloat16), weights


def _route_sdpa(model: nn.Module) -> None:
    """Models look their attention function up by name at every call, in one process-wide table: the
    "sdpa" entry is replaced there (it changes nothing for inputs that are not bf16)."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) == "sdpa":
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        ALL_ATTENTION_FUNCTIONS["sdpa"] = _sdpa_via_fp32


def install(model: nn.Module) -> int:
    """Route every plain nn.Linear of `model` (LoRA adapters included; quantized layers, which are
    subclasses, keep their own kernels) through the fp32-kernel bf16 path; returns how many. Not a
    tensor-parallel layer (a DTensor weight): TP wraps its forward to turn inputs into DTensors, which
    replacing the forward would undo (it keeps torch's bf16 kernels)."""
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear and not getattr(module, FLAG, False) and not isinstance(module.weight, DTensor):
            module.forward = types.MethodType(_forward, module)  # a bound method: deepcopy rebinds it
            setattr(module, FLAG, True)
            count += 1
    _route_sdpa(model)
    return count


def installed(module: nn.Module) -> bool:
    return bool(getattr(module, FLAG, False))
