"""Which examples each rank trains on at each optimizer step, and how they are padded.

We shard by hand instead of using a prepared DataLoader so that the global batch of an optimizer
step depends only on (seed, epoch, step) and its size: 1 process with micro-batch 8 sees exactly
the examples that 2 ranks × micro-batch 2 × accumulation 2 see. That makes the batch layout a pure
performance choice (the loss is normalised over the global batch) and resume exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from open_sft.data.tokenize import IGNORE_INDEX, Example


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


def collate(examples: list[Example], pad_token_id: int, loss_free: bool = False) -> dict[str, torch.Tensor]:
    """Right-pad to the longest example in the micro-batch (not to max_seq_length)."""
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
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}
