"""A mixture's training examples with every source read whole, in memory, and a report per source.

read → convert/validate → mix → render + label → truncate; each step is a function of its own
module, this one only wires them together and counts what happened to the rows. A local JSON Lines
chat source is read, converted, rendered and labelled in one pass by the workers (the parent only
splits its lines); it gives what the serial read of every other source gives (tested), bad rows too.
The streaming build (open_sft.data.build) reads a JSON list file here, and takes the mixture's sources,
a source's format and the template check from here; build_rows is the reference it equals, bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from itertools import chain, repeat
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
from transformers import PreTrainedTokenizerBase

from open_sft.config.args import DataArguments
from open_sft.data.chunks import Progress
from open_sft.data.documents import document_markers, special_text_notes, to_text, with_special_text
from open_sft.data.format_detect import source_format
from open_sft.data.formats import RowError, needs_chat_template, to_messages
from open_sft.data.row_error import bad_row_error
from open_sft.data.mixer import select_rows
from open_sft.data.cache import resolve_cache_dir
from open_sft.data.chat.render import chat_options
from open_sft.data.chat.templates import BUILTIN_TEMPLATES
from open_sft.data.shares import resolve_shares
from open_sft.data.local_files import holds_json_lines, parse_json_line, read_lines
from open_sft.data.sources import LoadedSource, parse_mixer_list, read_source, source_identity
from open_sft.data.stream import text_batches
from open_sft.data.summary import SourceReport, no_usable_rows_message, nothing_left_message
from open_sft.data.token_rows import (TokenRows, expand_groups, fit_rows, fitted_lengths, group_totals,
                                     rows_keeping_an_example, split_costs)
from open_sft.data.workers import Labelled, Numbered, label_rows
from open_sft.errors import UserError

logger = logging.getLogger(__name__)


def check_chat_template(tokenizer: PreTrainedTokenizerBase) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(
            f"the tokenizer {tokenizer.name_or_path!r} has no chat template, and chat rows need one; choose one "
            f"with --chat_template_name ({', '.join(BUILTIN_TEMPLATES)}) or --chat_template_path FILE"
        )


class _RowSink:
    """Applies --on_bad_row to one source: raise with the row's location, or count the reason."""

    def __init__(self, where: Callable[[int], str], report: SourceReport, drop: bool):
        self.where, self.report, self.drop = where, report, drop

    def reject(self, index: int, error: RowError) -> None:
        if not self.drop:
            raise bad_row_error(self.where(index), error) from None
        self.report.dropped[error.reason] += 1


def _convert(source: LoadedSource, fmt: str, sink: _RowSink, text_field: str) -> dict[int, Any]:
    """Row index → messages (or text for the text format: its --dataset_text_field), for every valid row."""
    items = {}
    for i, row in enumerate(source.rows):
        try:
            items[i] = to_text(row, text_field) if fmt == "text" else to_messages(row, fmt)
        except RowError as exc:
            sink.reject(i, exc)
    return items


def _chat_rows(spec, args: DataArguments, labelled: Labelled, picked: Optional[list[int]], sink: _RowSink,
               report: SourceReport, seed: int) -> TokenRows:
    """The selected rows of a labelled chat source, fitted to --max_seq_length; rows that failed to
    render or label go to the sink. `picked` is the selection, or None for --dataset_mixer_unit tokens
    (drawn here from the labelled rows' lengths)."""
    for i, error in labelled.errors:
        sink.reject(i, error)
    position, sizes = labelled.position, labelled.sizes
    report.add_notes(labelled.notes, labelled.flagged, sink.where)
    if picked is None:  # by tokens: as the rows will be kept (cut to --max_seq_length, or dropped)
        rows = labelled.rows
        lengths = fitted_lengths(rows.lengths(), rows.trained_counts(args.max_seq_length), args.max_seq_length,
                                 args.truncation)
        labelled_rows = sorted(position)
        totals = group_totals(lengths, np.fromiter(map(position.get, labelled_rows), np.int64, len(labelled_rows)),
                              sizes)
        picked = _select(spec, args, labelled_rows, dict(zip(labelled_rows, totals.tolist())), seed, report)
    found = np.fromiter(map(position.get, picked, repeat(-1)), dtype=np.int64, count=len(picked))
    found = found[found >= 0]  # the selected rows that were labelled, in selection order
    report.rows_selected = len(found)
    report.upsample_factor = _upsample_factor(picked)
    report.rows_split, report.split_extra_tokens = split_costs(labelled.rows.lengths(), found, sizes)
    examples = expand_groups(found, sizes)
    rows, dropped, report.truncated = fit_rows(labelled.rows, examples, args.max_seq_length, args.truncation)
    report.dropped.update(dropped)
    report.rows_kept = len(rows) if sizes is None else rows_keeping_an_example(
        labelled.rows.lengths(), labelled.rows.trained_counts(args.max_seq_length), found, sizes, args.max_seq_length,
        args.truncation)
    return rows


