"""Proportional mixing of sources: fractions (with upsampling) and absolute row counts.

Pure and seeded: the same inputs give the same rows on every rank and every rerun.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Sequence
from fractions import Fraction
from pathlib import PurePath
from typing import Any

import numpy as np

from open_sft.data.compressed import data_stem
from open_sft.data.sources import LOCAL_SUFFIXES, SourceSpec
from open_sft.errors import UserError


def select_indices(spec: SourceSpec, n_rows: int, seed: int) -> list[int]:
    """Row indices of a source with n_rows rows that the mixture takes, in a seeded order.

    A fraction f takes floor(f × n) rows, as open-instruct: floor(f) whole copies plus a seeded sample of the rest;
    a count c takes a seeded sample of c distinct rows, and above the source's size (as open-instruct
    does) c // n whole copies plus a seeded sample of c % n rows.
    """
    whole, sample = _draw(spec, n_rows, seed)
    return list(range(n_rows)) * whole + sample


def select_index_array(spec: SourceSpec, n_rows: int, seed: int) -> np.ndarray:
    """select_indices as an int64 array, without the list: a Python list of 10 M rows is ~360 MB while it lives,
    the array ~80 MB (the streaming build's selection of a large corpus)."""
    whole, sample = _draw(spec, n_rows, seed)
    return np.concatenate([np.tile(np.arange(n_rows, dtype=np.int64), whole), np.asarray(sample, dtype=np.int64)])


def _draw(spec: SourceSpec, n_rows: int, seed: int) -> tuple[int, list[int]]:
    """(whole copies of every row, the seeded sample of the rest, sorted) of select_indices."""
    rng = random.Random(f"{seed}:{spec.draw_key}:{spec.split}")
    if spec.is_fraction:
        whole = math.floor(spec.amount)
        rest = _fraction_rows(spec.amount, n_rows) - whole * n_rows
        if not (whole and n_rows) and not rest:
            raise UserError(
                f"--dataset_mixer_list: {spec.amount} of {spec.name} ({n_rows} rows) selects no rows; raise the amount"
            )
        return whole, sorted(rng.sample(range(n_rows), rest))
    count = int(spec.amount)
    if n_rows == 0:
        raise UserError(f"--dataset_mixer_list: {spec.name} has no usable rows to take {count} from")
    whole, rest = divmod(count, n_rows)
    return whole, sorted(rng.sample(range(n_rows), rest))


def _fraction_rows(amount: float, n_rows: int) -> int:
    """The rows a fraction of a source takes, open-instruct's int(f × n) (0.5 of 7 rows: 3; 1.5 of 3: 4), computed on
    the decimal the user wrote (its shortest repr), so that 0.29 of 100 rows is 29, where float's 28.999... gave 28."""
    return math.floor(Fraction(repr(amount)) * n_rows)


def select_by_tokens(spec: SourceSpec, lengths: list[int], seed: int) -> list[int]:
    """--dataset_mixer_unit tokens: indices whose token total reaches the amount, ordered as select_indices orders
    them (whole passes first, then the sampled rest in row order).

    A fraction f of a source with T tokens takes floor(f) whole copies plus rows in a seeded order
    until (f - floor(f)) * T more tokens are reached; a count takes rows until that many tokens
    (above T: whole copies first, as for row counts).
    """
    total = sum(lengths)
    rng = random.Random(f"{seed}:{spec.draw_key}:{spec.split}:tokens")
    order = list(range(len(lengths)))
    rng.shuffle(order)
    if spec.is_fraction:
        whole = math.floor(spec.amount)
        target = (spec.amount - whole) * total
    else:
        whole, target = divmod(int(spec.amount), max(total, 1))
    rest, taken = [], 0
    for index in order:
        if taken >= target:
            break
        rest.append(index)
        taken += lengths[index]
    if not (whole and lengths) and not rest:
        raise UserError(f"--dataset_mixer_list: {spec.amount} of {spec.name} selects no tokens; raise the amount")
    # Whole passes, then the sampled rest in row order (as select_indices): a document's copies lie a pass apart,
    # never side by side in a text source's stream of blocks.
    return list(range(len(lengths))) * whole + sorted(rest)


def source_names(entries: list[str]) -> list[str]:
    """Names for the metrics of each mixer entry (`loss/<name>`): unique, and safe as a file or tag name.

    A local file gives its stem (`data/alpaca.jsonl` → `alpaca`), a Hub id its path with `/` as `_`
    (`allenai/tulu-3-sft-mixture` → `allenai_tulu-3-sft-mixture`); any other character becomes `_`, and a name
    seen before gets `_2`, `_3`, ... in mixture order."""
    names: list[str] = []
    for entry in entries:
        path = PurePath(entry)
        stem = data_stem(path) if entry.endswith(LOCAL_SUFFIXES) else entry
        base = re.sub(r"[^A-Za-z0-9._-]+", "_", stem.strip("/")).strip("._") or "source"
        name, copy = base, 1
        while name in names:
            copy += 1
            name = f"{base}_{copy}"
        names.append(name)
    return names


def held_out_rows(valid: list[int], ratio: float, seed: int, spec: SourceSpec) -> list[int]:
    """The rows of a source that --eval_split_ratio holds out for evaluation, drawn from its distinct valid rows
    before the mixture takes its amount: an upsampled row and all its copies land on one side of the split.
    Seeded by the source (its content, for a local one), so an entry listed twice holds out the same rows of it."""
    count = held_out_count(len(valid), ratio, spec)
    return sorted(random.Random(f"{seed}:eval_split:{spec.draw_key}:{spec.split}").sample(valid, count))


def held_out_count(n_rows: int, ratio: float, spec: SourceSpec) -> int:
    """How many of a source's n_rows valid rows --eval_split_ratio holds out: round(ratio × n_rows), fewer than all."""
    count = round(ratio * n_rows)
    if n_rows and count >= n_rows:
        raise UserError(f"--eval_split_ratio {ratio} holds out all {n_rows} rows of {spec.name}; lower it")
    return count


def select_row_array(spec: SourceSpec, unit: str, valid: Sequence[int], lengths: Any, seed: int) -> np.ndarray:
    """select_rows as an int64 array; by rows without --eval_split_ratio it makes no Python list of the rows."""
    if unit == "tokens" or spec.holdout is not None:
        rows = valid.tolist() if isinstance(valid, np.ndarray) else valid
        return np.asarray(select_rows(spec, unit, rows, lengths, seed), dtype=np.int64)
    picks = select_index_array(spec, len(valid), seed)
    if isinstance(valid, range) and valid.start == 0 and valid.step == 1:
        return picks
    return np.asarray(valid, dtype=np.int64)[picks]


def select_rows(spec: SourceSpec, unit: str, valid: Sequence[int], lengths: Any, seed: int) -> list[int]:
    """The rows (repeats allowed) the mixture takes of a source's valid rows, by rows or by tokens (`lengths`
    gives each valid row's; `valid` may be a range). Under --eval_split_ratio the training side takes its amount from the rows not held
    out, the evaluation side takes the held-out rows once each."""
    if spec.holdout is not None:
        side, ratio = spec.holdout
        held = held_out_rows(valid, ratio, seed, spec)
        if side == "eval":
            return held
        held_set = set(held)
        valid = [i for i in valid if i not in held_set]
    if unit == "tokens":
        picked = select_by_tokens(spec, [lengths[i] for i in valid], seed)
    else:
        picked = select_indices(spec, len(valid), seed)
    if isinstance(valid, range) and valid.start == 0 and valid.step == 1:
        return picked  # every row valid: the picks are the rows (no second list of millions of rows)
    return [valid[p] for p in picked]
