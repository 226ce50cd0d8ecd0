"""Loading the tokenizer and the model for training, with clear errors for bad paths and options."""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from open_sft.config import ModelArguments
from open_sft.errors import UserError

logger = logging.getLogger(__name__)


def compute_dtype(args: ModelArguments) -> torch.dtype:
    """--torch_dtype resolved: bf16 where the device supports it, unless the user said otherwise."""
    if args.torch_dtype in ("float32", "fp32"):
        return torch.float32
    if args.torch_dtype in ("bfloat16", "bf16"):
        return torch.bfloat16
    if torch.cuda.is_available():
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    return torch.bfloat16


def attn_implementation(args: ModelArguments) -> str:
    cuda = torch.cuda.is_available()
    has_flash = importlib.util.find_spec("flash_attn") is not None
    if args.attn_implementation == "auto":
        return "flash_attention_2" if cuda and has_flash else "sdpa"
    if args.attn_implementation == "flash_attention_2" and not (cuda and has_flash):
        raise UserError(
            "--attn_implementation flash_attention_2 needs a CUDA GPU and the flash-attn package "
            f"(CUDA available: {cuda}, flash-attn installed: {has_flash}); use --attn_implementation sdpa"
        )
    return args.attn_implementation


def check_liger(args: ModelArguments) -> None:
    if args.use_liger_kernel and not torch.cuda.is_available():
        raise UserError(
            "--use_liger_kernel needs a CUDA GPU (Liger's kernels are written in Triton); this machine has no "
            "CUDA device. Drop --use_liger_kernel: open_sft's own loss path already avoids full logits on CPU"
        )
    if args.use_liger_kernel and importlib.util.find_spec("liger_kernel") is None:
        raise UserError("--use_liger_kernel needs the liger-kernel package: pip install 'open_sft[liger]'")


def _hub_kwargs(args: ModelArguments) -> dict[str, Any]:
    return {"revision": args.model_revision, "trust_remote_code": args.trust_remote_code}


def load_tokenizer(args: ModelArguments) -> PreTrainedTokenizerBase:
    name = args.tokenizer_name_or_path or args.model_name_or_path
    flag = "--tokenizer_name_or_path" if args.tokenizer_name_or_path else "--model_name_or_path"
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, **_hub_kwargs(args))
    except (OSError, ValueError) as exc:
        raise UserError(f"{flag} {name}: could not load a tokenizer ({exc}); check the path or Hub id") from exc
    if tokenizer.pad_token_id is None:
        logger.warning("tokenizer has no pad token; using eos %r for padding (padding never gets a loss)",
                       tokenizer.eos_token)
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(args: ModelArguments) -> PreTrainedModel:
    """The model in fp32 (master weights); the compute dtype is applied by autocast or DeepSpeed."""
    check_liger(args)
    kwargs = _hub_kwargs(args)
    try:
        config = AutoConfig.from_pretrained(args.config_name or args.model_name_or_path, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(
            args.model_name_or_path, config=config, dtype=torch.float32,
            attn_implementation=attn_implementation(args), **kwargs,
        )
    except (OSError, ValueError) as exc:
        raise UserError(
            f"--model_name_or_path {args.model_name_or_path}: could not load the model ({exc}); "
            "check the path (a directory with config.json and weights) or the Hub id"
        ) from exc
    if args.use_liger_kernel:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model