def _parse_and_convert(line: str, fmt: str) -> Any:
    return to_messages(parse_json_line(line), fmt)


def _jsonl_chat_rows(spec, args: DataArguments, tokenizer, seed: int) -> Optional[tuple[TokenRows, SourceReport]]:
    """A local JSON Lines chat source whose lines are parsed and converted in the render workers (the
    parent only splits the file into lines), so reading scales with --preprocessing_num_workers too.
    The selection is drawn from all lines as if every row were valid, which is exactly right when they
    are; else bad rows stop the run as the serial read would, or under --on_bad_row drop the selection
    is drawn again from the valid rows. None (the serial read) for other sources and formats, a first
    line that does not say the format, and a tokenizer without a chat template (the serial read reports
    what comes first)."""
    path = Path(spec.name).expanduser()
    if not path.is_file() or not getattr(tokenizer, "chat_template", None) or not holds_json_lines(path):
        return None
    lines, numbers = read_lines(path)
    try:
        fmt = source_format(args, parse_json_line(lines[0]), f"{spec.name} line {numbers[0]}")
    except (IndexError, RowError, UserError):
        return None
    if fmt == "text":
        return None
    try:
        picked = None if args.dataset_mixer_unit == "tokens" else select_rows(spec, args.dataset_mixer_unit,
                                                                              list(range(len(lines))), None, seed)
    except UserError:  # more rows asked for than there are lines: the serial read says how many are valid
        return None
    convert = functools.partial(_parse_and_convert, fmt=fmt)
    progress = Progress(spec.name, len(lines))
    labelled = label_rows(tokenizer, Numbered(lines), args.train_on, args.preprocessing_num_workers,
                          convert=convert, wanted=None if picked is None else set(picked),
                          options=chat_options(args, spec), progress=progress)
    progress.done()
    report = SourceReport(name=spec.name, format=fmt, rows_in=len(lines))
    if not labelled.invalid:
        sink = _RowSink(lambda i: f"{spec.name} line {numbers[i]}", report, drop=args.on_bad_row == "drop")
        return _chat_rows(spec, args, labelled, picked, sink, report, seed), report
    if args.on_bad_row != "drop":  # as the serial read reports them: a line that is not JSON first
        i, error = min(labelled.invalid, key=lambda item: (item[1].reason != "invalid_json", item[0]))
        raise bad_row_error(f"{str(path) if error.reason == 'invalid_json' else spec.name} line {numbers[i]}", error)
    rows = _dropping_bad_rows(spec, args, tokenizer, lines, numbers, labelled, picked is not None, convert, report,
                              seed)
    return rows, report


