"""Token-balanced ranks: lay a global batch's examples into micro-batch slots so every rank computes about
the same number of token positions at each micro-step and over the step.

Ranks meet at every gradient all-reduce (and, under ZeRO-3, at every layer's gather), so the step runs at
the pace of the rank with the most tokens. Dealing a fixed number of examples to each rank in shuffled
order ignores their lengths; on real data (10 to 2,000 tokens) one rank can carry several times another's
tokens. These functions only decide which slot an example of the step goes to, never which examples make
the step, so the global batch, and with token or sum loss normalisation the math, stay the same. Each is a
pure function of the step's examples and their lengths: every rank computes the same layout, and a resume
recomputes it exactly.

Under DeepSpeed ranks meet inside every micro-step (ZeRO reduces gradients at each backward), so what a
step waits for is its critical path: the sum over micro-steps of the busiest rank's micro-batch. Each
function builds a few candidate layouts and keeps the one with the shortest critical path, then the least
busy rank over the step (what the trainer logs as rank_tokens_max_over_mean; DDP meets only there).

Slot k = accumulation_index × world_size + rank, as in open_sft.data.batching.
"""

from __future__ import annotations

from typing import Callable, Sequence


def assign_to_ranks(groups: list[list[int]], cost: Callable[[list[int]], int], world: int,
                    accumulation: int) -> list[list[int]]:
    """Slots for `groups` (at most world × accumulation; missing ones are empty slots): the better of
    dealing them by rank and by micro-step."""
    return best([_deal_by_rank(groups, cost, world, accumulation),
                 _deal_by_micro_step(groups, cost, world, accumulation)], cost, world)


def best(layouts: list[list[list[int]]], cost: Callable[[list[int]], int], world: int) -> list[list[int]]:
    """The layout with the shortest critical path, then the lightest busiest rank (the first on a tie)."""
    return min(layouts, key=lambda slots: (critical_path(slots, cost, world), max(rank_loads(slots, cost, world))))


def critical_path(slots: list[list[int]], cost: Callable[[list[int]], int], world: int) -> int:
    """Σ over micro-steps of the busiest rank's micro-batch: what ranks that meet at every micro-step wait."""
    return sum(max(cost(slot) for slot in slots[a:a + world]) for a in range(0, len(slots), world))


def _deal_by_rank(groups: list[list[int]], cost: Callable[[list[int]], int], world: int,
                  accumulation: int) -> list[list[int]]:
    """Heaviest first, each group to the rank that computes least so far among those with a free micro-step
    (longest processing time first, with equal counts): even sums over the step. Each rank runs its
    micro-batches heaviest first."""
    per_rank: list[list[list[int]]] = [[] for _ in range(world)]
    load = [0] * world
    for group in sorted(groups, key=lambda g: -cost(g)):
        rank = min((r for r in range(world) if len(per_rank[r]) < accumulation), key=lambda r: (load[r], r))
        per_rank[rank].append(group)
        load[rank] += cost(group)
    return _slots(per_rank, cost, world, accumulation)


def _deal_by_micro_step(groups: list[list[int]], cost: Callable[[list[int]], int], world: int,
                        accumulation: int) -> list[list[int]]:
    """Heaviest first, micro-step a takes the groups a·world to (a+1)·world - 1 (similar costs meet: the
    shortest critical path for these groups), the heaviest of them to the rank with the least so far."""
    ordered = sorted(groups, key=lambda g: -cost(g)) + [[] for _ in range(world * accumulation - len(groups))]
    slots: list[list[int]] = [[] for _ in range(world * accumulation)]
    load = [0] * world
    for a in range(accumulation):
        for group, rank in zip(ordered[a * world:(a + 1) * world], sorted(range(world), key=lambda r: (load[r], r))):
            slots[a * world + rank] = group
            load[rank] += cost(group)
    return slots


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
    """Slots of a padded global batch (a micro-batch computes examples × its longest positions), from two
    groupings of the examples into micro-batches. Runs of neighbours in length pad least and win when
    micro-batches hold several examples; spreading the longest examples apart wins when they hold one or two.
    Neither puts more than micro_batch_size × the step's longest example in a micro-batch, the most a shuffled
    micro-batch of this step could compute, so memory stays within the estimate for the micro-batch size."""
    slots = world * accumulation
    ordered = sorted(batch, key=lambda i: (-lengths[i], i))
    if not ordered:
        return [[] for _ in range(slots)]
    cost = padded_cost(lengths)
    return best([assign_to_ranks(groups, cost, world, accumulation)
                 for groups in (_length_runs(ordered, lengths, micro_batch_size, slots),
                                _least_growth(ordered, lengths, micro_batch_size, slots))], cost, world)


