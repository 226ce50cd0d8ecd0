"""Which examples each rank trains on at each optimizer step, and how they are padded.

We shard by hand instead of using a prepared DataLoader so that the global batch of an optimizer
step depends only on (seed, epoch, step) and its size: 1 process with micro-batch 8 sees exactly
the examples that 2 ranks × micro-batch 2 × accumulation 2 see. That makes the batch layout a pure
performance choice (the loss is normalised over the global batch) and resume exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from open_sft.data.balance import balance_packed, balance_unpacked
from open_sft.data.labels import IGNORE_INDEX, Example


# What a collated micro-batch carries for the step's counts, not for the model: each example's length (tokens, the
# strict attention count) and each row's real tokens (the PaLM attention count); taken out before the forward.
COUNT_KEYS = ("lengths", "row_lengths")


def pop_counts(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(example lengths, row lengths) of a collated micro-batch, removed from it."""
    lengths, rows = (batch.pop(key) for key in COUNT_KEYS)
    return lengths, rows


@dataclass(frozen=True)
class BatchLayout:
    micro_batch_size: int
    gradient_accumulation_steps: int
    world_size: int

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.gradient_accumulation_steps * self.world_size


def steps_per_epoch(n_examples: int, layout: BatchLayout) -> int:
    """Optimizer steps in one pass; the last, partial global batch is kept (its empty slots are filled
    with examples that carry no loss)."""
    return math.ceil(n_examples / layout.global_batch_size)


