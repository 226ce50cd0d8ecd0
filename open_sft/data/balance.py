"""Token-balanced ranks: lay a global batch's examples into micro-batch slots so every rank computes about
the same number of token positions at each micro-step and over the step.

Ranks meet at every gradient all-reduce (and, under ZeRO-3, at every layer's gather), so the step runs at
the pace of the rank with the most tokens. Dealing a fixed number of examples to each rank in shuffled
order ignores their lengths; on real data (10 to 2,000 tokens) one rank can carry several times another's
tokens. These functions only decide which slot an example of the step goes to, never which examples make
the step, so the global batch, and with token or sum loss normalisation the math, stay the same. Each is a
pure function of the step's examples and their lengths: every rank computes the same layout, and a resume
recomputes it exactly.

Slot k = accumulation_index × world_size + rank, as in open_sft.data.batching.
"""

from __future__ import annotations

from typing import Callable, Sequence


def assign_to_ranks(groups: list[list[int]], cost: Callable[[list[int]], int], world: int,
                    accumulation: int) -> list[list[int]]:
    """Slots for `groups` (at most world × accumulation; missing ones are empty slots). Heaviest first, each
    group goes to the rank that computes least so far among those with a free micro-step (longest processing
    time first, with equal counts), which evens the ranks' sums over the step. Each rank then runs its
    micro-batches heaviest first, so at every micro-step the ranks hold groups of similar rank in their own
    order, and those are close in cost when the sums are."""
    per_rank: list[list[list[int]]] = [[] for _ in range(world)]
    load = [0] * world
    for group in sorted(groups, key=lambda g: -cost(g)):
        rank = min((r for r in range(world) if len(per_rank[r]) < accumulation), key=lambda r: (load[r], r))
        per_rank[rank].append(group)
        load[rank] += cost(group)
    return _slots(per_rank, cost, world, accumulation)


def _slots(per_rank: list[list[list[int]]], cost: Callable[[list[int]], int], world: int,
           accumulation: int) -> list[list[int]]:
    """Slot a × world + rank = rank's a-th heaviest micro-batch (empty when it has fewer)."""
    slots: list[list[int]] = [[] for _ in range(world * accumulation)]
    for rank, groups in enumerate(per_rank):
        for a, group in enumerate(sorted(groups, key=lambda g: -cost(g))):
            slots[a * world + rank] = group
    return slots


def padded_cost(lengths: Sequence[int]) -> Callable[[list[int]], int]:
    """Token positions a padded micro-batch computes: its examples × its longest example."""
    return lambda group: len(group) * max((lengths[i] for i in group), default=0)


def packed_cost(lengths: Sequence[int]) -> Callable[[list[int]], int]:
    """Tokens of a packed micro-batch (its rows are filled end to end)."""
    return lambda group: sum(lengths[i] for i in group)


def balance_unpacked(batch: list[int], lengths: Sequence[int], micro_batch_size: int, world: int,
                     accumulation: int) -> list[list[int]]:
    """Slots of a padded global batch. Longest first, each example joins the micro-batch whose padded size
    (examples × longest) grows least by it, so a micro-batch holding one very long example takes few
    others and one of short examples takes more: the micro-batches even out in computed positions (and
    similar lengths share a micro-batch, which cuts padding). No micro-batch exceeds micro_batch_size × the
    step's longest example, the most a shuffled micro-batch of this step could compute, so memory stays
    within the estimate for the micro-batch size. That cap never leaves an example without a place: a
    micro-batch with fewer than micro_batch_size examples can always take one more (its longest is at most
    the step's longest), and the step has no more examples than micro_batch_size × slots."""
    ordered = sorted(batch, key=lambda i: (-lengths[i], i))
    cap = micro_batch_size * (lengths[ordered[0]] if ordered else 0)
    groups: list[list[int]] = [[] for _ in range(world * accumulation)]
    for index in ordered:
        def grown(g: int) -> int:
            return (len(groups[g]) + 1) * (lengths[groups[g][0]] if groups[g] else lengths[index])
        fitting = [g for g in range(len(groups)) if grown(g) <= cap]
        groups[min(fitting, key=lambda g: (grown(g), g))].append(index)
    return assign_to_ranks([g for g in groups if g], padded_cost(lengths), world, accumulation)


def balance_packed(bins: list[list[int]], lengths: Sequence[int], capacity: int, world: int,
                   accumulation: int) -> list[list[int]]:
    """Slots of a packed step whose examples best-fit-decreasing placed in `bins`. Best fit fills the first
    bins to the brim and leaves the last ones light, and at the end of an epoch one long example can outweigh
    the rest. So the same examples are placed again, longest first, each on the rank that carries least so
    far (among ranks where it fits) and there in its emptiest micro-batch. Should an example fit no rank
    within `capacity`, best fit's bins are kept and only dealt to ranks evenly."""
    items = sorted((i for b in bins for i in b), key=lambda i: (-lengths[i], i))
    per_rank: list[list[list[int]]] = [[[] for _ in range(accumulation)] for _ in range(world)]
    fill = [[0] * accumulation for _ in range(world)]
    cost = packed_cost(lengths)
    for index in items:
        fitting = [r for r in range(world) if min(fill[r]) + lengths[index] <= capacity]
        if not fitting:
            return assign_to_ranks([b for b in bins if b], cost, world, accumulation)
        rank = min(fitting, key=lambda r: (sum(fill[r]), r))
        emptiest = min(range(accumulation), key=lambda b: (fill[rank][b], b))
        per_rank[rank][emptiest].append(index)
        fill[rank][emptiest] += lengths[index]
    return _slots([[g for g in groups if g] for groups in per_rank], cost, world, accumulation)


def rank_loads(slots: list[list[int]], cost: Callable[[list[int]], int], world: int) -> list[int]:
    """Token positions each rank computes over a step's slots (an empty slot costs nothing here)."""
    return [sum(cost(slots[k]) for k in range(rank, len(slots), world)) for rank in range(world)]
