"""Loading the model for training, with clear errors for bad paths and options (the tokenizer: model/tokenizer.py)."""

from __future__ import annotations

import importlib.util
import logging
import math
from typing import Any, Optional

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from open_sft.config.args import LoraArguments, ModelArguments
from open_sft.errors import UserError
from open_sft.model.anatomy import layer_values, outside_text_path, param_numel, param_shape, text_config
from open_sft.model.source import unreachable_problem

logger = logging.getLogger(__name__)
EMBEDDING_MULTIPLE = 64  # rows a full model's grown embedding is padded to
FLASH_MAX_HEAD_DIM = 256  # flash-attn 2's kernels


def attn_implementation(args: ModelArguments, config: Any = None) -> str:
    """The kernel `auto` stands for here: flash-attn on a GPU (Ampere or later) that has the package, else sdpa, for a
    model class that supports it; a class that does not (Gemma-2, gpt-oss, Bloom, MPT, XGLM: transformers refuses sdpa
    for them) gets eager attention, as transformers' own default gives it, and so does a class whose attention
    flash-attn 2 does not compute (`flash_attention_problem`: gpt-oss's sinks). An explicit choice was checked against
    the machine up front (config.checks), and flash_attention_2 against the model (config.launch_check); refused here
    too."""
    model_class = _model_class(config)
    flash_problem = flash_attention_problem(config)
    if args.attn_implementation == "flash_attention_2" and flash_problem:
        raise UserError(flash_problem)
    if args.attn_implementation != "auto":
        return args.attn_implementation
    has_flash = importlib.util.find_spec("flash_attn") is not None
    # flash-attn 2 runs on Ampere (compute capability 8.0) and later GPUs only
    ampere = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)
    if ampere and has_flash and getattr(model_class, "_supports_flash_attn", True) and not flash_problem:
        return "flash_attention_2"
    if getattr(model_class, "_supports_sdpa", True):
        return "sdpa"
    logger.info("attention: eager (%s does not support sdpa)", model_class.__name__)
    return "eager"


def flash_attention_problem(config: Any, given: str = "--attn_implementation flash_attention_2") -> Optional[str]:
    """Why flash-attn 2 does not compute the attention of the model class of this config, with the fix; None where it
    does or the class is not known here (remote code). `given`: the flags that asked for it as the user typed them
    (open-instruct's --use_flash_attn is dropped, not contradicted). Learned attention sinks (gpt-oss, MiMo-V2-Flash,
    Granite-SWA, Flint: their attention passes `s_aux`): flash-attn 2 takes no sink, and transformers drops them
    there, or, for a class that lists the flash kernels computing it (`_compatible_flash_implementations`: gpt-oss's
    in transformers 5.25), swaps one of those in, code fetched from the Hub as the model loads (offline, the load
    fails)."""
    model_class = _model_class(config)
    if model_class is None:
        return None
    widest = max((d for d in layer_values(text_config(config), "head_dim") if isinstance(d, int)), default=0)
    if widest > FLASH_MAX_HEAD_DIM:  # Gemma 4's full-attention layers: 512
        return (f"{given}: {model_class.__name__}'s attention heads are up to {widest} wide, over the "
                f"{FLASH_MAX_HEAD_DIM} flash-attn 2 computes; {_flash_fix(given, 'sdpa')}")
    import inspect
    import sys

    kernels = getattr(model_class, "_compatible_flash_implementations", None)
    try:
        sinks = "s_aux=" in inspect.getsource(sys.modules[model_class.__module__])
    except (OSError, TypeError, KeyError):
        sinks = False
    if not sinks and (kernels is None or "flash_attention_2" in kernels):
        return None
    what = "adds learned attention sinks, which flash-attn 2 does not compute" if sinks else \
        "is not computed by flash-attn 2"
    swap = (f"; transformers would swap in one of {', '.join(kernels)}, code fetched from the Hub as the model loads"
            if kernels else "; transformers would drop them")
    kind = "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"
    return (f"{given}: {model_class.__name__}'s attention {what}{swap}; "
            f"{_flash_fix(given, f'{kind}, which computes it as the model defines it', kind)}")


