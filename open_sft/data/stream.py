"""One source's training examples built a chunk at a time, in memory bounded by the chunk, not the corpus.

A source is read CHUNK_ROWS rows at a time (JSON Lines a block of whole lines at a time, every other kind
but a JSON list file as slices of its memory-mapped `datasets.Dataset`: open_sft.data.chunks); each chunk is
converted, rendered, labelled and tokenized by the workers (open_sft.data.workers) and its rows are spilled to disk
(open_sft.data.spill). The selection is then drawn exactly as the in-memory build draws it (a first cheap pass
counts the rows where the amount needs them), truncation and the no-trained-token rule are applied from
per-row numbers, and the examples are written out a piece at a time: chat rows in selection order, documents
spliced into --max_seq_length blocks across chunk boundaries. The examples are those of the in-memory build
(open_sft.data.in_memory.build_rows), bit for bit (tests/unit/data/test_stream.py).

A bad row stops a streaming build at the end of the chunk that has it (the in-memory build reads everything
first): with several bad rows the one named may be another than the in-memory build names.
"""

from __future__ import annotations

import ctypes
import functools
import gc
from collections import Counter
from itertools import chain
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np

from open_sft.data.chat.render import chat_options
from open_sft.data.chunks import Progress, Reader
from open_sft.data.documents import document_markers, special_text_notes, to_text, with_special_text
from open_sft.data.formats import RowError, to_messages
from open_sft.data.row_error import bad_row_error
from open_sft.data.labels import plain_backend
from open_sft.data.local_files import parse_json_line
from open_sft.data.spill import ExampleWriter, Spill, pieces
from open_sft.data.token_rows import (TokenRows, expand_groups, fit_order, fitted_lengths, group_totals, row_bounds,
                                     rows_keeping_an_example, split_costs)
from open_sft.data.workers import label_rows
from open_sft.errors import UserError

# Documents tokenized at once (a chunk's in batches): the Rust encodings of a 64 MB chunk of text, and its ids as
# Python lists, took ~2 GB; a batch's are a few tens of MB
TEXT_BATCH_ROWS = 1024
TEXT_BATCH_CHARS = 1 << 22


def _convert_line(line: str, fmt: str) -> Any:
    return to_messages(parse_json_line(line), fmt)


def chat_source(spec: Any, args: Any, tokenizer: Any, reader: Reader, fmt: str, writer: ExampleWriter, tmp: Path,
                report: Any, select: Callable) -> None:
    """A chat source's examples, appended to `writer`; `report` (its SourceReport) filled in."""
    drop, by_rows = args.on_bad_row == "drop", args.dataset_mixer_unit != "tokens"
    n = report.rows_in = reader.count()
    picked = None
    if by_rows and not drop:  # speculative: every row valid (else the bad row stops the build)
        try:
            picked = select(range(n), None)
        except UserError:  # more rows asked for than there are: label all, and the selection says so below
            picked = None
    spilled, errors, invalid, notes, flagged = _label_chunks(spec, args, tokenizer, reader, fmt, tmp, n, picked)
    report.add_notes(notes, flagged, str)  # (flagged rows named where they were read)
    # The row numbering the in-memory build selects in: rows are the lines that parse (all of them, mostly: then
    # no array maps one to the other). Arrays of a number per row are made only where needed and let go early:
    # at 10 M rows each costs 80 MB.
    unreadable = np.array([i for i, e in invalid if e.reason == "invalid_json"], dtype=np.int64)
    line_of = np.setdiff1d(np.arange(n, dtype=np.int64), unreadable) if len(unreadable) else None
    if len(unreadable):
        report.dropped["invalid_json"] += len(unreadable)
    for _, error in invalid:
        if error.reason != "invalid_json":
            report.dropped[error.reason] += 1
    if picked is None:
        picked = _select_labelled(spilled, invalid, line_of, n, by_rows, drop, select, args)
        if line_of is not None:
            picked = line_of[picked]
    del line_of
    counted = np.isin(np.array([i for i, _ in errors], dtype=np.int64), picked) if by_rows else np.ones(len(errors), bool)
    for (_, error), count in zip(errors, counted):
        if count:
            report.dropped[error.reason] += 1
    report.upsample_factor = round(len(picked) / max(1, _distinct(picked, n)), 4)
    found = spilled.positions(picked)
    del picked
    if len(found) and found.min() < 0:
        found = found[found >= 0]
    report.rows_selected = len(found)
    lengths, sizes = spilled.lengths(), spilled.group_sizes()
    report.rows_split, report.split_extra_tokens = split_costs(lengths, found, sizes)
    kept, dropped, report.truncated = fit_order(lengths, spilled.trained, expand_groups(found, sizes),
                                                args.max_seq_length, args.truncation)
    report.dropped.update(dropped)
    report.rows_kept = len(kept) if sizes is None else rows_keeping_an_example(
        lengths, spilled.trained, found, sizes, args.max_seq_length, args.truncation)
    del found
    for a, b in pieces(np.minimum(lengths[kept], args.max_seq_length)):
        _add_counts(report, writer.write(spilled.take(kept[a:b], args.max_seq_length)))


