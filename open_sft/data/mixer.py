"""Proportional mixing of sources: fractions (with upsampling) and absolute row counts.

Pure and seeded: the same inputs give the same rows on every rank and every rerun.
"""

from __future__ import annotations

import math
import random

from open_sft.data.sources import SourceSpec
from open_sft.errors import UserError


def select_indices(spec: SourceSpec, n_rows: int, seed: int) -> list[int]:
    """Row indices of a source with n_rows rows that the mixture takes, in a seeded order.

    A fraction f takes floor(f) whole copies plus a seeded sample of round((f - floor(f)) * n) rows;
    a count c takes a seeded sample of c distinct rows and must not exceed the source's size.
    """
    rng = random.Random(f"{seed}:{spec.name}:{spec.split}")
    if spec.is_fraction:
        whole = math.floor(spec.amount)
        rest = round((spec.amount - whole) * n_rows)
        indices = list(range(n_rows)) * whole + sorted(rng.sample(range(n_rows), rest))
        if not indices:
            raise UserError(
                f"--dataset_mixer_list: {spec.amount} of {spec.name} ({n_rows} rows) selects no rows; raise the amount"
            )
        return indices
    count = int(spec.amount)
    if count > n_rows:
        raise UserError(
            f"--dataset_mixer_list: asked for {count} rows of {spec.name} but it has {n_rows} usable rows; "
            f"ask for at most {n_rows}, or use a fraction such as {count / n_rows:.2f} to upsample"
        )
    return sorted(rng.sample(range(n_rows), count))


def select_by_tokens(spec: SourceSpec, lengths: list[int], seed: int) -> list[int]:
    """--dataset_mixer_unit tokens: indices whose token total reaches the amount.

    A fraction f of a source with T tokens takes floor(f) whole copies plus rows in a seeded order
    until (f - floor(f)) * T more tokens are reached; a count takes rows until that many tokens and
    must not exceed T.
    """
    total = sum(lengths)
    rng = random.Random(f"{seed}:{spec.name}:{spec.split}:tokens")
    order = list(range(len(lengths)))
    rng.shuffle(order)
    if spec.is_fraction:
        whole = math.floor(spec.amount)
        target = (spec.amount - whole) * total
        indices = list(range(len(lengths))) * whole
    else:
        target = int(spec.amount)
        if target > total:
            raise UserError(
                f"--dataset_mixer_list: asked for {target} tokens of {spec.name} but it has {total}; ask for at "
                f"most {total}, or use a fraction such as {target / total:.2f} to upsample"
            )
        indices = []
    taken = 0
    for index in order:
        if taken >= target:
            break
        indices.append(index)
        taken += lengths[index]
    if not indices:
        raise UserError(f"--dataset_mixer_list: {spec.amount} of {spec.name} selects no tokens; raise the amount")
    return sorted(indices)