def _dropping_bad_rows(spec, args: DataArguments, tokenizer, lines: list[str], numbers: list[int],
                       labelled: Labelled, by_rows: bool, convert: Callable, report: SourceReport,
                       seed: int) -> TokenRows:
    """`_jsonl_chat_rows` under --on_bad_row drop with bad rows: number the rows (the lines that parse)
    and draw the selection from the valid ones as the serial read does, reusing the rows the workers
    labelled and labelling the selected rows the speculative selection missed."""
    unreadable = {i for i, error in labelled.invalid if error.reason == "invalid_json"}
    line_of = [i for i in range(len(lines)) if i not in unreadable]
    row_of = {line: row for row, line in enumerate(line_of)}
    if unreadable:
        report.dropped["invalid_json"] += len(unreadable)
    sink = _RowSink(lambda row: f"{spec.name} line {numbers[line_of[row]]}", report, drop=True)
    for i, error in labelled.invalid:
        if i not in unreadable:
            sink.reject(row_of[i], error)
    invalid = {i for i, _ in labelled.invalid}
    picked, keep = None, None
    if by_rows:
        picked = _select(spec, args, [row for row, line in enumerate(line_of) if line not in invalid], None, seed,
                         report)
        missing = sorted({line_of[row] for row in picked} - set(labelled.position) - {i for i, _ in labelled.errors})
        if missing:
            labelled = labelled.then(label_rows(tokenizer, [(i, lines[i]) for i in missing], args.train_on,
                                                args.preprocessing_num_workers, convert=convert,
                                                options=chat_options(args, spec)))
        keep = set(picked)
    renumbered = Labelled(labelled.rows, {row_of[i]: p for i, p in labelled.position.items()},
                          [(row_of[i], e) for i, e in labelled.errors if keep is None or row_of[i] in keep], [],
                          labelled.sizes, labelled.notes,
                          {note: [row_of[i] for i in rows if i in row_of] for note, rows in labelled.flagged.items()})
    return _chat_rows(spec, args, renumbered, picked, sink, report, seed)


def _tokenize_text(tokenizer, items: dict[int, Any], indices: list[int], add_bos: bool,
                   name: str) -> dict[int, list[int]]:
    """Each document's tokens between document_markers, a batch at a time (the building rank's progress line)."""
    before, after = document_markers(tokenizer, add_bos)
    texts, tokenized = [items[i] for i in indices], {}
    progress = Progress(name, len(texts))
    for a, b in text_batches(texts):
        encoded = tokenizer(texts[a:b], add_special_tokens=False)["input_ids"]
        tokenized.update((i, before + ids + after) for i, ids in zip(indices[a:b], encoded))
        progress.update(b - a, sum(map(len, encoded)) + (b - a) * (len(before) + len(after)))
    progress.done()
    return tokenized


def _blocks(token_lists: list[list[int]], block: int) -> TokenRows:
    """Concatenate documents and cut the stream into --max_seq_length blocks; every token trained. A
    last block of one token is left out (it has nothing to predict)."""
    stream = np.fromiter(chain.from_iterable(token_lists), dtype=np.int32, count=sum(map(len, token_lists)))
    lengths = np.diff(np.append(np.arange(0, len(stream), block), len(stream)))
    if len(lengths) and lengths[-1] <= 1:
        stream, lengths = stream[: len(stream) - lengths[-1]], lengths[:-1]
    return TokenRows.from_lengths(stream, stream, lengths)


def _upsample_factor(picked: list[int]) -> float:
    return round(len(picked) / max(1, len(set(picked))), 4)


def _select(spec, args: DataArguments, valid: list[int], lengths: dict[int, int] | None, seed: int,
            report: SourceReport) -> list[int]:
    if not valid:  # every row dropped as bad: counted by reason in the report by now
        raise UserError(no_usable_rows_message(report))
    return select_rows(spec, args.dataset_mixer_unit, valid, lengths, seed)


def source_rows(spec, args: DataArguments, tokenizer, seed: int) -> tuple[TokenRows, SourceReport]:
    """A source's training examples and its report: read by the workers when they can, else serially."""
    rows, report = _jsonl_chat_rows(spec, args, tokenizer, seed) or _serial_rows(spec, args, tokenizer, seed)
    report.tokens, report.trained_tokens, report.examples = _counts(rows)
    return rows, report


