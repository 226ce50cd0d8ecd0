"""--sequence_parallel_size N: DeepSpeed Ulysses (ALST) sequence parallelism, through accelerate.

The data plan stays the one of data parallelism over all ranks: every rank has its own micro-batches. An
SP group of N ranks then computes its members' micro-batches together, one after the other: DeepSpeed's
`UlyssesSPDataLoaderAdapter` gathers the group's micro-batches, shifts the labels and gives each rank 1/N
of every sequence, and `UlyssesSPAttentionHF` (registered with transformers by accelerate's `prepare`)
all-to-alls the attention heads so each rank attends over whole sequences for 1/N of the heads. A
micro-step thus becomes N passes over 1/N of the length: no rank ever holds a whole sequence's
activations, which is what lets --max_seq_length exceed one rank's memory. The global batch, the
token-normalised loss (each trained token is in exactly one rank's slice, so the global count is counted
once) and the step plan are those of the same world without SP.

What Ulysses needs and we arrange: every pass has the same number of rows on every rank (it checks the
micro-batch size), so padded micro-batches are filled up to --per_device_train_batch_size rows with loss-free
rows (and token balancing, whose micro-batches vary in rows, is off), and a packed micro-batch is one row of
the --max_tokens_per_batch budget; every sequence length is padded to a multiple of N.

Ulysses hands attention no mask (its local mask would be wrong after the all-to-all) and relies on position
ids: flash-attention's varlen kernels separate packed examples by them, sdpa does not, so under --packing we
wrap transformers' sdpa to build the block-diagonal causal mask from the gathered position ids (O(length²)
memory for that mask; flash_attention_2 on GPU needs none).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

from open_sft.data.batching import COUNT_KEYS
from open_sft.data.labels import IGNORE_INDEX
from open_sft.model.anatomy import layer_values

if TYPE_CHECKING:
    from open_sft.distributed.parallelism import Parallelism


def sequence_parallel_problems(size: int, world: int, deepspeed: bool, args: Any, model_config: Any,
                               attn_implementation: str) -> list[str]:
    """What --sequence_parallel_size N cannot do with this run, each with the fix."""
    if size == 1:
        return []
    flag = f"--sequence_parallel_size {size}"
    problems = []
    if not deepspeed:
        problems.append(f"{flag} runs on DeepSpeed Ulysses: launch with DeepSpeed ZeRO-2 or ZeRO-3 (accelerate "
                        "launch --use_deepspeed --deepspeed_config_file configs/ds/zero2.json ...)")
    if world % size:
        problems.append(f"{flag} must divide the number of processes ({world})")
    if args.lora.use_qlora:
        problems.append(f"{flag} does not work with --use_qlora (4-bit weights under ZeRO); use --use_lora or full "
                        "training")
    if attn_implementation == "eager":
        problems.append(f"{flag} needs sdpa or flash_attention_2 (eager builds a full attention mask per rank)")
    for heads in dict.fromkeys(h for h in layer_values(model_config, "num_attention_heads") if h is not None):
        if heads % size:  # each layer's (a per_layer_config may give them layer by layer)
            problems.append(f"{flag} must divide the model's attention heads ({heads}): each rank attends with 1/N "
                            "of them")
    for kv in dict.fromkeys(h for h in layer_values(model_config, "num_key_value_heads") if h is not None):
        if kv % size and size % kv:  # DeepSpeed's Ulysses splits the key/value heads or repeats them over ranks
            problems.append(f"{flag} and the model's key/value heads ({kv}): one must divide the other (each rank "
                            "attends with 1/N of the heads, DeepSpeed Ulysses splits or repeats the key/value ones)")
    if args.train.loss_normalization == "mean":
        problems.append(f"{flag} does not work with --loss_normalization mean (a micro-batch's mean spans ranks); "
                        "use token or sum")
    if args.train.balance_micro_batches and not args.train.packing:
        problems.append(f"{flag} keeps --per_device_train_batch_size rows in every padded micro-batch: drop "
                        "--balance_micro_batches (balanced micro-batches vary in rows), or use --packing")
    if args.train.auto_micro_batch_size:
        problems.append(f"{flag} does not work with --auto_micro_batch_size; set the micro-batch size")
    return problems


def parallelism_config(size: int, world: int, attn_implementation: str) -> Any:
    """accelerate's ParallelismConfig for Ulysses SP of `size` over `world` ranks (data parallel over the rest)."""
    from accelerate.utils import ParallelismConfig
    from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig

    return ParallelismConfig(sp_backend="deepspeed", sp_size=size, dp_replicate_size=world // size,
                             sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True,
                                                                        sp_attn_implementation=attn_implementation))


def group_widths(plan: Any, epoch: int, step: int, lengths: list[int], packed: bool) -> list[int]:
    """At each micro-step, the longest micro-batch of this rank's SP group (a row of a packed micro-batch holds
    all its examples; an empty slot computes example 0). DeepSpeed's adapter gathers the group's micro-batches,
    and gloo gathers only tensors of one shape: every member pads to this width. Every rank computes it from
    the plan, a pure function, so no collective is needed."""
    from deepspeed.utils import groups

    members = torch.distributed.get_process_group_ranks(groups._get_sequence_parallel_group())
    per_rank = [plan.micro_batches(epoch, step, rank) for rank in members]

    def width(indices: list[int]) -> int:
        chosen = [lengths[i] for i in indices or [0]]
        return sum(chosen) if packed else max(chosen)

    return [max(width(micro_batches[a]) for micro_batches in per_rank) for a in range(len(per_rank[0]))]