def _flash_fix(given: str, auto_kind: str, kind: str = "sdpa") -> str:
    """The fix of a refused flash-attn 2: drop open-instruct's --use_flash_attn where it was given (auto then picks),
    else name our flag's working values."""
    if "--use_flash_attn" not in given:
        return f"use --attn_implementation auto (here: {auto_kind}) or {kind}"
    also = " and --attn_implementation flash_attention_2" if "--attn_implementation" in given else ""
    return f"drop --use_flash_attn{also}: attention is then auto (here: {auto_kind})"


def _model_class(config: Any) -> Optional[type]:
    """The transformers class AutoModelForCausalLM builds for a config; None where it is not known here (no
    config, remote code): those keep `auto`'s kernel and transformers says if it cannot run it."""
    if config is None:
        return None
    try:
        return AutoModelForCausalLM._model_mapping[type(config)]
    except (KeyError, ValueError, AttributeError):
        return None


def hub_kwargs(args: ModelArguments) -> dict[str, Any]:
    return {"revision": args.model_revision, "trust_remote_code": args.trust_remote_code}


def _config_overrides(args: ModelArguments) -> dict[str, Any]:
    """--additional_model_arguments as keyword overrides of the model config (validated as a mapping)."""
    if not args.additional_model_arguments:
        return {}
    import yaml  # JSON is YAML: one parser for the CLI's JSON string and a run YAML's mapping

    return dict(yaml.safe_load(args.additional_model_arguments))


def partition_summary(model: torch.nn.Module) -> str:
    """What this rank holds of a model loaded under deepspeed.zero.Init. Parameters made after loading
    are whole until training starts: transformers builds resized embeddings without ZeRO-3 init."""
    partitioned = [p for p in model.parameters() if hasattr(p, "ds_id")]
    whole = sum(p.numel() for p in model.parameters() if not hasattr(p, "ds_id"))
    text = (f"model loaded partitioned (ZeRO-3 init): this rank holds {sum(p.ds_tensor.numel() for p in partitioned)} "
            f"of its {sum(p.ds_numel for p in partitioned)} partitioned parameters")
    if whole:
        text += f"; {whole} parameters made after loading (resized embeddings) are whole until training starts"
    return text


def _gathered(weights: list[torch.Tensor]):
    """The weights whole on every rank inside the block (ZeRO-3 partitioned ones gathered; what rank 0
    writes is kept); a no-op for ordinary tensors."""
    import contextlib

    partitioned = [w for w in weights if hasattr(w, "ds_id")]
    if not partitioned:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(partitioned, modifier_rank=0)


def load_model_config(args: ModelArguments):
    """The model's config with --additional_model_arguments applied; a key the config has no attribute for is
    refused: transformers drops it without a word (a misspelled rope_thetta, or transformers 5's rope_theta, which
    lives in rope_parameters now, changed nothing)."""
    try:
        config, unused = AutoConfig.from_pretrained(args.config_name or args.model_name_or_path, **hub_kwargs(args),
                                                    **_config_overrides(args), return_unused_kwargs=True)
    except (OSError, ValueError) as exc:
        flag, name = ("--config_name", args.config_name) if args.config_name else ("--model_name_or_path",
                                                                                    args.model_name_or_path)
        raise UserError(unreachable_problem(flag, name, args.model_revision) or (
            f"{flag} {name}: could not load the model config ({exc}); "
            "check the path (a directory with config.json and weights) or the Hub id")
        ) from exc
    if unused:
        raise UserError(f"--additional_model_arguments: {'; '.join(_unknown_key(config, key) for key in unused)}; "
                        "transformers would ignore it, so nothing would change")
    return config


def _unknown_key(config: Any, key: str) -> str:
    """An override key the model config lacks, with the setting it may have meant: a key of one of its mapping
    settings (rope_theta in rope_parameters), or the nearest attribute's name."""
    import difflib

    settings = config.to_dict()
    inner = {name: holder for holder, value in settings.items() if isinstance(value, dict)
             for name in value if isinstance(name, str)}
    close = difflib.get_close_matches(key, [*settings, *inner], n=1)
    meant = key if key in inner else close[0] if close else None
    if meant in inner and meant not in settings:
        holder = inner[meant]
        guess = "" if meant == key else f"did you mean {meant!r}? "
        return (f"{key!r} is not a {type(config).__name__} setting; {guess}it is part of {holder}: give "
                f"'{{\"{holder}\": {{..., \"{meant}\": VALUE}}}}' with the rest of {holder} ({settings[holder]})")
    return f"{key!r} is not a {type(config).__name__} setting" + (f" (did you mean {meant!r}?)" if meant else "")


