"""Render, tokenize and check conversations, in process or across --preprocessing_num_workers processes.

In one process the Rust tokenizer encodes a chunk on its own threads while the Python steps (the
template, labelling, the label check) run on this one, for the chunks before and after: their time
overlaps the encode's instead of adding to it. With N workers each forked process takes whole chunks
through every step with a single-threaded tokenizer, so all cores do all the work, the Python steps
too: unless told, one per usable core. (On 2 cores the two ways build real instruction rows about
equally fast, and short rows faster with the workers; on a node with many cores one Python thread
could not keep up with the tokenizer's.)
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
from collections.abc import Sequence
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
from transformers import PreTrainedTokenizerBase

from open_sft.data.byte_level import byte_table
from open_sft.data.formats import RowError
from open_sft.data.chat.examples import RENDER_NOTES, row_examples
from open_sft.data.chat.raw_rows import raw_opening
from open_sft.data.chat.render import DEFAULT_OPTIONS, FOUND_NOTE, ChatOptions, special_markers, template_state
from open_sft.data.chat.tool_arguments import takes_string_arguments
from open_sft.data.token_rows import TokenRows
from open_sft.data.cuts import splits_as_written
from open_sft.data.labels import Encoded, LabelledBatch, encode_batch, label_batch
from open_sft.distributed.env import usable_cpus
from open_sft.training.preemption import raise_unraised

logger = logging.getLogger(__name__)

_STATE: dict[str, Any] = {}  # set before forking; the children read it (copy-on-write, nothing pickled)
_MIN_ROWS_PER_WORKER = 1000  # below this, starting processes costs more than it saves
_MIN_ROWS_PER_CHUNK = 128
_IN_PROCESS_CHUNK = 1024  # rows encoded at a time in one process: enough for the tokenizer's threads
_Part = tuple["_Rendered", LabelledBatch]


class Numbered:
    """(index, item) for each item, as label_rows' work, made a chunk at a time rather than a tuple per
    row up front in the parent (its time is not spread over the workers)."""

    def __init__(self, items: Sequence[Any]):
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, rows: slice) -> list[tuple[int, Any]]:
        start, stop, _ = rows.indices(len(self.items))
        return list(zip(range(start, stop), self.items[start:stop]))


@dataclass(frozen=True)
class Labelled:
    """The labelled examples and where each row's are (`position`: row index → its first example in `rows`;
    `sizes[p]`: how many examples the row whose first is p made, in order from p: one, unless its template
    rewrites earlier turns; 0 at the others), the rows that failed to render or label, (when the items are
    raw rows to convert) the rows that could not be converted, and counts of the labelled rows for the data
    report (`reasoning_not_rendered`)."""

    rows: TokenRows
    position: dict[int, int]
    errors: list[tuple[int, RowError]]  # in row-index order
    invalid: list[tuple[int, RowError]]  # in row-index order
    sizes: Optional[np.ndarray] = None  # None: one example a row
    notes: Counter = field(default_factory=Counter)
    flagged: dict[str, list[int]] = field(default_factory=dict)  # note → the first rows it counts (row indices)

    def group_sizes(self) -> np.ndarray:
        return np.ones(len(self.rows), dtype=np.int64) if self.sizes is None else self.sizes

    def then(self, other: "Labelled") -> "Labelled":
        """These rows and `other`'s (labelled from other row indices)."""
        offset = len(self.rows)
        sizes = None if self.sizes is None and other.sizes is None else np.concatenate(
            [self.group_sizes(), other.group_sizes()])
        return Labelled(TokenRows.concat([self.rows, other.rows]),
                        {**self.position, **{i: offset + p for i, p in other.position.items()}},
                        sorted(self.errors + other.errors, key=lambda error: error[0]),
                        sorted(self.invalid + other.invalid, key=lambda error: error[0]),
                        sizes, self.notes + other.notes, _first_flagged(self.flagged, other.flagged))


def _label_mismatch(raw: bool = False) -> RowError:
    if raw:  # TRL's prompt-completion strings: no template, the prompt's end and the completion's start merged
        return RowError("the completion's first token merges with the end of the prompt (a raw prompt + completion, "
                        "no chat template): its trained tokens do not decode to the completion; start the completion "
                        "with a space (' Paris.', as TRL's examples write it) or end the prompt with a newline",
                        "label_mismatch")
    return RowError("the trained tokens do not decode to the assistant turns (the tokenizer merges across a turn "
                    "boundary); try another chat template", "label_mismatch")