def fit_for_ulysses(batch: dict[str, torch.Tensor], size: int, rows: int, pad_token_id: int,
                    width: int = 0) -> dict[str, torch.Tensor]:
    """The micro-batch with `rows` rows (extra rows loss-free padding) and at least `width` positions, a multiple
    of `size`, without the attention mask (right padding needs none: no real token attends a later position).
    The counts (`lengths` per example, `row_lengths` per row; not per position) pass through."""
    out = {k: batch[k] for k in COUNT_KEYS if k in batch}
    batch = {k: v for k, v in batch.items() if k not in ("attention_mask", *COUNT_KEYS)}
    if "position_ids" not in batch:
        batch["position_ids"] = torch.arange(batch["input_ids"].shape[1]).expand_as(batch["input_ids"]).clone()
    n, length = batch["input_ids"].shape
    width = -(-max(length, width) // size) * size
    fill = {"input_ids": pad_token_id, "labels": IGNORE_INDEX, "sources": 0}
    for key, value in batch.items():
        grown = torch.full((max(rows, n), width), fill.get(key, 0), dtype=value.dtype)
        grown[:n, :length] = value
        if key == "position_ids":  # padding continues the positions: its own block, after every real token
            grown[:, length:] = torch.arange(length, width)
            grown[n:] = torch.arange(width)
        out[key] = grown
    return out


def shard(accelerator: Any, model: Any, batches: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """Each rank's slices of its SP group's micro-batches, len(batches) × N passes (DeepSpeed's adapter: it
    gathers the group's micro-batches, adds `shift_labels` and shards every [rows, length] tensor)."""
    adapter = accelerator.deepspeed_ulysses_dl_adapter(batches, model)
    return [next(adapter) for _ in range(len(batches) * accelerator.parallelism_config.sp_size)]


def slice_inputs(shard_batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A slice's model inputs: without `sources`, and without a `router_mask` of no real position (a slice of
    padding alone, after a short micro-batch of the group: the router loss of no position is NaN; unmasked it is
    finite, and weighted by the slice's trained tokens, none, it adds nothing)."""
    drop = {"sources"} | ({"router_mask"} if "router_mask" in shard_batch and not shard_batch["router_mask"].any()
                          else set())
    return {k: v for k, v in shard_batch.items() if k not in drop}


def trained_shard_sources(shard_batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The source of each trained position of a slice, in the order the loss visits them."""
    return shard_batch["sources"][shard_batch["shift_labels"] != IGNORE_INDEX]


def ulysses_config(config: Any) -> Any:
    """The config accelerate's Ulysses setup reads off the prepared model: a copy whose text config states its
    `head_dim`. DeepSpeed takes the head width as `getattr(config, "head_dim", hidden // heads)`, which a config
    holding `head_dim: null` (Mixtral's) defeats: every rank crashed in torch.Size with None. The model keeps its
    own config (an export writes it as it was)."""
    import copy

    text = config.get_text_config()
    if getattr(text, "head_dim", 0) is not None:
        return config
    ulysses = copy.deepcopy(config)
    ulysses_text = ulysses.get_text_config()
    ulysses_text.head_dim = ulysses_text.hidden_size // ulysses_text.num_attention_heads
    return ulysses


def install_document_sdpa() -> None:
    """Make transformers' sdpa separate packed examples by their position ids when it gets no mask (under
    Ulysses); with a mask, or when no row restarts its positions, it is sdpa unchanged. Call before
    accelerate registers Ulysses, which wraps whatever "sdpa" is then."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    original = ALL_ATTENTION_FUNCTIONS["sdpa"]
    if getattr(original, "open_sft_documents", False):
        return

    def document_sdpa(module, query, key, value, attention_mask, *args, **kwargs):
        mask = _document_mask(kwargs.get("position_ids"), query.shape[2]) if attention_mask is None else None
        return original(module, query, key, value, mask if mask is not None else attention_mask, *args, **kwargs)

    document_sdpa.open_sft_documents = True
    ALL_ATTENTION_FUNCTIONS["sdpa"] = document_sdpa


def _document_mask(position_ids: Optional[torch.Tensor], length: int) -> Optional[torch.Tensor]:
    """[rows, 1, length, length] boolean block-diagonal causal mask, or None when no row restarts positions."""
    if position_ids is None or position_ids.shape[-1] != length:
        return None
    starts = position_ids == 0
    if not bool(starts[:, 1:].any()):
        return None
    document = starts.cumsum(dim=-1)
    same = document[:, :, None] == document[:, None, :]
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    return (same & causal)[:, None]


def sequence_parallel_launch(config: Any, parallelism: Parallelism,
                             attn: str) -> tuple[Optional[Any], dict[str, int]]:
    """(accelerate's ParallelismConfig or None, the DeepSpeed config's batch numbers) for this run (what SP cannot
    do was refused up front: open_sft.config.launch_check). Under SP DeepSpeed sees world/N data-parallel ranks,
    each accumulating N passes per micro-batch, of `rows` rows: the same global batch."""
    t, size, world = config.train, parallelism.sp, parallelism.world_size
    batch = {"micro_batch_size": t.per_device_train_batch_size,
             "gradient_accumulation_steps": t.gradient_accumulation_steps, "world_size": world}
    if size == 1:
        return None, batch
    if t.packing:
        install_document_sdpa()
    rows = 1 if t.packing else t.per_device_train_batch_size
    return parallelism_config(size, world, attn), {"micro_batch_size": rows, "world_size": world // size,
                                                   "gradient_accumulation_steps": t.gradient_accumulation_steps * size}
