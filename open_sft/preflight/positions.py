"""Token positions per optimizer step, as the run will collate them: what the preflight's time probe scales by,
and the largest micro-batch, which the activations' memory scales with."""

from __future__ import annotations

from typing import Any

from open_sft.data.batching import best_fit_decreasing, locate


def micro_batch_positions(sizes: list[int], packing: bool, row_capacity: int) -> int:
    """Token positions a micro-batch computes as it will be collated: unpacked ones pad to their longest
    example; packed ones lay examples into rows (best-fit-decreasing) padded to the fullest row."""
    if not packing:
        return len(sizes) * max(sizes)
    rows, _ = best_fit_decreasing(dict(enumerate(sizes)), row_capacity)
    rows = [row for row in rows if row]
    return len(rows) * max(sum(sizes[i] for i in row) for row in rows)


def step_slots(steps: Any, lengths: list[int], packing: bool) -> tuple[list[int], int, int]:
    """Token positions computed at every optimizer step of the run (all ranks, a filler's too: the last step of an
    epoch computes example 0 in each empty micro-batch slot, open_sft.data.batching.as_filler); those of the largest
    micro-batch any rank computes (what activations scale with) and its width if it needs a padding mask."""
    plan, slots, largest, width = steps.plan, [], 0, 0
    for step in range(steps.total_steps):
        epoch, in_epoch = locate(plan, step)
        total = 0
        for rank in range(steps.layout.world_size):
            for indices in plan.micro_batches(epoch, in_epoch, rank):
                sizes = [lengths[i] for i in indices or [0]]  # an empty slot computes a filler: example 0
                positions = micro_batch_positions(sizes, packing, steps.max_seq_length)
                total += positions
                if positions > largest:
                    largest = positions
                    width = max(sizes) if not packing and min(sizes) != max(sizes) else 0
        slots.append(total)
    return slots, largest, width
