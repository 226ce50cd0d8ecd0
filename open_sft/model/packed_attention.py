"""Attention of packed rows one example at a time, on CPU.

A packed micro-batch carries several examples per row, told apart by `position_ids` restarting. For "sdpa"
transformers turns that into a [batch, 1, row, row] block-diagonal causal mask, and torch's CPU kernel then
computes every query against every key of the whole row and masks afterwards: for 1,024-token rows of
~150-token examples that is ~7× the scores the examples need, and the masked kernel cannot skip the causal
upper triangle either. Measured on a 2-core AMD EPYC (avx512_bf16), Llama hidden 256 × 4 layers, 8 × 1,024
packed tokens: attention took 0.69 s of a 3.1 s bf16 step.

Here each example's queries, keys and values are cut out of the flattened batch (one `split`, whose backward
is one concatenation) and attended with `is_causal=True` by the attention function that was registered
before, so the result is the one the mask gives. torch's CPU SDPA has no variable-length kernel (the CUDA
flash-attention package does, and transformers uses it there through `position_ids`), which is why this
is written here. It is installed only for CPU runs with "sdpa" and without sequence parallelism.

A padded batch's position ids (transformers counts them off the attention mask) split too, padding apart from
the tokens it pads: no real token attends a pad either way, so the real tokens' outputs are the same.

On a GPU without the flash-attn package, transformers' "sdpa" gives packed rows the same dense block-diagonal
mask, which keeps torch off its flash kernel (a mask forces the memory-efficient or math kernel, over whole
rows). There the examples of the whole micro-batch go to one call of torch's variable-length flash attention
(`torch.nn.attention.varlen`, bf16/fp16, cumulative example lengths, a sliding layer's window as the kernel's);
other dtypes, softcapping, head sizes the kernel has no kernels for (over 256, or not a multiple of 8: Gemma-4's
512-wide full-attention layers) and tensors not on the GPU take the per-example calls above. Where the mask
transformers built for the packed rows is more than causal attention within each example (within the layer's
window: Llama-4's chunks), each example's call gets its own block of that mask; a window passed as an argument, a
banded causal mask of the example's own.
scripts/gpu_check.py measures these candidates against each other.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from typing import Any, Callable, Optional

import torch
from torch import nn

from open_sft.data.batching import host_to_device

FLAG = "_open_sft_packed_attention"
VARLEN_DTYPES = (torch.bfloat16, torch.float16)
# the device type whose tensors the kernel takes: aten::_flash_attention_forward has no CPU kernel, and a model can
# be on the CPU where the kernel is installed (the start-up packing check before accelerate moves it to the GPU)
KERNEL_DEVICE = "cuda"
# torch's mha_varlen_fwd refuses other head sizes: Gemma-4's full-attention layers (512) take the per-example calls
MAX_HEAD_DIM, HEAD_DIM_MULTIPLE = 256, 8


def segment_lengths(position_ids: torch.Tensor) -> Optional[list[int]]:
    """Lengths of the examples of a [batch, row] position-id tensor, row after row (a new example where the
    position does not follow the previous one, as transformers' packed-sequence detection reads it); None
    when every row holds one example."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    if int(starts.sum()) == position_ids.shape[0]:
        return None
    index = torch.nonzero(starts.reshape(-1))[:, 0].tolist()
    return [b - a for a, b in zip(index, index[1:] + [position_ids.numel()])]


# Each example's length is padded up to a multiple of this. torch's bf16 CPU attention kernels (and oneDNN's
# primitive cache) keep what they build for every distinct length: with exact lengths (hundreds of them in a
# run) a bf16 run's memory in use grew by ~0.8 GiB over its first steps (measured, 8 × 1,024-token rows of
# 20-300-token examples); in buckets it stays flat. The padding keys follow every real query, so under the
# causal mask no real query sees them; their outputs are dropped.
BUCKET = 32


def _to_bucket(t: torch.Tensor, n: int) -> torch.Tensor:
    extra = -n % BUCKET
    return torch.nn.functional.pad(t, (0, 0, 0, extra)) if extra else t


def varlen_kernel() -> Optional[Callable]:
    """torch's variable-length flash attention (torch >= 2.10, a CUDA GPU of compute capability 8.0 or later), or
    None: its flash kernel refuses older GPUs (T4, V100: "FlashAttention only supports Ampere GPUs or newer"), where
    packed rows take the per-example sdpa calls."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0):
        return None
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


# The example lengths of the position ids a forward pass is about to get, found on the host before the batch went to
# the device (`known_segments`): (a weak reference to the device tensor, its lengths)
_known: tuple[Optional[weakref.ref], Optional[list[int]]] = (None, None)


def known_segments(position_ids: Optional[torch.Tensor], host_position_ids: Optional[torch.Tensor]) -> None:
    """Before a forward pass: `position_ids` (the tensor the model gets, on the device) hold the values of
    `host_position_ids` (the collated batch's, on the host), so their example lengths are read from those. On a GPU
    reading them off the device would wait for it, at the first layer of every forward pass. Nothing is found where
    the packed attention is not installed (flash-attn's kernel, another attention): none of it would ask."""
    global _known
    if (position_ids is None or host_position_ids is None or host_position_ids.device.type != "cpu"
            or not installed()):
        _known = (None, None)
        return
    _known = (weakref.ref(position_ids), segment_lengths(host_position_ids))


class _Segments:
    """The example lengths of the position ids of the forward pass in progress: every layer passes the same
    tensor, so they are found once (a weak reference: a new batch is a new tensor) — from the host's copy where the
    trainer said which tensor that is (`known_segments`), else read off the device."""

    def __init__(self) -> None:
        self._of: Optional[weakref.ref] = None
        self._lengths: Optional[list[int]] = None

    def __call__(self, position_ids: torch.Tensor) -> Optional[list[int]]:
        if self._of is None or self._of() is not position_ids:
            known, lengths = _known
            self._lengths = lengths if known is not None and known() is position_ids else segment_lengths(position_ids)
            self._of = weakref.ref(position_ids)
        return self._lengths


@functools.lru_cache(maxsize=None)
def _parameters(kernel: Callable) -> frozenset[str]:
    """The keyword names the kernel takes (they differ between torch releases), read once, not at every layer."""
    return frozenset(inspect.signature(kernel).parameters)


_last_cumulative: tuple[Optional[list[int]], Optional[torch.device], Optional[torch.Tensor]] = (None, None, None)


def _cumulative(lengths: list[int], device: torch.device) -> torch.Tensor:
    """The cumulative lengths the kernel takes, on `device`: made once for the layers of a forward pass (they get
    the same `lengths` list, kept here so it is not another list at its address), copied from pinned memory (a
    tensor built on the device from a host list waits for the device's queued work, at every layer)."""
    global _last_cumulative
    known, on, cu = _last_cumulative
    if known is lengths and on == device:
        return cu
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    cu = host_to_device(torch.tensor(bounds, dtype=torch.int32), device)
    _last_cumulative = (lengths, device, cu)
    return cu


def _kernel_takes(query: torch.Tensor) -> bool:
    """Whether the kernel takes these queries: on its device, of a head size it has kernels for."""
    dim = query.shape[-1]
    return query.device.type == KERNEL_DEVICE and dim <= MAX_HEAD_DIM and dim % HEAD_DIM_MULTIPLE == 0


def _kernel_window(kernel: Callable, window: Optional[int], lengths: list[int]) -> Optional[tuple[int, int]]:
    """The kernel's window (left, right) for a layer's sliding window, or None where it cannot apply it.
    transformers' window: query i sees keys j with i - window < j <= i (sliding_window_overlay); the kernel's: keys
    i - left <= j <= i + right, so (window - 1, 0). Where no example is longer than the window it changes nothing:
    causal, (-1, 0), which torch 2.10/2.11's kernel (is_causal, no window) takes too."""
    if window is None or max(lengths) <= window:
        return (-1, 0)
    params = _parameters(kernel)
    return (window - 1, 0) if "window_size" in params and "is_causal" not in params else None


def _varlen_call(kernel: Callable, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 lengths: list[int], scaling: Optional[float], window: tuple[int, int] = (-1, 0)) -> torch.Tensor:
    """One variable-length attention over the examples of a [batch, heads, row, head_dim] micro-batch, causal within
    `window` (the kernel's (left, 0): `_kernel_window`); returns [batch, row, heads, the values' head_dim], as
    transformers' attention functions do. Values narrower than the queries (multi-head latent attention's:
    DeepSeek-V2/V3, Kimi), which the kernel does not take, are padded with zero columns, whose outputs are exactly
    zero, and those are cut off again."""
    batch, heads, length, dim = query.shape
    width = value.shape[3]
    if width < dim:
        value = torch.nn.functional.pad(value, (0, dim - width))
    params = _parameters(kernel)
    if key.shape[1] != heads and "enable_gqa" not in params:
        key, value = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (key, value))
    flat = [t.transpose(1, 2).reshape(batch * length, t.shape[1], dim) for t in (query, key, value)]
    cu = _cumulative(lengths, query.device)
    options: dict[str, Any] = {"scale": scaling}
    if "enable_gqa" in params:
        options["enable_gqa"] = key.shape[1] != heads
    if "is_causal" in params:  # torch 2.10/2.11: causal only (_kernel_window passes no other window)
        options["is_causal"] = True
    else:  # later releases: causal is the window (-1, 0)
        options["window_size"] = window
    out = kernel(*flat, cu, cu, max(lengths), max(lengths), **options)
    return out.view(batch, length, heads, dim)[..., :width]


def _varlen_dtype(query: torch.Tensor) -> Optional[torch.dtype]:
    """The dtype the variable-length kernel runs in here, or None. Under autocast the queries arrive in fp32 (the
    rotary embedding multiplies them by the fp32 residual stream's cos/sin) and sdpa would cast them to the autocast
    dtype itself; a custom op is not on autocast's list, so the cast is done here."""
    if query.dtype in VARLEN_DTYPES:
        return query.dtype
    device = query.device.type
    if torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) in VARLEN_DTYPES:
        return torch.get_autocast_dtype(device)
    return None


class _MaskKinds:
    """Whether each attention mask of the forward pass in progress is, within each packed example, plain causal
    attention (within the layer's window), what the kernel and the unmasked per-example calls compute (one per kind
    of layer: full and sliding layers get different masks), judged once per mask tensor (weak references: a new
    batch is a new mask). What a mask says across examples is not judged: each example attends to its own keys only
    here, also where a family's mask spans the whole row (Gemma-4's sliding layers)."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple[weakref.ref, bool]] = {}

    def plain(self, mask: torch.Tensor, allowed: torch.Tensor, lengths: list[int],
              window: Optional[int] = None) -> bool:
        """`mask`: the tensor transformers passed (the same object to every layer of its kind in a forward, so
        the key); `allowed`: its booleans (a new tensor at every call: keyed by it, every layer judged it again,
        a device synchronisation each); `window`: the layer's sliding window, which the plain mask then holds."""
        key = (id(mask), window)
        entry = self._seen.get(key)
        if entry is not None and entry[0]() is mask:
            return entry[1]
        self._seen = {k: v for k, v in self._seen.items() if v[0]() is not None}
        plain = _causal_within_examples(allowed, lengths, window)
        self._seen[key] = (weakref.ref(mask), plain)
        return plain


# elements of the [batch, query rows, row] blocks a mask is judged in: its temporaries stay a few of these bytes (a
# whole 1 × 32,768 row at once made ~3 of 1 GiB each), the answer still read off the device once
JUDGED_AT_ONCE = 2**26


def _causal_within_examples(allowed: torch.Tensor, lengths: list[int], window: Optional[int]) -> bool:
    """Whether the [batch, heads or 1, row, row] booleans are causal (within `window`) within each example, judged
    in blocks of query rows; the examples' ids made on the host and copied from pinned memory (built on the device
    from the lengths, repeat_interleave waits for the device)."""
    batch, length = allowed.shape[0], allowed.shape[-1]
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).view(batch, length)
    segment = host_to_device(ids, allowed.device)
    position = torch.arange(length, device=allowed.device)
    step = max(1, JUDGED_AT_ONCE // (batch * length))
    verdicts = []
    for start in range(0, length, step):
        rows = slice(start, start + step)
        wanted = causal(position[rows], position, window)
        across = (segment[:, rows, None] != segment[:, None, :])[:, None]
        verdicts.append((across | (allowed[:, :, rows] == wanted)).all())
    return bool(torch.stack(verdicts).all())


def causal(queries: torch.Tensor, keys: torch.Tensor, window: Optional[int] = None) -> torch.Tensor:
    """[queries, keys] of positions: causal attention (within `window`: query i sees keys j with i - window < j <= i,
    as transformers' sliding window)."""
    distance = queries[:, None] - keys[None, :]
    return (distance >= 0) & (distance < window) if window is not None else distance >= 0


def block_causal(lengths: list[int], batch: int, length: int, device: torch.device) -> torch.Tensor:
    """[batch, length, length]: causal attention within each packed example, none across."""
    segment = torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                      torch.tensor(lengths, device=device)).view(batch, length)
    position = torch.arange(length, device=device)
    return (segment[:, :, None] == segment[:, None, :]) & causal(position, position)