def _from_pretrained(args: ModelArguments, lora: Optional[LoraArguments],
                     compute_dtype: torch.dtype) -> PreTrainedModel:
    from open_sft.model.lora import quantization_config, quantized_device

    kwargs = hub_kwargs(args)
    quantization = quantization_config(lora, compute_dtype == torch.float16) if lora is not None else None
    if quantization is not None:
        kwargs.update(quantization_config=quantization, device_map={"": quantized_device()})
    config = load_model_config(args)
    try:
        return AutoModelForCausalLM.from_pretrained(
            args.model_name_or_path, config=config, dtype=torch.float32,
            attn_implementation=attn_implementation(args, config), **kwargs,
        )
    except (OSError, ValueError) as exc:
        flag = f"--model_name_or_path {args.model_name_or_path}"
        if "Unrecognized configuration class" in str(exc):  # transformers then lists every class it knows
            raise UserError(f"{flag}: transformers has no causal-LM class for model type {config.model_type!r} "
                            f"(AutoModelForCausalLM does not build a {type(config).__name__}: a vision-language, "
                            "speech or encoder model); open_sft trains the models AutoModelForCausalLM loads") from None
        raise UserError(f"{flag}: could not load the model ({exc}); check the path (a directory with config.json "
                        "and weights) or the Hub id") from exc
    except RuntimeError as exc:  # transformers: "You set `ignore_mismatched_sizes` to `False`, ..." (its report logged)
        if "ignore_mismatched_sizes" not in str(exc) or not _config_overrides(args):
            raise
        raise UserError(_reshaping_overrides(args)) from exc


def _reshaping_overrides(args: ModelArguments) -> str:
    """What to say when --additional_model_arguments changed the shape of weights the checkpoint holds: the keys
    that do (each tried alone on a weightless model, against the checkpoint's config), else all of them."""
    overrides = _config_overrides(args)
    saved = AutoConfig.from_pretrained(args.config_name or args.model_name_or_path, **hub_kwargs(args))
    reshaping = [key for key in overrides if _shapes(saved, {key: overrides[key]}) != _shapes(saved, {})]
    named = ", ".join(f"{key}: {overrides[key]!r} (the checkpoint's: {getattr(saved, key, None)!r})"
                      for key in reshaping or overrides)
    return (f"--additional_model_arguments {named}: changes the shapes of the checkpoint's weights "
            f"({args.model_name_or_path}; the log above lists them), which a pretrained model's cannot be; drop "
            f"{'it' if len(reshaping or overrides) == 1 else 'them'}. Settings that keep the shapes (dropout, "
            "rope_scaling, rope_theta, attention options) can be overridden")


