"""The build of a mixture's training examples into a `datasets` directory, source by source, streaming where
it can.

Every source but a JSON list file streams (open_sft.data.stream); a JSON list file is one JSON document, read
whole by the in-memory build (open_sft.data.pipeline.build_rows), whose examples are written the same way.
The result is a `datasets` directory (save_to_disk's layout, written in place) and the data report.
"""

from __future__ import annotations

import atexit
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

import numpy as np

from open_sft.data import pipeline as memory
from open_sft.data.cache import cache_key, load_or_build, resolve_cache_dir
from open_sft.data.mixer import select_row_array
from open_sft.data.sources import parse_mixer_list
from open_sft.data.spill import ExampleWriter
from open_sft.data.stream import Reader, chat_source, text_source
from open_sft.data.summary import SourceReport, length_percentiles, nothing_left_message
from open_sft.errors import UserError

logger = logging.getLogger(__name__)


def build_sources(args: Any, tokenizer: Any, seed: int, holdout: Optional[tuple[str, float]], out: Path,
                  tmp: Path) -> tuple[ExampleWriter, list[Any]]:
    """The mixture's examples written to `out` (save_to_disk's layout, once the writer is finished), in mixture
    order, and a SourceReport each; `tmp` holds the spilled tokens meanwhile."""
    out.mkdir(parents=True, exist_ok=True)
    writer = ExampleWriter(out)
    reports = []
    for number, spec in enumerate(memory._specs(args, holdout)):
        report = _stream_source(spec, args, tokenizer, seed, writer, tmp / f"source{number}")
        if report is None:  # read whole: a JSON list file, or a first row that does not say the format
            rows, report = memory._source_rows(spec, args, tokenizer, seed)
            writer.write(rows)
        reports.append(report)  # its spill stays until the build ends: a killed build resumes after this source
        logger.info("source %s (%s): %d rows, %d selected, %d kept, %d dropped", spec.name, report.format,
                    report.rows_in, report.rows_selected, report.rows_kept, sum(report.dropped.values()))
    if not sum(r.examples for r in reports) and holdout and holdout[0] == "eval":
        raise UserError(f"--eval_split_ratio {holdout[1]} holds out no example; raise it")
    if not sum(r.examples for r in reports):
        raise UserError(nothing_left_message(reports, args.max_seq_length))
    return writer, reports


def build_dataset(args: Any, tokenizer: Any, seed: int, key: str, holdout: Optional[tuple[str, float]],
                  tmp: Path, out: Path) -> dict[str, Any]:
    """Writes the mixture's examples to `out` (a `datasets` directory) and returns the data report."""
    writer, reports = build_sources(args, tokenizer, seed, holdout, out, tmp)
    writer.finish(fingerprint=key)
    return {"sources": [r.to_dict() for r in reports], "examples": sum(r.examples for r in reports),
            "tokens": sum(r.tokens for r in reports), "trained_tokens": sum(r.trained_tokens for r in reports),
            "length_percentiles": length_percentiles(writer.all_lengths())}


def _stream_source(spec: Any, args: Any, tokenizer: Any, seed: int, writer: ExampleWriter,
                   tmp: Path) -> Optional[Any]:
    """The source's SourceReport after streaming its examples into `writer`, or None where it is read whole."""
    reader = Reader.open(spec)
    if reader is None:
        return None
    first, where = reader.first()
    if first is None:  # no row, or a first line that is not JSON: the in-memory build names the problem
        return None
    fmt = memory._format(args, first, where)
    if fmt != "text":
        memory._check_chat_template(tokenizer)
    tmp.mkdir(parents=True, exist_ok=True)
    report = SourceReport(name=spec.name, format=fmt, rows_in=0)

    def select(valid: Any, lengths: Any) -> np.ndarray:
        return select_row_array(spec, args.dataset_mixer_unit, valid, lengths, seed)

    if fmt == "text":
        text_source(spec, args, tokenizer, reader, writer, tmp, report, select)
    else:
        chat_source(spec, args, tokenizer, reader, fmt, writer, tmp, report, select)
    return report


def prepare(args: Any, tokenizer: Any, seed: int, holdout: Optional[tuple[str, float]]) -> Any:
    """open_sft.data.pipeline.prepare_data: the cache entry, built on a miss (once, under its lock)."""
    import datasets

    inputs = memory.key_inputs(args, tokenizer, seed, holdout)
    key = cache_key(inputs)
    if args.dataset_skip_cache:  # the examples' files live as long as this process
        tmp = Path(tempfile.mkdtemp(prefix="open_sft_build_"))
        atexit.register(shutil.rmtree, tmp, True)
        with memory._gc_paused():
            report = build_dataset(args, tokenizer, seed, key, holdout, tmp / "spill", tmp / "data")
        shutil.rmtree(tmp / "spill", ignore_errors=True)
        return memory.PreparedData(datasets.load_from_disk(str(tmp / "data")), report, key, None, False)
    cache_dir = resolve_cache_dir(args.dataset_local_cache_dir)
    # A build's tokenized rows are spilled to <key>.partial, chunk by chunk (open_sft.data.spill): a build that is
    # killed leaves them, and the next build of the entry (it holds the entry's lock) resumes after the last
    # chunk they hold. Bad data (a UserError) leaves nothing to resume.
    partial = cache_dir / f"{key}.partial"

    def build(staging: Path) -> dict[str, Any]:
        try:
            report = build_dataset(args, tokenizer, seed, key, holdout, partial, staging)
        except UserError:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        shutil.rmtree(partial, ignore_errors=True)
        return report

    with memory._gc_paused():
        dataset, report, entry, hit = load_or_build(cache_dir, key, inputs, build)
    logger.info("tokenized data %s: %s (%d examples)", "loaded from cache" if hit else "built", entry, len(dataset))
    # an entry is found by the sources' contents: built from other paths, its report names them as this run does
    names = [spec.name for spec in parse_mixer_list(args.dataset_mixer_list, args.dataset_mixer_list_splits,
                                                    config_name=args.dataset_config_name)]
    report = {**report, "sources": [{**source, "name": name} for source, name in zip(report["sources"], names)]}
    return memory.PreparedData(dataset, report, key, entry, hit)