def _serial_rows(spec, args: DataArguments, tokenizer, seed: int) -> tuple[TokenRows, SourceReport]:
    """Any source, read and converted in this process; chat rows are then rendered and labelled by the
    workers, documents tokenized here."""
    source = read_source(spec, drop_bad=args.on_bad_row == "drop")
    fmt = source_format(args, source.rows[0], source.where(0))
    if needs_chat_template(fmt, source.rows[0]):
        check_chat_template(tokenizer)
    report = SourceReport(name=spec.name, format=fmt, rows_in=len(source.rows) + source.unreadable,
                          hub_dataset=not spec.is_local)
    if source.unreadable:
        report.dropped["invalid_json"] += source.unreadable
    sink = _RowSink(source.where, report, drop=args.on_bad_row == "drop")
    items = _convert(source, fmt, sink, args.dataset_text_field)
    valid = sorted(items)
    by_tokens = args.dataset_mixer_unit == "tokens"
    if fmt == "text":
        holding = with_special_text(tokenizer, [items[i] for i in valid])
        report.add_notes(special_text_notes(holding), {"special_tokens_in_text": [valid[k] for k in holding][:5]},
                         sink.where)
        chosen = valid if by_tokens else sorted(set(_select(spec, args, valid, None, seed, report)))
        tokenized = _tokenize_text(tokenizer, items, chosen, args.add_bos, spec.name)
        selected = _select(spec, args, valid, {i: len(t) for i, t in tokenized.items()}, seed, report) if by_tokens \
            else _select(spec, args, valid, None, seed, report)
        report.rows_selected = report.rows_kept = len(selected)
        report.upsample_factor = _upsample_factor(selected)
        rows = _blocks([tokenized[i] for i in selected], args.max_seq_length)
    else:
        picked = None if by_tokens else _select(spec, args, valid, None, seed, report)
        work = [(i, items[i]) for i in (valid if by_tokens else sorted(set(picked)))]
        progress = Progress(spec.name, len(work))
        labelled = label_rows(tokenizer, work, args.train_on, args.preprocessing_num_workers,
                              options=chat_options(args, spec), progress=progress)
        progress.done()
        rows = _chat_rows(spec, args, labelled, picked, sink, report, seed)
    return rows, report


def _counts(rows: TokenRows) -> tuple[int, int, int]:
    """(tokens, trained tokens, examples) of a source's rows, for its report."""
    return int(rows.bounds[-1]), int(rows.trained_counts().sum()), len(rows)


def mixture_specs(args: DataArguments, holdout: Optional[tuple[str, float]] = None) -> list:
    """The mixture's sources as the build draws from them: a local one seeded by its content, not its path; under
    --dataset_mixer_unit share each share made the row count it gives (open_sft.data.shares)."""
    specs = parse_mixer_list(args.dataset_mixer_list, args.dataset_mixer_list_splits,
                             config_name=args.dataset_config_name,
                             template_kwargs=args.dataset_mixer_list_chat_template_kwargs)
    memo = None if args.dataset_skip_cache else resolve_cache_dir(args.dataset_local_cache_dir)
    specs = [dataclasses.replace(spec, holdout=holdout or spec.holdout,
                                 seed_key=source_identity(spec, memo) if spec.is_local else None) for spec in specs]
    if args.dataset_mixer_unit == "share" and not (holdout and holdout[0] == "eval"):  # eval: the held-out rows
        specs = resolve_shares(specs, args, holdout)
    return specs


def build_rows(args: DataArguments, tokenizer: PreTrainedTokenizerBase, seed: int,
               holdout: Optional[tuple[str, float]] = None) -> tuple[TokenRows, list[SourceReport]]:
    """All training examples of the mixture (or with `holdout`, one side of --eval_split_ratio), in mixture
    order, and a report per source."""
    parts, reports = [], []
    for spec in mixture_specs(args, holdout):
        rows, report = source_rows(spec, args, tokenizer, seed)
        parts.append(rows)
        reports.append(report)
        logger.info("source %s (%s): %d rows, %d selected, %d kept, %d dropped", spec.name, report.format,
                    report.rows_in, report.rows_selected, report.rows_kept, sum(report.dropped.values()))
    rows = TokenRows.concat(parts)
    if not len(rows) and holdout and holdout[0] == "eval":
        raise UserError(f"--eval_split_ratio {holdout[1]} holds out no example; raise it")
    if not len(rows):
        raise UserError(nothing_left_message(reports, args.max_seq_length))
    return rows, reports