def _shapes(config: Any, overrides: dict[str, Any]) -> Optional[dict[str, tuple]]:
    """The parameter shapes of `config`'s model with `overrides` (built on the meta device: no memory), or None."""
    import copy

    changed = copy.deepcopy(config)
    try:
        for key, value in overrides.items():
            setattr(changed, key, value)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(changed)
    except Exception:  # an override the model class refuses: it is not the shapes' cause we can name
        return None
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def load_model(args: ModelArguments, tokenizer: Optional[PreTrainedTokenizerBase] = None,
               lora: Optional[LoraArguments] = None, compute_dtype: torch.dtype = torch.float32,
               lora_dropout_given: bool = True, parallelism: Any = None) -> PreTrainedModel:
    """The model ready to train: fp32 parameters (master weights; `compute_dtype`, the run's resolved dtype,
    comes from autocast or DeepSpeed, and is QLoRA's 4-bit compute dtype when fp16), embeddings fitted to the
    tokenizer, NEFTune / gradient checkpointing / Liger applied, and with --use_lora / --use_qlora wrapped as a
    peft model whose only trainable weights are adapters (under LoRA in one process or DDP, `parallelism`, the
    decoder's frozen base weights in bf16 where the checkpoint stores them so: lora.frozen_base_in_compute_dtype)."""
    from open_sft.model.lora import apply_lora, frozen_base_in_compute_dtype, uses_lora

    model = _from_pretrained(args, lora, compute_dtype)
    adapted = lora is not None and uses_lora(lora)
    initialised = []
    if tokenizer is not None:  # under LoRA no spare rows (see fit_embeddings_to_tokenizer), unless TP splits them
        multiple = (parallelism.tp if parallelism is not None else 1) if adapted else EMBEDDING_MULTIPLE
        initialised = fit_embeddings_to_tokenizer(model, tokenizer, multiple)
    _freeze_outside_text(model)
    _check_family_loss(model)
    if args.use_liger_kernel:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model)
        # the model's forward, where Liger puts its fused linear cross-entropy, is not called: open_sft's
        # TokenLossModel calls Liger's loss itself where it computes open_sft's loss (open_sft.model.liger_loss)
        logger.info("--use_liger_kernel: Liger's norms, SwiGLU and rotary kernels are in place; the LM-head loss "
                    "is Liger's fused linear cross-entropy where it applies (the log says where not)")
    if args.neftune_noise_alpha:
        add_neftune_noise(model, args.neftune_noise_alpha)
    if args.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    if adapted:  # every row the run set is a trainable token: the adapter saves it, the frozen base stays out
        new_ids = sorted(set(getattr(tokenizer, "open_sft_new_ids", [])) | set(initialised))
        model = apply_lora(model, lora, new_ids, lora_dropout_given)
        if parallelism is not None and not lora.use_qlora:
            frozen_base_in_compute_dtype(model, compute_dtype, load_model_config(args), parallelism)
    if args.fp8:  # before compiling: the compiled layers trace torchao's FP8 layers
        from open_sft.model.fp8 import apply_fp8

        apply_fp8(model, args.fp8_recipe, args.fp8_layers)
    if args.torch_compile:
        from open_sft.model.compile import compile_layers

        compile_layers(model)
    return model


def _freeze_outside_text(model: PreTrainedModel) -> None:
    """A multimodal checkpoint trained on text (Gemma-3 4B-27B): its vision tower and projector never run, so get
    no gradient; frozen, they keep no optimizer state, and no weight decay moves them: exported as loaded."""
    parts = outside_text_path(model)
    for part in parts.values():
        part.requires_grad_(False)
    if parts:
        frozen = sum(param_numel(p) for part in parts.values() for p in part.parameters())
        logger.info("%s trains on text through its language model: %s frozen as loaded (%d parameters)",
                    type(model).__name__, ", ".join(parts), frozen)


def _check_family_loss(model: PreTrainedModel) -> None:
    """The family's logit transform, logged; a family open_sft has not verified is checked against its own loss
    (open_sft.model.loss_parity), before anything changes its forward (Liger, NEFTune, LoRA)."""
    from open_sft.model.logits import logit_transform
    from open_sft.model.loss_parity import check_loss_parity

    transform = logit_transform(model.config)
    if not transform.identity:
        logger.info("loss: logits %s before the cross-entropy, as the model's own forward does",
                    transform.describe())
    note = check_loss_parity(model)
    if note:
        logger.info("%s", note)


def context_warning(config: Any, longest: int) -> Optional[str]:
    """A warning when the data's longest example is longer than the positions the model was trained for
    (packed examples keep their own positions): a RoPE model runs past them, but its attention degrades."""
    positions = getattr(text_config(config), "max_position_embeddings", None)
    if not positions or longest <= positions:
        return None
    return (f"examples up to {longest} tokens are longer than the model's {positions} positions "
            f"(max_position_embeddings): lower --max_seq_length to {positions}, or extend the context "
            "(e.g. rope_scaling through --additional_model_arguments)")