def _allowed(attention_mask: Optional[torch.Tensor], length: int) -> Optional[torch.Tensor]:
    """The [batch, heads or 1, query, key] mask transformers built for these rows as booleans (True: attended),
    or None where it passed none."""
    if attention_mask is None or attention_mask.dim() != 4:
        return None
    mask = attention_mask[..., :length]
    return mask if mask.dtype == torch.bool else mask == 0


def _example_mask(allowed: torch.Tensor, row: int, start: int, n: int, size: int) -> torch.Tensor:
    """An example's own block of the row's mask, [1, heads or 1, size, size] at the bucketed size: the padding
    keys hidden from its queries, the padding queries causal (their outputs are dropped; a query that sees no key
    would give NaN, and NaN times their zero gradient is still NaN in the keys' gradients)."""
    block = torch.ones(allowed.shape[1], size, size, dtype=torch.bool, device=allowed.device).tril_()
    block[:, :n, :] = False
    block[:, :n, :n] = allowed[row, :, start:start + n, start:start + n]
    blind = ~block.any(dim=-1)  # a query the mask gives no key (none in causal or windowed masks): its own
    if blind.any():
        block |= torch.diag_embed(blind)
    return block[None]


def _per_example(inner: Callable, kernel: Optional[Callable] = None) -> Callable:
    segments, kinds = _Segments(), _MaskKinds()

    def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: Optional[torch.Tensor], **kwargs: Any):
        position_ids = kwargs.get("position_ids")
        batch, _, length, _ = query.shape
        # Rows of their own (no KV cache: keys are the queries' positions), with one position id per query.
        usable = (position_ids is not None and key.shape[2] == length
                  and tuple(position_ids.shape) == (batch, length))
        lengths = segments(position_ids) if usable else None
        if lengths is None:
            return inner(module, query, key, value, attention_mask, **kwargs)
        window = kwargs.get("sliding_window")
        # The mask transformers built for the packed rows, where it is more than causal attention within each
        # example (within the layer's window): a window or chunks that some families (Phi-MoE, Qwen2-MoE, Llama-4)
        # put only there
        allowed = _allowed(attention_mask, length)
        masked = allowed is not None and not kinds.plain(attention_mask, allowed, lengths, window)
        # values no wider than queries and keys (multi-head latent attention's are narrower: padded for the kernel)
        plain = (not kwargs.get("dropout") and kwargs.get("softcap") is None and value.shape[3] <= query.shape[3]
                 and not masked)
        dtype = _varlen_dtype(query)
        around = _kernel_window(kernel, window, lengths) if kernel is not None and plain else None
        if around is not None and dtype is not None and _kernel_takes(query):
            q, k, v = (t.to(dtype) for t in (query, key, value))
            return _varlen_call(kernel, q, k, v, lengths, kwargs.get("scaling"), around), None
        kwargs = {k: v for k, v in kwargs.items() if k not in ("position_ids", "is_causal")}
        flat = [t.transpose(1, 2).reshape(batch * length, t.shape[1], t.shape[3]) for t in (query, key, value)]
        outputs, offset = [], 0
        for q, k, v in zip(*(t.split(lengths) for t in flat)):
            n = q.shape[0]
            padded = [_to_bucket(t.transpose(0, 1)[None], n) for t in (q, k, v)]
            size = padded[0].shape[2]
            if masked:  # the example's own block of transformers' mask, and the layer's window where it is shorter
                mask = _example_mask(allowed, offset // length, offset % length, n, size)
                if window is not None and n > window:  # (its diagonal kept: no query left without a key)
                    mask = mask & window_mask(size, window, q.device)
                out, _ = inner(module, *padded, mask, is_causal=False, **kwargs)
            elif window is not None and n > window:  # the layer's window, which sdpa reads only from a mask
                out, _ = inner(module, *padded, window_mask(size, window, q.device), is_causal=False, **kwargs)
            else:
                out, _ = inner(module, *padded, None, is_causal=True, **kwargs)
            outputs.append(out[0, :n])  # [example, heads, head_dim]: transformers' functions return [b, t, h, d]
            offset += n
        return torch.cat(outputs).view(batch, length, query.shape[1], value.shape[3]), None  # the values' width

    # under --torch_compile the lengths (a host list that changes every batch) would be baked into the layer's
    # graph and recompiled for at every batch: the call stays eager between the layer's compiled halves
    attention = torch.compiler.disable(attention, recursive=True)
    setattr(attention, FLAG, True)
    return attention


def window_mask(length: int, window: int, device: torch.device) -> torch.Tensor:
    """[1, 1, length, length] boolean mask of causal attention within a sliding window: query i sees keys j with
    i - window < j <= i (transformers' sliding_window_overlay). Mistral, Qwen2, Gemma-3, Phi-3, OLMo-3 and other
    families pass their sliding layers' window to the attention function, and sdpa applies it only through a
    mask: this one where transformers passed none for the row."""
    position = torch.arange(length, device=device)
    return causal(position, position, window)[None, None]


def installed() -> bool:
    """Whether transformers' "sdpa" entry routes packed rows through this module (`install`)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return getattr(ALL_ATTENTION_FUNCTIONS.get("sdpa"), FLAG, False)


def install(model: nn.Module, varlen: bool = False) -> bool:
    """Route the "sdpa" attention of packed rows through per-example calls (with `varlen`, through torch's
    variable-length flash attention where it applies); True if it now is. Models look their attention function
    up by name at each call in one process-wide table, so the entry is wrapped there (around whatever it holds,
    e.g. open_sft.model.bf16_matmul's)."""
    if getattr(getattr(model, "config", None), "_attn_implementation", None) != "sdpa":
        return False
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    current = ALL_ATTENTION_FUNCTIONS["sdpa"]
    if not getattr(current, FLAG, False):
        ALL_ATTENTION_FUNCTIONS["sdpa"] = _per_example(current, varlen_kernel() if varlen else None)
    return True


def packed_sdpa(varlen: bool = True) -> Callable:
    """transformers' sdpa attention function with packed rows attended one example at a time (with `varlen`, in one
    call of torch's variable-length flash attention where it applies): a function to register under a name of its
    own with transformers' AttentionInterface, for a trainer that is not open_sft (scripts/benchmark_trl.py gives TRL
    the kernel open_sft's packed rows use on a GPU this way)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return _per_example(sdpa_attention_forward, varlen_kernel() if varlen else None)
