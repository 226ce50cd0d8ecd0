"""The micro-batches of an optimizer step, as each rank computes them: collated from the step plan (a pure
function of the step and the rank, so any rank can collate another's), under Ulysses SP cut into this rank's
slices of its group's micro-batches, under TP or PP joined with the other members' of the group."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional

import torch

from open_sft.data.batching import (COUNT_KEYS, as_filler, collate, collate_packed, count_trained_batch, locate,
                                   real_positions)
from open_sft.data.token_rows import IGNORE_INDEX
from open_sft.distributed.sequence_parallel import (fit_for_ulysses, group_widths, shard, slice_inputs,
                                                    trained_shard_sources)

Batch = dict[str, torch.Tensor]
# a forward pass: inputs, each trained position's source (None: a TP group member's pass), trained tokens
Pass = tuple[Batch, Optional[torch.Tensor], int]


class StepBatches:
    """Collates the plan's micro-batches for a rank (`for_rank`; a step's own, collated ahead: `for_step`), and the
    forward passes this rank runs (`passes`); `sp_size` > 1: Ulysses sequence parallelism, `tp_ranks`: this rank's
    TP group; `routed`: the model trains an MoE router's load-balancing loss (packed micro-batches then carry
    `router_mask`, their real positions: the padding after a row's examples is not routed data; so do padded ones
    under SP, which drops their attention mask).

    `ahead` (on a GPU): while the device computes a step, a background thread collates the next step's
    micro-batches into pinned memory, so the host does not collate between the steps while the device waits (7.5 ms
    of a 278 ms step of the 1B shape on an H200: docs/benchmarks.md) and the copies to the device run
    asynchronously. The plan is a pure function of the step and the rank, so the batches are those collated then
    (tested). Not on a CPU, where the thread would take cores from the step itself."""

    def __init__(self, data: Any, steps: Any, args: Any, pad_token_id: int, process_index: int, sp_size: int = 1,
                 tp_ranks: Optional[list[int]] = None, ahead: bool = False, routed: bool = False):
        self.data, self.steps, self.args, self.pad_token_id = data, steps, args, pad_token_id
        self.process_index, self.sp_size, self.tp_ranks = process_index, sp_size, tp_ranks or []
        self.routed = routed
        self.example_lengths = data.lengths() if sp_size > 1 else []  # the plan's, for SP group widths
        self.ahead = ThreadPoolExecutor(1, thread_name_prefix="open_sft-collate") if ahead else None
        self.pending: Optional[tuple[int, Future]] = None  # (step, its micro-batches being collated)

    def for_step(self, step: int, next_step: Optional[int] = None) -> list[tuple[Batch, list[int]]]:
        """This rank's micro-batches of `step` (collated ahead when they were); with `ahead`, those of `next_step`
        start collating now."""
        pending, self.pending = self.pending, None
        batches = pending[1].result() if pending is not None and pending[0] == step else self.for_rank(step)
        if self.ahead is not None and next_step is not None:
            self.pending = (next_step, self.ahead.submit(self._pinned, next_step))
        return batches

    def _pinned(self, step: int) -> list[tuple[Batch, list[int]]]:
        return [({k: v.pin_memory() for k, v in batch.items()}, indices) for batch, indices in self.for_rank(step)]

    def close(self) -> None:
        """Stop collating ahead (the loop has ended: a step collated for nothing is dropped)."""
        if self.ahead is not None:
            self.ahead.shutdown(wait=False, cancel_futures=True)
            self.pending = None

    def collate(self, indices: list[int], loss_free: bool = False, width: int = 0) -> Batch:
        examples, sources = [self.data.example(i) for i in indices], [self.data.source(i) for i in indices]
        if self.args.packing:
            # Under SP a packed micro-batch is one row of the whole budget (Ulysses wants fixed rows).
            capacity = self.steps.max_seq_length if self.sp_size == 1 else self.steps.plan.max_tokens
            batch = collate_packed(examples, self.pad_token_id, capacity, sources)
            if self.routed:  # before a filler's counts are zeroed: a mask of no position is NaN
                batch["router_mask"] = real_positions(batch)
            if loss_free:
                batch = as_filler(batch)
        else:
            batch = collate(examples, self.pad_token_id, loss_free=loss_free, sources=sources)
            if self.routed and self.sp_size > 1:  # Ulysses takes no attention mask: the router loss keeps it
                batch["router_mask"] = batch["attention_mask"]
        if self.sp_size > 1:  # router_mask grows with 0 (padding) and is cut per rank as the input ids are
            rows = 1 if self.args.packing else self.steps.layout.micro_batch_size
            batch = fit_for_ulysses(batch, self.sp_size, rows, self.pad_token_id, width)
        return batch

    def for_rank(self, step: int, rank: Optional[int] = None) -> list[tuple[Batch, list[int]]]:
        """(collated micro-batch, its example indices) of each micro-batch slot of the step on `rank` (this one
        by default); an empty slot (end of an epoch) is a filler, a loss-free micro-batch: same compute on every rank,
        no tokens counted (batching.as_filler)."""
        epoch, step_in_epoch = locate(self.steps.plan, step)
        rank = self.process_index if rank is None else rank
        micro_batches = self.steps.plan.micro_batches(epoch, step_in_epoch, rank)
        widths = [0] * len(micro_batches) if self.sp_size == 1 else group_widths(
            self.steps.plan, epoch, step_in_epoch, self.example_lengths, self.args.packing)
        batches = []
        for indices, width in zip(micro_batches, widths):
            if indices:
                batches.append((self.collate(indices, width=width), indices))
            else:
                batches.append((self.collate([0], loss_free=True, width=width), []))
        return batches

    def group(self, step: int, own: list, ranks: list[int]) -> list:
        """The micro-batches of a group of ranks (a TP group, a pipeline replica), slot by slot and member by
        member: every member collates the others' from the plan, so no collective is needed."""
        members = [own if rank == self.process_index else self.for_rank(step, rank) for rank in ranks]
        return [batches[slot] for slot in range(len(own)) for batches in members]

    def passes(self, step: int, batches: list[Batch], positions: list[torch.Tensor], counts: list[int],
               accelerator: Any = None, model: Any = None) -> list[Pass]:
        """(inputs, source of each trained position, trained tokens) of each forward pass of the step: the
        micro-batches, under SP this rank's slices of its group's micro-batches (collective: `accelerator` and
        `model` name the group), under TP its group's micro-batches (another member's pass has no sources: its
        loss is counted on its own rank)."""
        if self.sp_size > 1:
            slices = shard(accelerator, model, batches)
            return [(slice_inputs(s), trained_shard_sources(s), int((s["shift_labels"] != IGNORE_INDEX).sum()))
                    for s in slices]
        own = [({k: v for k, v in b.items() if k != "sources"}, p, c) for b, p, c in zip(batches, positions, counts)]
        if not self.tp_ranks:
            return own
        members = {rank: [({k: v for k, v in b.items() if k not in ("sources", *COUNT_KEYS)}, None,
                           count_trained_batch(b["labels"])) for b, _ in self.for_rank(step, rank)]
                   for rank in self.tp_ranks if rank != self.process_index}
        members[self.process_index] = own
        return [members[rank][slot] for slot in range(len(own)) for rank in self.tp_ranks]