def fit_embeddings_to_tokenizer(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                                multiple: int = EMBEDDING_MULTIPLE) -> list[int]:
    """Give the tokens the run added (a chat template's special tokens, --add_tokens) rows that start at the mean
    of the trained rows, in the input embeddings and the LM head (once when tied): the matrix grows to a multiple
    of `multiple` rows when the tokenizer no longer fits, and an added token whose id falls on a spare row of a
    padded matrix (GPT-NeoX/OLMo/Qwen: 50,304 rows for 50,280 tokens) gets the mean too, never that untrained row.
    The trained rows are those of the tokens the tokenizer had before the run added any; rows grown for padding
    get the mean as well. Returns the ids below len(tokenizer) whose rows it set (LoRA makes them trainable
    tokens, so the adapter holds them); a no-op, returning [], once the added rows are initialised.

    A full model is saved with its rows, so 64 keeps the matrix aligned for the GPU. A LoRA run passes 1 (its TP
    degree under TP): its adapter is loaded onto the base resized to len(tokenizer) (peft's
    AutoPeftModelForCausalLM does that, as does open_sft), and grown rows past the tokenizer would be in no file."""
    rows = param_shape(model.get_input_embeddings().weight)[0]
    pending = sorted(getattr(tokenizer, "open_sft_added_ids", []))
    if len(tokenizer) <= rows and not pending:
        return []
    if len(tokenizer) > rows:
        _warn_foreign_tokens(tokenizer, rows)
        model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=multiple if multiple > 1 else None,
                                      mean_resizing=False)
        logger.info("resized embeddings from %d to %d rows for %d tokens", rows,
                    param_shape(model.get_input_embeddings().weight)[0], len(tokenizer))
    # the trained rows: those of the tokens the tokenizer had before the run added any (spare padding rows
    # past the tokenizer's size are untrained)
    limit = min(len(tokenizer), rows)
    added = sorted(i for i in set(getattr(tokenizer, "open_sft_new_ids", [])) | set(pending) if i < limit)
    layers = [model.get_input_embeddings().weight, model.get_output_embeddings().weight]
    weights = list({id(w): w for w in layers}.values())  # once when the embeddings are tied
    with _gathered(weights):
        for weight in weights:
            _mean_init_rows(weight, rows, limit, added, [i for i in pending if i < rows])
    if pending:
        named = ", ".join(f"{token} ({i})" for token, i in zip(tokenizer.convert_ids_to_tokens(pending), pending))
        logger.info("added tokens %s: their %s rows start at the mean of the %d trained rows", named,
                    "embedding" if len(weights) == 1 else "input-embedding and LM-head", limit - len(added))
    tokenizer.open_sft_added_ids = []  # initialised; a second call must not reset trained rows
    return sorted(set(range(rows, len(tokenizer))) | set(pending))


def _warn_foreign_tokens(tokenizer: PreTrainedTokenizerBase, rows: int) -> None:
    """A tokenizer with tokens past the model's embedding rows that this run did not add (a chat template's, --add_
    tokens): likely another model's tokenizer (--tokenizer_name_or_path of another family), whose ids below `rows`
    would train on embeddings the model learned for other tokens; said once, with what to check."""
    added = set(getattr(tokenizer, "open_sft_new_ids", []))
    own = [i for i in range(rows, len(tokenizer)) if i not in added]
    if own:
        logger.warning("the tokenizer (%s, %d tokens) has %d tokens the model's embeddings (%d rows) have no row for, "
                       "which this run did not add: is it another model's tokenizer? Its ids below %d would use the "
                       "rows the model learned for its own tokens. Give the model's own tokenizer (--tokenizer_name_"
                       "or_path, or none: the model's); where the vocabulary was extended on purpose, their rows "
                       "start at the mean of the trained ones", getattr(tokenizer, "name_or_path", "") or "given",
                       len(tokenizer), len(own), rows, rows)


@torch.no_grad()
def _mean_init_rows(weight: torch.Tensor, old_rows: int, limit: int, excluded: list[int], reset: list[int]) -> None:
    """Rows `reset` and every row past `old_rows` (grown) set to the mean of rows 0..limit-1 but `excluded`
    (summed in fp32 without copying the matrix)."""
    total = weight[:limit].float().sum(dim=0)
    if excluded:
        total -= weight[excluded].float().sum(dim=0)
    mean = (total / max(limit - len(excluded), 1)).to(weight.dtype)
    weight[old_rows:] = mean
    if reset:
        weight[reset] = mean


def add_neftune_noise(model: PreTrainedModel, alpha: float) -> torch.utils.hooks.RemovableHandle:
    """NEFTune (Jain et al. 2023): while training, add Uniform(-1, 1) · alpha / sqrt(L · d) noise to the
    input embeddings (L = sequence length of the batch, d = hidden size). Eval and generation are untouched."""

    def hook(module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        if not module.training:
            return output
        scale = alpha / math.sqrt(output.shape[-2] * output.shape[-1])
        return output + torch.empty_like(output).uniform_(-scale, scale)

    return model.get_input_embeddings().register_forward_hook(hook)