def _select_labelled(spilled: Any, invalid: list, line_of: Optional[np.ndarray], n: int, by_rows: bool,
                     drop: bool, select: Callable, args: Any) -> np.ndarray:
    """The selection, in rows (lines that parse), drawn once labelling has said which rows are valid: by tokens,
    or by rows where some rows failed (or the speculative draw asked for more rows than there are)."""
    lines = np.arange(n, dtype=np.int64) if line_of is None else line_of
    if by_rows:
        valid = np.flatnonzero(~np.isin(lines, np.array([i for i, _ in invalid], dtype=np.int64)))
        if not invalid and not drop:  # the speculative selection failed: as many rows as there are, too few
            valid = np.arange(n)
        return select(range(len(valid)) if len(valid) == len(lines) else valid, None)
    fitted = fitted_lengths(spilled.lengths(), spilled.trained, args.max_seq_length, args.truncation)
    sizes = spilled.group_sizes()
    if sizes is None:
        labelled_rows = np.searchsorted(lines, spilled.index)  # by tokens: as the rows will be kept
        return select(labelled_rows, _Lengths(labelled_rows, fitted))
    firsts = np.flatnonzero(sizes)  # a row's tokens: those of all its examples
    labelled_rows = np.searchsorted(lines, spilled.index[firsts])
    return select(labelled_rows, _Lengths(labelled_rows, group_totals(fitted, firsts, sizes)))


def _distinct(rows: np.ndarray, n: int) -> int:
    seen = np.zeros(n, dtype=bool)  # a byte a row (np.unique would sort a copy of the selection)
    seen[rows] = True
    return int(seen.sum())


def _label_chunks(spec: Any, args: Any, tokenizer: Any, reader: Reader, fmt: str, tmp: Path, n: int,
                  picked: Optional[np.ndarray]) -> tuple[Any, list, list, Counter, dict]:
    """Every chunk converted, rendered, labelled (only the `picked` rows, when given) and spilled; the rows that
    failed (row index, RowError) to render or label, and those that did not parse or convert. Under
    --on_bad_row error the first bad row stops it."""
    wanted = None if picked is None else np.zeros(n, dtype=bool)
    if wanted is not None:
        wanted[picked] = True
    convert = functools.partial(_convert_line, fmt=fmt) if reader.lines else functools.partial(to_messages, fmt=fmt)
    spill = Spill(tmp, "chat", tag=reader.chunking())
    errors, invalid, counts, flagged = [], [], Counter(), {}
    for note in spill.notes():  # a resumed build's rows that failed
        errors += [(row, RowError(message, reason)) for row, message, reason in note["errors"]]
        invalid += [(row, RowError(message, reason)) for row, message, reason in note["invalid"]]
        counts.update(note.get("counts", {}))
        for name, rows in note.get("flagged", {}).items():
            flagged.setdefault(name, rows)
    progress = Progress(spec.name, n, spill.rows)
    for start, items, numbers in reader.chunks(skip=reader.resuming(spill)):
        here = None if wanted is None else set((np.flatnonzero(wanted[start : start + len(items)]) + start).tolist())
        labelled = label_rows(tokenizer, list(zip(range(start, start + len(items)), items)), args.train_on,
                              args.preprocessing_num_workers, convert=convert, wanted=here,
                              options=chat_options(args, spec), progress=progress)
        if args.on_bad_row != "drop" and (labelled.invalid or labelled.errors):
            _raise_first(reader, labelled.invalid, labelled.errors, numbers, start)
        done = np.array(sorted(labelled.position.items()), dtype=np.int64).reshape(-1, 2)
        # a row's examples one after another, each under the row's index
        spill.append(np.repeat(done[:, 0], labelled.group_sizes()[done[:, 1]]),
                     labelled.rows.take(expand_groups(done[:, 1], labelled.sizes)), args.max_seq_length)
        spill.commit(start + len(items), {"errors": _dumped(labelled.errors), "invalid": _dumped(labelled.invalid),
                                          "counts": dict(labelled.notes), "flagged": labelled.flagged})
        errors += labelled.errors
        invalid += labelled.invalid
        counts += labelled.notes
        for name, rows in labelled.flagged.items():
            flagged.setdefault(name, [reader.where(row, numbers, start) for row in rows])
        del labelled, items
        # the chunk's cycles (a template's). The build runs with the collector paused (prepare._gc_paused) and
        # the render loop collects only the youngest generation: what survived it is collected here, a chunk's
        # worth of objects (a full collection would walk every object of the process, torch's included)
        gc.collect(1)
        _release_heap()
    progress.done()
    return spill.close(), errors, invalid, counts, flagged


