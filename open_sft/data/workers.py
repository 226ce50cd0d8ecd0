"""Render, tokenize and check conversations, in process or across --preprocessing_num_workers processes.

In one process the Rust tokenizer encodes a batch on its own threads while the Python steps (the
Jinja template, labelling, the label check) run on one core. With N workers each forked process
takes whole chunks through every step with a single-threaded tokenizer, so all cores do all the
work: on 2 cores this is faster than one process, and it scales with the cores of a real node.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
from typing import Any, Union

from transformers import PreTrainedTokenizerBase

from open_sft.data.formats import RowError
from open_sft.data.render import special_markers, trained_spans
from open_sft.data.tokenize import Example, LabelledBatch, label_batch

logger = logging.getLogger(__name__)

_STATE: dict[str, Any] = {}  # set before forking; the children read it (copy-on-write, nothing pickled)
_MIN_ROWS_PER_WORKER = 1000  # below this, starting processes costs more than it saves

Result = tuple[int, Union[Example, RowError]]


def _label_mismatch() -> RowError:
    return RowError("the trained tokens do not decode to the assistant turns (the tokenizer merges across a turn "
                    "boundary); try another chat template", "label_mismatch")


def _chunk(bounds: tuple[int, int]) -> tuple[list[int], LabelledBatch, list[tuple[int, RowError]]]:
    """For the work items in [start, stop): the row indices rendered, their labelled batch, and the
    (row index, RowError) of the rows that could not be rendered."""
    tokenizer, train_on, markers, work = (_STATE[k] for k in ("tokenizer", "train_on", "markers", "work"))
    errors: list[tuple[int, RowError]] = []
    rendered = []
    for n, (i, messages) in enumerate(work[bounds[0] : bounds[1]], start=1):
        if n % 4096 == 0:
            gc.collect(0)  # only objects made since the last call: cheap, and frees any cycles a template made
        try:
            rendered.append((i, trained_spans(tokenizer, messages, train_on, markers)))
        except RowError as exc:
            errors.append((i, exc))
    batch = label_batch(tokenizer, [texts_and_spans for _, texts_and_spans in rendered], check=train_on != "all")
    return [i for i, _ in rendered], batch, errors


def _results(indices: list[int], batch: LabelledBatch, errors: list[tuple[int, RowError]]) -> list[Result]:
    out: list[Result] = list(errors)
    out += [(i, example if ok else _label_mismatch())
            for i, example, ok in zip(indices, batch.examples(), batch.right.tolist())]
    return out


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


def label_rows(tokenizer: PreTrainedTokenizerBase, work: list[tuple[int, Any]], train_on: str,
               workers: int) -> list[Result]:
    """Each (row index, messages) → (row index, Example), or (row index, RowError) for a row that cannot
    be rendered or whose labels fail the check; in row-index order."""
    _STATE.update(tokenizer=tokenizer, train_on=train_on, markers=special_markers(tokenizer), work=work)
    try:
        workers = max(1, min(workers, len(work) // _MIN_ROWS_PER_WORKER))
        if workers == 1:
            results = _results(*_chunk((0, len(work))))
        else:
            import multiprocessing

            size = -(-len(work) // (workers * 4))  # several chunks per worker: the last ones balance the load
            with _single_threaded_tokenizers():
                pool = multiprocessing.get_context("fork").Pool(workers)
            with pool:
                parts = pool.map(_chunk, [(k, min(k + size, len(work))) for k in range(0, len(work), size)])
            results = [result for part in parts for result in _results(*part)]
        logger.info("rendered, tokenized and checked %d rows in %d process(es)", len(work), workers)
    finally:
        _STATE.clear()
    results.sort(key=lambda result: result[0])
    return results