def _chunks(rows: int, workers: int) -> list[tuple[int, int]]:
    """[start, stop) of the chunks handed out to the workers as they free up, largest first ("guided"
    scheduling): each a quarter of the rows left per worker, at least _MIN_ROWS_PER_CHUNK. Rows differ
    in length, and a worker left with a big chunk at the end keeps the others idle; each chunk costs
    one encode call, so not all are small."""
    bounds, start = [], 0
    while start < rows:
        stop = min(rows, start + max(_MIN_ROWS_PER_CHUNK, (rows - start) // (4 * workers)))
        bounds.append((start, stop))
        start = stop
    return bounds


@dataclass
class _Rendered:
    """A chunk's work items rendered: the row indices, how many examples each made and the examples' (text,
    trained spans), the (row index, RowError) of the items that could not be rendered, and of those that could
    not be converted, and counts for the data report."""

    indices: list[int]
    counts: list[int]
    texts_and_spans: list[tuple[str, list[tuple[int, int]]]]
    errors: list[tuple[int, RowError]]
    invalid: list[tuple[int, RowError]]
    notes: Counter = field(default_factory=Counter)
    flagged: list[tuple[str, int]] = field(default_factory=list)  # (note, row index) of the rows counted in notes
    raw: set[int] = field(default_factory=set)  # the rows of raw prompt + completion text (no chat template)
    cuts: list[tuple[int, ...]] = field(default_factory=list)  # per example, where it is tokenized apart (cuts.py)


def _render(bounds: tuple[int, int]) -> _Rendered:
    """Convert (when the items are raw rows) and render the work items in [start, stop)."""
    tokenizer, train_on, markers, work, convert, wanted, options = (
        _STATE[k] for k in ("tokenizer", "train_on", "markers", "work", "convert", "wanted", "options"))
    done = _Rendered([], [], [], [], [])
    for n, (i, messages) in enumerate(work[bounds[0] : bounds[1]], start=1):
        if n % 4096 == 0:
            gc.collect(0)  # only objects made since the last call: cheap, and frees any cycles a template made
        if convert is not None:
            try:
                messages = convert(messages)
            except RowError as exc:
                done.invalid.append((i, exc))
                continue
            if wanted is not None and i not in wanted:
                continue
        try:
            rendered = row_examples(tokenizer, messages, train_on, markers, options)
        except RowError as exc:
            done.errors.append((i, exc))
            continue
        done.texts_and_spans += rendered.examples
        done.cuts += rendered.cuts or [()] * len(rendered.examples)
        done.indices.append(i)
        done.counts.append(len(rendered.examples))
        if getattr(messages, "raw_text", False):
            done.raw.add(i)
        for note in RENDER_NOTES:
            if getattr(rendered, note):
                done.notes[note] += 1
                done.flagged.append((note, i))
        done.notes.update(FOUND_NOTE + token for token in rendered.special_tokens_in_text)
    return done


def _label(rendered: _Rendered, encoded: Optional[Encoded] = None) -> _Part:
    batch = label_batch(_STATE["tokenizer"], rendered.texts_and_spans, check=_STATE["train_on"] != "all",
                        encoded=encoded, cuts=rendered.cuts)
    if rendered.raw and _STATE["opening"]:  # a raw prompt + completion's bos, as the tokenizer's encoding adds it
        firsts = np.cumsum(rendered.counts) - np.asarray(rendered.counts, dtype=np.int64)
        raw = [first for i, first in zip(rendered.indices, firsts.tolist()) if i in rendered.raw]
        batch = LabelledBatch(batch.rows.opened(np.asarray(raw, dtype=np.int64), _STATE["opening"][0],
                                                trained=_STATE["train_on"] == "all"), batch.right)
    return rendered, batch


def _chunk(bounds: tuple[int, int]) -> _Part:
    """A worker's whole job for the work items in [start, stop)."""
    return _label(_render(bounds))


def _in_process(rows: int, progress: Any) -> list[_Part]:
    """All chunks in this process, overlapped: a thread has the Rust tokenizer encode one chunk (on
    its own threads, without the GIL) while this one renders the next and labels the one before, so
    the Python steps do not add their time to the encode's."""
    from concurrent.futures import ThreadPoolExecutor

    tokenizer, parts, pending = _STATE["tokenizer"], [], None
    with ThreadPoolExecutor(1) as encoder:
        for bounds in _even_chunks(rows):
            rendered = _render(bounds)
            encoding = encoder.submit(encode_batch, tokenizer, [text for text, _ in rendered.texts_and_spans],
                                     rendered.cuts)
            if pending is not None:
                parts.append(_counted(_label(pending[0], pending[1].result()), pending[2], progress))
            pending = (rendered, encoding, bounds)
        if pending is not None:
            parts.append(_counted(_label(pending[0], pending[1].result()), pending[2], progress))
    return parts


def _counted(part: _Part, bounds: tuple[int, int], progress: Any) -> _Part:
    """`part`, the work items in `bounds`, told to `progress` (open_sft.data.chunks.Progress) when there is one."""
    if progress is not None:
        progress.update(bounds[1] - bounds[0], int(part[1].rows.bounds[-1]))
    return part


def _even_chunks(rows: int) -> list[tuple[int, int]]:
    """[start, stop) of chunks of _IN_PROCESS_CHUNK rows (the last may be smaller)."""
    return [(start, min(rows, start + _IN_PROCESS_CHUNK)) for start in range(0, rows, _IN_PROCESS_CHUNK)]


@contextlib.contextmanager
def _single_threaded_tokenizers():
    """Children forked with TOKENIZERS_PARALLELISM=false use one thread each (N workers fill N cores)
    and the tokenizers library does not warn that it disabled its threads after a fork."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


def _die_with_parent(parent: int) -> None:
    """A render worker ends when the process that forked it does: a build killed with -9 left its workers waiting
    on the task queue for good, each holding a tokenizer and the build's open files (Linux's parent-death
    signal; multiprocessing has no such option). And it ends at the SIGTERM the pool's exit sends it, whatever
    handler the parent had installed (a program that calls open_sft with a SIGTERM handler of its own — the
    test suite after the GPU check's in-process run — hung there: its idle workers ran the handler and waited on
    the task queue for good; open_sft's own handlers are reset at the fork by open_sft.training.preemption)."""
    import signal

    from open_sft.distributed.lifeline import parent_death_signal

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent:  # it died before the kernel was asked
        os._exit(1)


def label_rows(tokenizer: PreTrainedTokenizerBase, work: Sequence[tuple[int, Any]], train_on: str,
               workers: Optional[int], convert: Optional[Callable[[Any], Any]] = None,
               wanted: Optional[set[int]] = None, options: ChatOptions = DEFAULT_OPTIONS,
               progress: Any = None) -> Labelled:
    """Render, tokenize and label each (row index, messages); a row that cannot be rendered or whose
    labels fail the check is an error instead. With `convert`, the items are raw rows (a JSON line,
    say) that the workers turn into messages, so reading scales with the workers too: every item is
    converted (a RowError makes it invalid) and, if `wanted` is given, only those rows are labelled.
    workers=None: one process per usable core (this process for fewer rows than two workers' worth).
    `progress` (open_sft.data.chunks.Progress) is told of each part as it is done: its line every few seconds."""
    byte_table(tokenizer)  # made once here, before the fork, rather than once in every worker
    splits_as_written(tokenizer)  # the same (and not asked from two threads at once: _in_process's)
    if isinstance(tokenizer.chat_template, str):  # asked once here too (and said once), not in every worker
        takes_string_arguments(template_state(tokenizer, options))
    _STATE.update(tokenizer=tokenizer, train_on=train_on, markers=special_markers(tokenizer), work=work,
                  convert=convert, wanted=wanted, options=options, opening=raw_opening(tokenizer))
    try:
        workers = max(1, min(usable_cpus() if workers is None else workers, len(work) // _MIN_ROWS_PER_WORKER))
        if workers == 1:
            parts = _in_process(len(work), progress)
        else:
            import multiprocessing

            with _single_threaded_tokenizers():
                pool = multiprocessing.get_context("fork").Pool(workers, _die_with_parent, (os.getpid(),))
            with pool:
                raise_unraised()  # a stop signal during the fork ran its handler in the fork's hooks, which drop it
                # chunksize=1: map's default hands each worker 4 chunks at a time, which brings back the idle end;
                # imap (in order, as map) gives each part as it comes, for the progress line
                bounds = _chunks(len(work), workers)
                parts = [_counted(part, where, progress)
                         for where, part in zip(bounds, pool.imap(_chunk, bounds, chunksize=1))]
        logger.info("rendered, tokenized and checked %d rows in %d process(es)", len(work), workers)
    finally:
        _STATE.clear()
    return _collected(parts)


def _collected(parts: list[_Part]) -> Labelled:
    """The chunks' parts as one Labelled: a row whose examples do not all pass the label check is an error."""
    position: dict[int, int] = {}
    errors, invalid, notes, offset, flagged = [], [], Counter(), 0, {}
    split = any(count != 1 for rendered, _ in parts for count in rendered.counts)
    sizes = []
    for rendered, batch in parts:
        errors += rendered.errors
        invalid += rendered.invalid
        notes += rendered.notes
        for note, row in rendered.flagged:
            flagged = _first_flagged(flagged, {note: [row]})
        indices = np.asarray(rendered.indices, dtype=np.int64)
        counts = np.asarray(rendered.counts, dtype=np.int64)
        firsts = np.cumsum(counts) - counts
        if split:
            right = np.logical_and.reduceat(batch.right, firsts) if len(firsts) else np.zeros(0, dtype=bool)
            here = np.zeros(len(batch.right), dtype=np.int64)
            here[firsts] = counts
            sizes.append(here)
        else:
            right = batch.right
        errors += [(int(indices[k]), _label_mismatch(int(indices[k]) in rendered.raw))
                   for k in np.flatnonzero(~right).tolist()]
        good = np.flatnonzero(right)  # dict.update of two lists: no Python step per row
        position.update(zip(indices[good].tolist(), (firsts[good] + offset).tolist()))
        offset += len(batch.right)
    errors.sort(key=lambda error: error[0])
    return Labelled(TokenRows.concat([part[1].rows for part in parts]), position, errors, invalid,
                    np.concatenate(sizes) if split else None, notes, flagged)


_FLAGGED_SHOWN = 3  # rows named per note in the data report's warning


def _first_flagged(a: dict[str, list[int]], b: dict[str, list[int]]) -> dict[str, list[int]]:
    return {note: sorted(set(a.get(note, [])) | set(b.get(note, [])))[:_FLAGGED_SHOWN] for note in {*a, *b}}