def _release_heap() -> None:
    """Gives the heap a chunk used and freed back to the system (glibc keeps freed small blocks mapped: released
    only at the end, the main process's anonymous memory grew over the first ~4 chunks, 0.44 → 0.91-1.07 GB, and
    held there, the per-row arrays made next on top; released after each chunk it falls back to ~0.52 GB)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _dumped(failures: list[tuple[int, RowError]]) -> list[tuple[int, str, str]]:
    return [(row, str(error), error.reason) for row, error in failures]


def _raise_first(reader: Reader, invalid: list, errors: list, numbers: Optional[list[int]], start: int) -> None:
    """--on_bad_row error: the chunk's first bad row, as the in-memory build names it (a line that is not JSON
    before a row that does not convert, before one that does not render or label)."""
    if invalid:
        i, error = min(invalid, key=lambda item: (item[1].reason != "invalid_json", item[0]))
        if reader.lines and error.reason == "invalid_json":
            raise bad_row_error(f"{reader.path} line {numbers[i - start]}", error)
    else:
        i, error = errors[0]
    raise bad_row_error(reader.where(i, numbers, start), error)


class _Lengths:
    """Row → length for select_rows, from two arrays (a dict of millions of rows costs ~100 bytes each)."""

    def __init__(self, rows: np.ndarray, lengths: np.ndarray):
        self.rows, self.lengths = rows, lengths

    def __getitem__(self, row: int) -> int:
        return int(self.lengths[np.searchsorted(self.rows, row)])


def _add_counts(report: Any, counts: tuple[int, int, int]) -> None:
    report.tokens += counts[0]
    report.trained_tokens += counts[1]
    report.examples += counts[2]


def text_source(spec: Any, args: Any, tokenizer: Any, reader: Reader, writer: ExampleWriter, tmp: Path,
                report: Any, select: Callable) -> None:
    """Documents (+ eos) spliced into --max_seq_length blocks, every token trained: `_blocks` of the in-memory
    build over the selected documents in selection order, cut across chunk boundaries."""
    drop = args.on_bad_row == "drop"
    before, after = document_markers(tokenizer, args.add_bos)
    spill = Spill(tmp, "text", keep_labels=False, tag=reader.chunking())
    rows_seen, special = 0, Counter()  # rows are the lines that parse; special: documents with special text
    flagged: list[str] = []  # the first of them
    for note in spill.notes():  # a resumed build's chunks
        rows_seen += note["rows"]
        report.dropped.update(note["dropped"])
        special.update(note.get("special_text", {}))
    progress = Progress(spec.name, reader.count(), spill.rows)
    for start, items, numbers in reader.chunks(skip=reader.resuming(spill)):
        parsed, dropped = rows_seen, dict(report.dropped)
        indices, texts, rows_seen = _documents(spec, reader, items, numbers, rows_seen, report, drop,
                                               args.dataset_text_field)
        holding = with_special_text(tokenizer, texts)
        special.update(special_text_notes(holding))
        flagged += [f"row {indices[k] + 1}" for k in list(holding)[:5 - len(flagged)]]
        left = len(items) - len(texts)  # rows that are not documents (dropped), told with the first batch
        for a, b in text_batches(texts):  # a batch's tokens at a time, as arrays: not the chunk's as lists
            rows = _document_rows(tokenizer, texts[a:b], before, after)
            spill.append(np.array(indices[a:b], dtype=np.int64), rows)
            progress.update(b - a + left, len(rows.ids))
            left = 0
        if left:
            progress.update(left, 0)
        spill.commit(start + len(items), {"rows": rows_seen - parsed, "special_text": special_text_notes(holding),
                                          "dropped": {k: v - dropped.get(k, 0) for k, v in report.dropped.items()}})
    progress.done()
    report.add_notes(special, {"special_tokens_in_text": flagged}, str)
    report.rows_in = rows_seen + report.dropped["invalid_json"]
    if rows_seen == 0:
        raise UserError(f"{reader.path}: the file has no rows")
    spilled = spill.close()
    lengths = spilled.lengths()
    every = len(spilled.index) == rows_seen  # every row valid: a range (the selection makes no list of the rows)
    selected = select(range(rows_seen) if every else spilled.index,
                      _Lengths(spilled.index, lengths) if args.dataset_mixer_unit == "tokens" else None)
    report.rows_selected = report.rows_kept = len(selected)
    report.upsample_factor = round(len(selected) / max(1, _distinct(selected, rows_seen)), 4)
    _write_blocks(spilled, spilled.positions(selected), lengths, args.max_seq_length, writer, report)


def _documents(spec: Any, reader: Reader, items: list[Any], numbers: Optional[list[int]], rows_seen: int,
               report: Any, drop: bool, text_field: str) -> tuple[list[int], list[str], int]:
    """A chunk's documents: (their row indices, their texts, rows seen after them); rows are the lines that
    parse. Bad rows are counted in `report` (--on_bad_row drop) or stop the build."""
    indices, texts = [], []
    for k, item in enumerate(items):
        if reader.lines:
            try:
                item = parse_json_line(item)
            except RowError as exc:
                if not drop:
                    raise bad_row_error(f"{reader.path} line {numbers[k]}", exc) from None
                report.dropped["invalid_json"] += 1
                continue
        row, rows_seen = rows_seen, rows_seen + 1
        try:
            texts.append(to_text(item, text_field))
        except RowError as exc:
            if not drop:
                where = f"line {numbers[k]}" if numbers else f"row {row + 1}"
                raise bad_row_error(f"{spec.name} {where}", exc) from None
            report.dropped[exc.reason] += 1
            continue
        indices.append(row)
    return indices, texts, rows_seen


def text_batches(texts: list[str]) -> Iterator[tuple[int, int]]:
    """[start, stop) of runs of at most TEXT_BATCH_ROWS documents and about TEXT_BATCH_CHARS characters (at least
    one document each): what is tokenized at once."""
    for a, b in pieces(np.fromiter(map(len, texts), dtype=np.int64, count=len(texts)), TEXT_BATCH_CHARS):
        for start in range(a, b, TEXT_BATCH_ROWS):
            yield start, min(b, start + TEXT_BATCH_ROWS)


def _document_rows(tokenizer: Any, texts: list[str], before: list[int], after: list[int]) -> TokenRows:
    """Each document's tokens between document_markers, a row each (ids and labels the same array)."""
    backend = plain_backend(tokenizer)
    if backend is not None:  # the Rust tokenizer's ids alone: no offsets, no dicts of lists
        encoded = [encoding.ids for encoding in backend.encode_batch_fast(texts, add_special_tokens=False)]
    else:
        encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    sizes = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
    body = np.fromiter(chain.from_iterable(encoded), dtype=np.int32, count=int(sizes.sum()))
    del encoded
    bounds = row_bounds(sizes + len(before) + len(after))
    ids = np.empty(int(bounds[-1]), dtype=np.int32)
    marker = np.zeros(len(ids), dtype=bool)
    for k, token in enumerate(before):
        ids[bounds[:-1] + k], marker[bounds[:-1] + k] = token, True
    for k, token in enumerate(after):
        ids[bounds[1:] - len(after) + k], marker[bounds[1:] - len(after) + k] = token, True
    ids[~marker] = body
    return TokenRows(ids, ids, bounds)


def _write_blocks(spilled: Any, positions: np.ndarray, lengths: np.ndarray, block: int, writer: ExampleWriter,
                  report: Any) -> None:
    """The documents at `positions`, in that order, spliced end to end and cut into blocks of `block` tokens."""
    carry = np.zeros(0, dtype=np.int32)
    for a, b in pieces(lengths[positions]):
        carry = np.concatenate([carry, spilled.take(positions[a:b]).ids])
        whole = len(carry) // block * block
        if whole:
            blocks = carry[:whole]
            _add_counts(report, writer.write(TokenRows.from_lengths(blocks, blocks, np.full(whole // block, block))))
            carry = carry[whole:].copy()
    if len(carry) > 1:  # a last block of one token has nothing to predict
        _add_counts(report, writer.write(TokenRows.from_lengths(carry, carry, np.array([len(carry)]))))
