"""Whether a model keeps packed examples apart, checked when it is loaded for a --packing run.

A packed row holds several examples, told apart only by position_ids restarting. transformers turns that into a
block-diagonal mask (or open_sft's per-example attention splits the row) for the families whose mask is built
from position_ids; a family whose mask ignores them (gpt-oss, Bloom, MPT, XGLM, Granite-4.0-H's hybrid layers in
transformers 5) gives the whole row one causal mask, and every example attends to the ones packed before it: a
loss that trains, but not on the data (found by a family sweep). A recurrent layer (Mamba's, LFM2's short
convolution, Qwen3-Next's linear attention) carries its state from one example into the next whatever the
positions say. Families in VERIFIED are held to it by tests/unit/model/test_packed_families.py; any other is
checked here on the model itself, as the run computes (autocast in its dtype): the hidden states of a short
example alone against the same example packed after another, and the gradient of the second example's hidden
states with respect to the first's embeddings, which is exactly 0 where examples are kept apart. A difference
stops the run with the family named, before any step is taken. Where half precision's rounding moves the hidden
states past its tolerance and nothing depends on the first example (a routed model: a router's choice flipped by
rounding; a deep dense one: rounding adding up over its layers), the move is measured again in fp32, and the packed
attention held to the per-example one at the first layer of each kind of attention (full, sliding) in the run's
dtype (open_sft.model.packing_precision).
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
from typing import TYPE_CHECKING, Iterator, Optional

import torch
from torch import nn

from open_sft.errors import UserError
from open_sft.model.anatomy import backbone_of, causal_lm_of, text_config, text_decoder_of
from open_sft.model.flash_packing import backbone_kwargs, packed_rows, uses_flash
from open_sft.model.loss_parity import VERIFIED
from open_sft.model.packed_leaks import LEAKS, RECURRENT, recurrent_layers
from open_sft.model.packing_precision import attention_moves, fp32_by_layer, in_fp32

if TYPE_CHECKING:
    from open_sft.config.args import TrainingArguments
    from open_sft.distributed.parallelism import Parallelism

logger = logging.getLogger(__name__)

FIRST, SECOND = 7, 9  # tokens of the example packed first and of the one checked after it
RTOL = {torch.float32: 1e-4, torch.float64: 1e-6}  # of the hidden states' scale
# half precision: its rounding differs between the packed row and the example alone (the kernels' blocking follows the
# shapes, and the CPU kind: AVX-512 BF16 rounds them apart where AVX2 does not), and a router's discontinuous choice
# of experts (top-k, Phi-3.5-MoE's sparsemixer threshold) turns that into an expert's difference on a token (tiny
# random Phi-3.5-MoE: 5.7e-2, Ernie-4.5-MoE: up to 1.9e-2 on AVX-512 BF16; 2e-7 on AVX2). Over it, with no dependence,
# the move is measured again in fp32
RTOL_HALF = 2e-2
# the second example's gradient with respect to the first's embeddings, relative to that with respect to its own:
# exactly 0 where they are kept apart (no path joins them, or only masked attention weights, exact zeros), in any
# dtype; a recurrent state gives ~1e-3 (LFM2's short convolution at initialisation) to 1
DEPENDENCE_TOL = 1e-6
HALF = (torch.bfloat16, torch.float16)


def _backbone(model: nn.Module) -> nn.Module:
    return backbone_of(causal_lm_of(model))


@contextlib.contextmanager
def _evaluating(model: nn.Module) -> Iterator[None]:
    """The model in eval mode (no dropout, no router noise) for a probe, back in its own mode after."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


_PARTITIONED = "its parameters are partitioned here"
_FLASH_OFF_DEVICE = ("its flash_attention_2 (the flash-attn package: CUDA tensors only) cannot run where the model is "
                     "checked (before DeepSpeed places it on the GPU)")
_CHECK_ELSEWHERE = {_PARTITIONED: "check it once without ZeRO-3/FSDP/TP (a one-process run of a few steps)",
                    _FLASH_OFF_DEVICE: "check it once in one process (python finetune.py ... --max_train_steps 2) or "
                                       "train it with --attn_implementation sdpa"}


