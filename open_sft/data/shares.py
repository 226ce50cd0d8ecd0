"""--dataset_mixer_unit share: the amounts are shares of the mixture, resolved into a row count for each source before
any source is selected.

The mixture is the largest that holds the shares without repeating a row of any source. With r_i the rows source i's
selection draws from (its rows that parse and convert; on the training side of --eval_split_ratio, less the rows held
out) and s_i the shares normalised to sum 1, N = min_i r_i / s_i and source i gives round(s_i × N) of its rows: the
seeded sample of distinct rows a row count draws. open_sft.data.in_memory.mixture_specs resolves the shares for both
builds, so the whole-file and the streaming build select the same rows.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional

from open_sft.data.chunks import Reader
from open_sft.data.documents import to_text
from open_sft.data.format_detect import source_format
from open_sft.data.formats import RowError, to_messages
from open_sft.data.mixer import held_out_count
from open_sft.data.local_files import parse_json_line
from open_sft.data.sources import SourceSpec, read_source
from open_sft.errors import UserError

logger = logging.getLogger(__name__)


def share_counts(shares: list[float], rows: list[int], names: list[str]) -> list[int]:
    """Each source's rows in the largest mixture that holds `shares` (normalised to sum 1) of sources of `rows` rows,
    no row repeated: N = min_i rows_i / share_i, and source i gives round(share_i × N)."""
    shares = [share / sum(shares) for share in shares]
    for name, n in zip(names, rows):
        if n == 0:
            raise UserError(f"--dataset_mixer_unit share: {name} has no usable rows, so no mixture holds its share; "
                            "fix its rows or leave it out of --dataset_mixer_list")
    size = min(n / share for n, share in zip(rows, shares))
    counts = [min(n, round(share * size)) for n, share in zip(rows, shares)]
    for name, share, count in zip(names, shares, counts):
        if count == 0:
            raise UserError(f"--dataset_mixer_list: the share {share:.3g} of {name} is no row of the largest mixture "
                            f"the sources hold ({size:.0f} rows); raise its share")
    return counts


def resolve_shares(specs: list[SourceSpec], args: Any, holdout: Optional[tuple[str, float]]) -> list[SourceSpec]:
    """The specs with each share replaced by the row count share_counts gives (the training side of `holdout` counts
    the rows it leaves); says the resolved mixture in the log, and the normalisation where the shares did not sum
    to 1."""
    rows = []
    for spec in specs:
        n = usable_rows(spec, args)
        rows.append(n - held_out_count(n, holdout[1], spec) if holdout else n)
    names = [spec.name for spec in specs]
    shares = [float(spec.amount) for spec in specs]
    if abs(sum(shares) - 1.0) > 1e-9:
        logger.info("--dataset_mixer_unit share: the shares %s sum to %g, not 1: normalised to %s",
                    " and ".join(f"{share:g}" for share in shares), sum(shares),
                    " and ".join(f"{share / sum(shares):.4g}" for share in shares))
    counts = share_counts(shares, rows, names)
    logger.info("--dataset_mixer_unit share: the largest mixture that holds the shares without repeating a row has "
                "%d rows: %s", sum(counts), ", ".join(f"{name} {count} of its {n} rows ({count / sum(counts):.1%})"
                                                      for name, count, n in zip(names, counts, rows)))
    return [dataclasses.replace(spec, amount=count, is_fraction=False) for spec, count in zip(specs, counts)]


def usable_rows(spec: SourceSpec, args: Any) -> int:
    """The rows a source's selection draws from: every row under --on_bad_row error (a bad row stops the build
    anyway), the rows that parse and convert under --on_bad_row drop. Streamed where the build streams it."""
    drop = args.on_bad_row == "drop"
    reader = Reader.open(spec)
    first, where = reader.first() if reader is not None else (None, "")
    if first is None:  # a JSON list file, or a first line that is not JSON: read whole, as the build reads it
        source = read_source(spec, drop_bad=drop)
        if not drop or not source.rows:
            return len(source.rows)
        fmt = source_format(args, source.rows[0], source.where(0))
        return sum(_converts(row, fmt, args.dataset_text_field) for row in source.rows)
    if not drop:
        return reader.count()
    fmt = source_format(args, first, where)
    count = 0
    for _, items, _ in reader.chunks():
        for item in items:
            try:
                count += _converts(parse_json_line(item) if reader.lines else item, fmt, args.dataset_text_field)
            except RowError:
                pass
    return count


def _converts(row: Any, fmt: str, text_field: str) -> bool:
    try:
        to_text(row, text_field) if fmt == "text" else to_messages(row, fmt)
    except RowError:
        return False
    return True