def _length_runs(ordered: list[int], lengths: Sequence[int], micro_batch_size: int, slots: int) -> list[list[int]]:
    """The examples (longest first) cut into runs of neighbours in length, the largest run's padded size as small
    as it can be (runs of micro_batch_size examples meet micro_batch_size × the longest, so the bound holds);
    then the costliest runs are halved until every slot has one."""
    sizes = [lengths[i] for i in ordered]
    low, high = sizes[0], micro_batch_size * sizes[0]
    while low < high:  # the smallest largest-run size that cuts the examples into at most `slots` runs
        middle = (low + high) // 2
        if len(_runs(sizes, middle)) <= slots:
            high = middle
        else:
            low = middle + 1
    groups = [ordered[start:end] for start, end in _runs(sizes, low)]
    cost = padded_cost(lengths)
    while len(groups) < slots and any(len(g) > 1 for g in groups):
        worst = max((g for g in groups if len(g) > 1), key=cost)
        groups.remove(worst)
        groups += [worst[:len(worst) // 2], worst[len(worst) // 2:]]
    return groups


def _runs(sizes: list[int], limit: int) -> list[tuple[int, int]]:
    """Greedy cut of `sizes` (descending) into runs whose padded size (length × first) is at most `limit`:
    each run as long as it can be, which gives the fewest runs (a run that starts later has a shorter
    longest example, so it never needs to end sooner)."""
    runs, start = [], 0
    while start < len(sizes):
        end = start + max(1, limit // sizes[start])
        runs.append((start, min(end, len(sizes))))
        start = end
    return runs


def _least_growth(ordered: list[int], lengths: Sequence[int], micro_batch_size: int, slots: int) -> list[list[int]]:
    """Longest first, each example joins the micro-batch whose padded size grows least by it, within
    micro_batch_size × the longest. That cap never leaves an example without a place: a micro-batch with fewer
    than micro_batch_size examples can always take one more, and the step has at most micro_batch_size × slots."""
    cap = micro_batch_size * lengths[ordered[0]]
    groups: list[list[int]] = [[] for _ in range(slots)]
    for index in ordered:
        def grown(g: int) -> int:
            return (len(groups[g]) + 1) * (lengths[groups[g][0]] if groups[g] else lengths[index])
        fitting = [g for g in range(slots) if grown(g) <= cap]
        groups[min(fitting, key=lambda g: (grown(g), g))].append(index)
    return [g for g in groups if g]


def balance_packed(bins: list[list[int]], lengths: Sequence[int], capacity: int, world: int,
                   accumulation: int) -> list[list[int]]:
    """Slots of a packed step whose examples best-fit-decreasing placed in `bins`. Best fit fills the first
    bins to the brim and leaves the last ones light, and at the end of an epoch one long example can outweigh
    the rest. So besides best fit's bins dealt to ranks, the same examples are placed again, longest first,
    each on the rank that carries least so far (among ranks where it fits), in its emptiest micro-batch."""
    cost = packed_cost(lengths)
    layouts = [assign_to_ranks([b for b in bins if b], cost, world, accumulation)]
    items = sorted((i for b in bins for i in b), key=lambda i: (-lengths[i], i))
    per_rank: list[list[list[int]]] = [[[] for _ in range(accumulation)] for _ in range(world)]
    fill = [[0] * accumulation for _ in range(world)]
    for index in items:
        fitting = [r for r in range(world) if min(fill[r]) + lengths[index] <= capacity]
        if not fitting:  # worst fit cannot place it within capacity: best fit's bins it is
            return layouts[0]
        rank = min(fitting, key=lambda r: (sum(fill[r]), r))
        emptiest = min(range(accumulation), key=lambda b: (fill[rank][b], b))
        per_rank[rank][emptiest].append(index)
        fill[rank][emptiest] += lengths[index]
    layouts.append(_slots([[g for g in groups if g] for groups in per_rank], cost, world, accumulation))
    return best(layouts, cost, world)


def rank_loads(slots: list[list[int]], cost: Callable[[list[int]], int], world: int) -> list[int]:
    """Token positions each rank computes over a step's slots (an empty slot costs nothing here)."""
    return [sum(cost(slots[k]) for k in range(rank, len(slots), world)) for rank in range(world)]