def _not_run_here(model: nn.Module) -> Optional[str]:
    """Why the probes cannot run the model here, or None: parameters not whole on this rank (ZeRO-3, FSDP2, TP), or
    flash_attention_2 with the model where flash-attn cannot run it (on the CPU under DeepSpeed ZeRO-1/2, which places
    the model itself after this check: check_device)."""
    from open_sft.model import packed_attention

    if _partitioned(model):
        return _PARTITIONED
    device = next(model.parameters()).device
    if uses_flash(causal_lm_of(model)) and device.type != packed_attention.KERNEL_DEVICE:
        return _FLASH_OFF_DEVICE
    return None


def _partitioned(model: nn.Module) -> bool:
    """Parameters that are not whole on this rank (ZeRO-3, FSDP2, TP): no forward outside the training engine."""
    from torch.distributed.tensor import DTensor

    return any(getattr(p, "ds_numel", None) is not None or isinstance(p, DTensor) for p in model.parameters())


def _computing(model: nn.Module, dtype: Optional[torch.dtype]) -> contextlib.AbstractContextManager:
    """Autocast in the run's half-precision compute dtype, as training computes (a LoRA run's frozen decoder weights
    may be bf16 beside fp32 embeddings and adapters, which only autocast multiplies together); else nothing."""
    if dtype not in HALF:
        return contextlib.nullcontext()
    return torch.autocast(next(model.parameters()).device.type, dtype=dtype)


@torch.no_grad()
def packing_leak(model: nn.Module) -> float:
    """How far the second of two packed examples' hidden states move from those it has alone, relative to their
    largest magnitude (0 for a model that keeps packed examples apart)."""
    config = text_config(model.config)
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (1, FIRST + SECOND), generator=generator).to(device)
    positions = torch.cat([torch.arange(FIRST), torch.arange(SECOND)])[None].to(device)
    backbone = _backbone(model)
    with _evaluating(model):
        alone = backbone(input_ids=ids[:, FIRST:], use_cache=False).last_hidden_state.float()
        packed = backbone(**_as_trained(model, ids, positions), use_cache=False).last_hidden_state[:, FIRST:].float()
    return float((packed - alone).abs().max() / alone.abs().max().clamp_min(1e-12))


def _as_trained(model: nn.Module, ids: torch.Tensor, positions: torch.Tensor) -> dict:
    """A packed probe row as training hands packed rows to the backbone: in a micro-batch of two rows (under
    flash_attention_2 transformers finds the examples of one row itself, not of more), with where each example
    starts under flash_attention_2 (open_sft.model.flash_packing), which a model's forward must hand on."""
    ids, positions = ids.expand(2, -1), positions.expand(2, -1)
    rows = packed_rows(positions.cpu(), positions.device) if uses_flash(causal_lm_of(model)) else {}
    return {"input_ids": ids, "position_ids": positions,
            **backbone_kwargs(rows.get("cu_seq_lens"), rows.get("max_length"))}