def epoch_order(n_examples: int, seed: int, epoch: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(n_examples, generator=generator).tolist()


def micro_batches_for_rank(order: list[int], step_in_epoch: int, layout: BatchLayout, rank: int) -> list[list[int]]:
    """The example indices of each of this rank's micro-batches at one optimizer step.

    Micro-batch slot k = accumulation_index * world_size + rank takes positions
    [k * micro_batch_size, (k + 1) * micro_batch_size) of the step's global batch. A slot past the end
    of a partial last batch is empty; the caller fills it with a loss-free example so every rank still
    runs the same number of forward/backward passes (collectives must match).
    """
    start = step_in_epoch * layout.global_batch_size
    global_batch = order[start : start + layout.global_batch_size]
    out = []
    for accumulation_index in range(layout.gradient_accumulation_steps):
        k = accumulation_index * layout.world_size + rank
        out.append(global_batch[k * layout.micro_batch_size : (k + 1) * layout.micro_batch_size])
    return out


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """The micro-batch on the device the model computes on (batches are collated on the host; on CPU this moves
    nothing)."""
    return {key: value.to(device, non_blocking=True) for key, value in batch.items()}


def host_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor the host made during a step, on `device` without the host waiting for the device: CUDA copies from
    pageable memory only once the work queued before them is done (it stages them), from pinned memory
    asynchronously (the batches collated ahead are pinned already: open_sft.training.micro_batches)."""
    if device.type == "cuda" and not tensor.is_pinned():
        tensor = tensor.pin_memory()  # torch's caching host allocator: no new pinned allocation at every step
    return tensor.to(device, non_blocking=True)


def collate(examples: list[Example], pad_token_id: int, loss_free: bool = False,
            sources: Optional[list[int]] = None) -> dict[str, torch.Tensor]:
    """Right-pad to the longest example in the micro-batch (not to max_seq_length). With `sources` (the source
    index of each example), "sources" gives each position's source, for per-source losses; `loss_free`: a filler
    (`as_filler`)."""
    length = max(len(e.input_ids) for e in examples)
    input_ids = torch.full((len(examples), length), pad_token_id, dtype=torch.long)
    labels = torch.full((len(examples), length), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), length), dtype=torch.long)
    for row, example in enumerate(examples):
        n = len(example.input_ids)
        input_ids[row, :n] = torch.tensor(example.input_ids)
        if not loss_free:
            labels[row, :n] = torch.tensor(example.labels)
        attention_mask[row, :n] = 1
    lengths = torch.tensor([len(e.input_ids) for e in examples])
    batch = {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask,
             "lengths": lengths, "row_lengths": lengths.clone()}
    if sources is not None:
        batch["sources"] = torch.tensor(sources, dtype=torch.long)[:, None].expand(-1, length).contiguous()
    return as_filler(batch) if loss_free else batch


def real_positions(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """1 at each row's real tokens (its `row_lengths`), 0 at the padding after them, as an attention mask marks
    them: what an MoE router's load-balancing loss counts in packed rows, which have no attention mask."""
    return (torch.arange(batch["input_ids"].shape[1]) < batch["row_lengths"][:, None]).long()


def as_filler(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A collated micro-batch made a filler: what an empty micro-batch slot computes (the last step of an epoch),
    so that every rank runs the same passes. It is not data: it trains no label and its counts are zero, so its
    tokens count nowhere (total_tokens, tokens/s, the model FLOPs of MFU); its positions are computed, so they
    count as padding (padding_ratio). MFU leaves them out as it leaves padding out: it measures the model FLOPs
    of the data, and the device's time on a filler or on padding is what lowers it."""
    batch["labels"].fill_(IGNORE_INDEX)
    for key in COUNT_KEYS:
        batch[key] = torch.zeros_like(batch[key])
    return batch


def best_fit_decreasing(lengths: dict[int, int], capacity: int, bins: Optional[int] = None) -> tuple[list[list[int]], list[int]]:
    """Pack items (index → length) into bins of `capacity` tokens, longest first, each into the
    fullest bin it fits. With a fixed number of `bins`, items that fit nowhere are returned as
    left over (in their original order) instead of opening a new bin."""
    contents: list[list[int]] = [[] for _ in range(bins or 0)]
    free: list[int] = [capacity] * (bins or 0)
    leftover = []
    for index in sorted(lengths, key=lambda i: (-lengths[i], i)):
        size = lengths[index]
        fits = [b for b in range(len(free)) if free[b] >= size]
        if fits:
            best = min(fits, key=lambda b: (free[b], b))
        elif bins is None:
            contents.append([])
            free.append(capacity)
            best = len(free) - 1
        else:
            leftover.append(index)
            continue
        contents[best].append(index)
        free[best] -= size
    order = {index: position for position, index in enumerate(lengths)}
    return contents, sorted(leftover, key=order.__getitem__)


class UnpackedPlan:
    """Fixed-size global batches: micro_batch_size × accumulation × ranks examples per step. With the
    examples' `lengths`, each step's examples are laid out token-balanced over ranks and micro-batches
    (open_sft.data.balance); without, in shuffled order."""

    def __init__(self, n_examples: int, layout: BatchLayout, seed: int, lengths: Optional[list[int]] = None):
        self.n_examples, self.layout, self.seed, self.lengths = n_examples, layout, seed, lengths
        self._order: tuple[int, list[int]] | None = None

    def steps_in_epoch(self, epoch: int) -> int:
        return steps_per_epoch(self.n_examples, self.layout)

    def micro_batches(self, epoch: int, step_in_epoch: int, rank: int) -> list[list[int]]:
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, epoch_order(self.n_examples, self.seed, epoch))
        if self.lengths is None:
            return micro_batches_for_rank(self._order[1], step_in_epoch, self.layout, rank)
        size, world = self.layout.global_batch_size, self.layout.world_size
        batch = self._order[1][step_in_epoch * size:(step_in_epoch + 1) * size]
        slots = balance_unpacked(batch, self.lengths, self.layout.micro_batch_size, world,
                                 self.layout.gradient_accumulation_steps)
        return [slots[a * world + rank] for a in range(self.layout.gradient_accumulation_steps)]


class PackedPlan:
    """--packing: each optimizer step takes examples in the epoch's shuffled order and packs them,
    best-fit-decreasing, into gradient_accumulation × world_size micro-batches of at most
    `max_tokens` tokens; whatever does not fit waits for the next step. The plan of an epoch depends
    only on (seed, epoch, lengths, budget, accumulation × ranks), so every rank computes the same one.
    With `balance`, each step's examples are then spread evenly over its micro-batches and ranks
    (open_sft.data.balance); the examples of each step stay the same."""

    def __init__(self, lengths: list[int], layout: BatchLayout, seed: int, max_tokens: int, balance: bool = False):
        self.lengths, self.layout, self.seed, self.max_tokens = lengths, layout, seed, max_tokens
        self.balance = balance
        self._epochs: dict[int, list[list[list[int]]]] = {}

    def epoch(self, epoch: int) -> list[list[list[int]]]:
        """Steps of the epoch, each a list of micro-batch slots (slot k = accumulation_index × world + rank)."""
        if epoch not in self._epochs:
            slots = self.layout.gradient_accumulation_steps * self.layout.world_size
            queue = epoch_order(len(self.lengths), self.seed, epoch)
            steps, carry, position = [], [], 0
            while carry or position < len(queue):
                window, budget = list(carry), slots * self.max_tokens - sum(self.lengths[i] for i in carry)
                while position < len(queue) and budget >= self.lengths[queue[position]]:
                    budget -= self.lengths[queue[position]]
                    window.append(queue[position])
                    position += 1
                # Every example fits an empty micro-batch (max_tokens >= max_seq_length), so the
                # longest is always placed and each step makes progress.
                bins, carry = best_fit_decreasing({i: self.lengths[i] for i in window}, self.max_tokens, slots)
                if self.balance:
                    bins = balance_packed(bins, self.lengths, self.max_tokens, self.layout.world_size,
                                          self.layout.gradient_accumulation_steps)
                steps.append(bins)
            self._epochs[epoch] = steps
        return self._epochs[epoch]

    def steps_in_epoch(self, epoch: int) -> int:
        return len(self.epoch(epoch))

    def micro_batches(self, epoch: int, step_in_epoch: int, rank: int) -> list[list[int]]:
        bins = self.epoch(epoch)[step_in_epoch]
        world = self.layout.world_size
        return [bins[a * world + rank] for a in range(self.layout.gradient_accumulation_steps)]


def collate_packed(examples: list[Example], pad_token_id: int, row_capacity: int,
                   sources: Optional[list[int]] = None) -> dict[str, torch.Tensor]:
    """Lay a micro-batch's examples into rows of at most `row_capacity` tokens (best-fit-decreasing),
    with position ids restarting at each example and no attention mask: transformers then builds a
    block-diagonal causal mask from the position ids (varlen kernels on GPU), so no token attends
    across an example boundary. Each example's first label is masked so no loss crosses it either."""
    rows, _ = best_fit_decreasing({i: len(e.input_ids) for i, e in enumerate(examples)}, row_capacity)
    rows = [row for row in rows if row]
    width = max(sum(len(examples[i].input_ids) for i in row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    source_ids = torch.zeros((len(rows), width), dtype=torch.long)
    lengths, row_lengths = [], []
    for r, row in enumerate(rows):
        cursor = 0
        for i in sorted(row):
            n = len(examples[i].input_ids)
            input_ids[r, cursor : cursor + n] = torch.tensor(examples[i].input_ids)
            labels[r, cursor + 1 : cursor + n] = torch.tensor(examples[i].labels[1:])
            position_ids[r, cursor : cursor + n] = torch.arange(n)
            if sources is not None:
                source_ids[r, cursor : cursor + n] = sources[i]
            lengths.append(n)
            cursor += n
        row_lengths.append(cursor)
        position_ids[r, cursor:] = torch.arange(width - cursor)  # padding: a block of its own, no loss
    batch = {"input_ids": input_ids, "labels": labels, "position_ids": position_ids,
             "lengths": torch.tensor(lengths), "row_lengths": torch.tensor(row_lengths)}
    if sources is not None:
        batch["sources"] = source_ids
    return batch


def locate(plan, step: int) -> tuple[int, int]:
    """(epoch, step within the epoch) of a global optimizer step."""
    epoch = 0
    while step >= plan.steps_in_epoch(epoch):
        step -= plan.steps_in_epoch(epoch)
        epoch += 1
    return epoch, step


def count_trained_batch(labels: torch.Tensor) -> int:
    """Trained tokens of a collated batch: labels are shifted by one inside the model, so position 0 of a row
    never gets a loss (the batch form of open_sft.data.labels.count_trained)."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def trained_index(labels: torch.Tensor) -> torch.Tensor:
    """The flat index, into a [rows × length] batch's positions, of each position that predicts a trained label
    (position t of row b predicts labels[b, t + 1]), in the loss's order (row-major, as count_trained_batch counts
    them). Found on the host, where the collated labels are, and handed to the loss with the batch: selecting the
    trained positions on a GPU by a boolean mask would make the host wait for the device to count them."""
    rows, columns = (labels[:, 1:] != IGNORE_INDEX).nonzero(as_tuple=True)
    return rows * labels.shape[1] + columns


def trained_sources(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The source of each trained position of a collated batch, in the order the loss visits them (row-major
    over labels[:, 1:] != IGNORE_INDEX, as count_trained_batch counts them)."""
    return batch["sources"][:, 1:][batch["labels"][:, 1:] != IGNORE_INDEX]