def packing_dependence(model: nn.Module) -> float:
    """How much the second of two packed examples depends on the first: the gradient of a fixed projection of its
    last hidden states with respect to the first example's input embeddings, relative to the gradient with respect to
    its own (0 for a model that keeps packed examples apart, whatever the dtype: where the hidden states' difference
    can sit under half precision's rounding, as LFM2's short convolution does at bf16)."""
    config = text_config(model.config)
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (1, FIRST + SECOND), generator=generator).to(device)
    positions = torch.cat([torch.arange(FIRST), torch.arange(SECOND)])[None].to(device)
    embedded: list[torch.Tensor] = []

    def leaf(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        embedded.append(output.detach().requires_grad_())
        return embedded[-1].clone()  # a leaf the forward may scale in place (CTRL: inputs_embeds *= sqrt(d))

    hook = causal_lm_of(model).get_input_embeddings().register_forward_hook(leaf)
    try:
        with _evaluating(model), torch.enable_grad():
            hidden = _backbone(model)(**_as_trained(model, ids, positions), use_cache=False).last_hidden_state
            projection = torch.randn(hidden.shape[-1], generator=generator).to(device)
            (grad,) = torch.autograd.grad((hidden[:, FIRST:].float() @ projection).sum(), embedded[0])
    finally:
        hook.remove()
    grad = grad.float().abs()
    return float(grad[:, :FIRST].max() / grad[:, FIRST:].max().clamp_min(1e-30))


def packed_gradients_finite(model: nn.Module, padding: int = 5) -> bool:
    """Whether a packed row laid out as training lays it out (two examples, then the rest of the row as a block of
    pad tokens with positions of its own) back-propagates finite gradients. Gemma-3n's text model does not: a
    block of one repeated token gives NaN gradients (its padded batches are fine), so every packed step of it
    would be skipped as non-finite. Checked on the first decoder layer's trainable parameters (or the first few
    trainable ones): NaN reaches them from wherever it starts."""
    backbone = _backbone(model)
    layers = getattr(text_decoder_of(causal_lm_of(model)), "layers", None)
    first = layers[0] if isinstance(layers, nn.ModuleList) and len(layers) else backbone
    targets = [p for p in first.parameters() if p.requires_grad] or [
        p for p in backbone.parameters() if p.requires_grad and p.numel() < 2**24][:4]
    if not targets:
        return True
    config = text_config(model.config)
    device = next(model.parameters()).device
    pad = config.pad_token_id if isinstance(getattr(config, "pad_token_id", None), int) else 0
    generator = torch.Generator().manual_seed(1)
    ids = torch.cat([torch.randint(0, config.vocab_size, (1, FIRST + SECOND), generator=generator),
                     torch.full((1, padding), pad)], dim=1).to(device)
    positions = torch.cat([torch.arange(FIRST), torch.arange(SECOND), torch.arange(padding)])[None].to(device)
    with _evaluating(model), torch.enable_grad():
        hidden = backbone(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state
        grads = torch.autograd.grad(hidden.float().pow(2).mean(), targets, allow_unused=True)
    return all(g is None or bool(torch.isfinite(g).all()) for g in grads)


def check_packing(model: nn.Module, compute_dtype: Optional[torch.dtype] = None) -> Optional[str]:
    """For a --packing run of a family outside VERIFIED: raises UserError when packed examples see each other;
    returns a log line (None for verified families). `compute_dtype`: the run's (autocast where half).

    Eagerly: --torch_compile compiled the decoder layers already, and the probes' shapes (one short row, no grad,
    eval mode) would recompile them up to dynamo's recompile limit (8, reached by transformers' shared
    deprecate_kwarg frame); the first training forward would then run every layer eagerly for the whole run."""
    with torch.compiler.set_stance("force_eager"):
        return _check_packing(model, compute_dtype)


def _check_packing(model: nn.Module, compute_dtype: Optional[torch.dtype]) -> Optional[str]:
    family = getattr(model.config, "model_type", type(model).__name__)
    if family in VERIFIED:
        return None
    if family in LEAKS:
        raise _leaking(family, LEAKS[family])
    why = _not_run_here(model)
    if why:
        recurrent = recurrent_layers(model)
        if recurrent:
            raise _leaking(family, f"{recurrent}: {RECURRENT}; {why}, so it cannot be checked at start")
        logger.warning("--packing: model type %r is not among the families open_sft has verified to keep packed "
                       "examples apart, and %s, so it is not checked at start; %s", family, why, _CHECK_ELSEWHERE[why])
        return None
    dtype = compute_dtype if compute_dtype in HALF else next(model.parameters()).dtype
    redone = kernel = ""
    try:
        with _computing(model, compute_dtype):
            leak, dependence = packing_leak(model), packing_dependence(model)
            finite = packed_gradients_finite(model)
        if not (math.isfinite(leak) and math.isfinite(dependence) and finite):
            # half precision overflowed in a probe (fp16's gradients): it cannot tell; whether examples are kept
            # apart, and whether a packed row's gradients are finite, is structural, and fp32 tells it
            _fp32_runs(model, family, "half precision overflowed in it")
            with in_fp32(model):
                leak, dependence, dtype = packing_leak(model), packing_dependence(model), None
                finite = packed_gradients_finite(model)
            redone = "half precision overflowed"
        elif dtype in HALF and leak > RTOL_HALF and dependence <= DEPENDENCE_TOL:
            # rounding, where nothing depends on the example before: a router's choice of experts flipped by it, or a
            # deep model's rounding adding up over its layers (tiny 32-layer OLMo-3 in bf16: 3.3e-2 on AVX-512 BF16).
            # The move judged in fp32 (the dependence stays the run's dtype's); on a GPU fp32 takes the per-example
            # attention, not the varlen kernel trained with, so that is held to the per-example attention at the
            # first layer of each kind of attention, in the run's dtype
            redone = f"half precision's rounding moved them by {leak:.1e}, over its {RTOL_HALF:.0e}"
            _fp32_runs(model, family, redone)
            kernel = _kernel_by_kind(model, family, compute_dtype)
            leak, dtype = _fp32_leak(model, family, leak), None
    except TypeError as exc:
        raise _not_taken(family, exc) from None
    if not (math.isfinite(leak) and math.isfinite(dependence)):
        raise UserError(f"--packing: model type {family!r} gives non-finite hidden states or gradients when checked "
                        "for keeping packed examples apart, also in fp32, so it cannot be told; train without "
                        "--packing; please report the model type")
    if leak > RTOL.get(dtype or torch.float32, RTOL_HALF) or dependence > DEPENDENCE_TOL:
        raise _leaking(family, f"an example's hidden states moved by {leak:.2e} (relative) when another was packed "
                       f"before it, and depend on its tokens ({dependence:.1e}, relative): its attention mask is not "
                       "built from position_ids, or a recurrent layer carries its state across examples")
    if not finite:
        raise UserError(f"--packing: model type {family!r} gives non-finite gradients on a packed row (its block of "
                        "pad tokens), so every packed step would be skipped; train without --packing (padded batches "
                        "are fine); please report the model type")
    return (f"--packing: model type {family!r} keeps packed examples apart (checked at start"
            f"{f' in fp32: {redone}' if redone else ''}: {leak:.1e}, dependence {dependence:.1e}{kernel})")


_UNTAKEN = re.compile(r"unexpected keyword argument '(position_ids|cu_seq_lens_[qk]|max_length_[qk])'")


def _not_taken(family: str, exc: TypeError) -> Exception:
    """The refusal for a forward that does not take what tells packed examples apart (position_ids; under
    flash_attention_2 also flash-attention's cu_seq_lens and max_length); any other TypeError is the probe's or the
    model's fault, and is raised as it is, with a note to report it."""
    untaken = _UNTAKEN.search(str(exc))
    if untaken is None:
        exc.add_note(f"--packing: raised by model type {family!r} while open_sft checked at start that it keeps packed "
                     "examples apart; please report it with the model type (training without --packing skips the "
                     "check)")
        return exc
    name = untaken.group(1)
    if name == "position_ids":
        return UserError(f"--packing: model type {family!r} does not take position_ids ({exc}), which is how packed "
                         "examples are told apart; train without --packing")
    return UserError(f"--packing: model type {family!r} does not take {name} ({exc}), which is how packed examples "
                     "are told apart under flash_attention_2; train with --attn_implementation sdpa, or without "
                     "--packing")


def _fp32_runs(model: nn.Module, family: str, why: str) -> None:
    """Refused where the check's fp32 measure cannot run: flash-attn computes bf16/fp16 only (under
    flash_attention_2 fp32 queries stop it)."""
    if uses_flash(causal_lm_of(model)):
        raise UserError(f"--packing: model type {family!r} could not be checked at start for keeping packed examples "
                        f"apart: {why}, and the fp32 measure that tells it cannot run under flash_attention_2 "
                        "(flash-attn computes bf16/fp16 only); train with --attn_implementation sdpa (checked in fp32 "
                        "there), or without --packing")


# the longest sliding window the attention probe reaches where the model is on the kernel's device (its examples made
# longer than it, so that the kernel is given the window): a 2,000-token row; a longer one, or one on the CPU (no
# kernel there: the per-example calls, whose window the unit tests hold), is named "not reached" in the log line
WINDOW_PROBED = 1024


def _kernel_by_kind(model: nn.Module, family: str, compute_dtype: Optional[torch.dtype]) -> str:
    """The packed attention (torch's variable-length kernel on a GPU) against each example attended alone at the
    first layer of each kind of attention (`attention_moves`), in the run's dtype: refused over half precision's
    tolerance, else a note for the log."""
    from open_sft.model import packed_attention

    config = text_config(model.config)
    window = getattr(config, "sliding_window", None)
    on_kernel = next(model.parameters()).device.type == packed_attention.KERNEL_DEVICE
    reach = window if on_kernel and isinstance(window, int) and 0 < window <= WINDOW_PROBED else 0
    lengths = [FIRST + reach, SECOND + reach]
    ids = torch.randint(0, config.vocab_size, (1, sum(lengths)), generator=torch.Generator().manual_seed(2))
    with _evaluating(model), _computing(model, compute_dtype):
        moves = attention_moves(model, ids.to(next(model.parameters()).device), lengths)
    if not moves:
        return ""
    label, move = max(moves.items(), key=lambda item: item[1])
    if not move <= RTOL_HALF:
        raise UserError(f"--packing: model type {family!r}: the attention of packed rows (torch's variable-length "
                        f"kernel on a GPU) gave the first attention layer of its kind, {label}, outputs {move:.2e} "
                        f"(relative) from the same examples attended one at a time, over half precision's "
                        f"{RTOL_HALF:.0e}: packed rows would not train as the examples do. Train without --packing "
                        "(padded batches do not take that kernel); please report it with the model type and the "
                        "torch version")
    return (f"; the packed attention at the first layer of each kind ({', '.join(moves)}), in the run's dtype: at "
            f"most {move:.1e} from per-example")


def _fp32_leak(model: nn.Module, family: str, half: float) -> float:
    """packing_leak in fp32 (one decoder layer's weights upcast at a time, `fp32_by_layer`), or, where even that
    does not fit, the refusal with the half-precision move."""
    try:
        with fp32_by_layer(model):
            return packing_leak(model)
    except torch.OutOfMemoryError:
        raise UserError(f"--packing: model type {family!r}: an example's hidden states moved by {half:.2e} (relative) "
                        "in half precision when another was packed before it, over half precision's tolerance; a "
                        "router's choice of experts, or rounding over many layers, can move them that much, but "
                        "measuring it again in fp32 ran out of memory, so it cannot be told whether packed examples "
                        "are kept apart. Train without --packing (padded batches keep examples apart), or check it "
                        "once where the model has more room (a one-process run of a few steps); please report the "
                        "model type") from None


def _leaking(family: str, why: str) -> UserError:
    return UserError(f"--packing: model type {family!r} lets packed examples see each other ({why}). Train "
                     "without --packing (padded batches keep examples apart); please report the model type")


def check_device(model: nn.Module, device: Optional[torch.device], parallelism: Parallelism) -> Optional[torch.device]:
    """Where the start-up check moves the model first, so that it runs the attention kernel that trains (on a GPU
    torch's variable-length flash attention, which takes CUDA tensors only): the run's device, where the run puts
    the whole model there in its own dtypes anyway (one process, DDP: accelerate's prepare moves it; this only moves
    it earlier). None, checked where it is: on a CPU run; under DeepSpeed (which casts it to half precision before
    moving it), FSDP or tensor parallelism (shards); where it is placed already (QLoRA's device map)."""
    if device is None or device.type == "cpu" or parallelism.deepspeed or parallelism.fsdp or parallelism.tp_enabled:
        return None
    return device if all(p.device.type == "cpu" for p in model.parameters()) else None


def route_packed_rows(model: nn.Module, train: TrainingArguments, parallelism: Parallelism,
                      compute_dtype: Optional[torch.dtype] = None, device: Optional[torch.device] = None) -> None:
    """Packed rows' attention for the run (open_sft.model.packed_attention: per example, or torch's variable-length
    flash attention on a GPU), then, for --packing, the family checked to keep packed examples apart (on the whole
    model: not under pipeline parallelism, whose stages hold a part of it), on `device`, the run's, where
    `check_device` says so."""
    from open_sft.model import packed_attention

    on_gpu = torch.cuda.is_available()
    if packed_attention.install(model, varlen=on_gpu) and train.packing:
        logger.info("packed rows attend one example at a time (%s)",
                    "torch's variable-length flash attention" if on_gpu and packed_attention.varlen_kernel()
                    else "sdpa has no variable-length kernel here")
    if train.packing and not parallelism.pp_enabled:
        target = check_device(model, device, parallelism)
        if target is not None and getattr(model.config, "model_type", None) not in VERIFIED:
            model.to(target)
        note = check_packing(model, compute_dtype)
        if note:
            logger.info("%s", note)
