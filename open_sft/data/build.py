"""The build of a mixture's training examples into one Arrow file, source by source, streaming where it can.

Every source but a JSON list file streams (open_sft.data.stream); a JSON list file is one JSON document, read
whole by the in-memory build (open_sft.data.pipeline.build_rows), whose examples are written the same way.
The result is the memory-mapped `datasets.Dataset` the cache saves, and the data report.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

from open_sft.data import pipeline as memory
from open_sft.data.spill import ExampleWriter
from open_sft.data.stream import Reader, chat_source, text_source
from open_sft.data.summary import length_percentiles
from open_sft.errors import UserError

logger = logging.getLogger(__name__)


def build_sources(args: Any, tokenizer: Any, seed: int, holdout: Optional[tuple[str, float]],
                  tmp: Path) -> tuple[ExampleWriter, list[Any]]:
    """The mixture's examples written to `tmp/examples.arrow`, in mixture order, and a SourceReport each."""
    tmp.mkdir(parents=True, exist_ok=True)
    writer = ExampleWriter(tmp / "examples.arrow")
    reports = []
    for number, spec in enumerate(memory._specs(args, holdout)):
        report = _stream_source(spec, args, tokenizer, seed, writer, tmp / f"source{number}")
        if report is None:  # read whole: a JSON list file, or a first row that does not say the format
            rows, report = memory._source_rows(spec, args, tokenizer, seed)
            writer.write(rows)
        reports.append(report)
        logger.info("source %s (%s): %d rows, %d selected, %d kept, %d dropped", spec.name, report.format,
                    report.rows_in, report.rows_selected, report.rows_kept, sum(report.dropped.values()))
    if not sum(r.examples for r in reports) and holdout and holdout[0] == "eval":
        raise UserError(f"--eval_split_ratio {holdout[1]} holds out no example; raise it")
    if not sum(r.examples for r in reports):
        raise UserError("no training examples are left after mixing, truncation and filtering; see the data report")
    return writer, reports


def build_dataset(args: Any, tokenizer: Any, seed: int, key: str, holdout: Optional[tuple[str, float]],
                  tmp: Path) -> tuple[Any, dict[str, Any]]:
    """(dataset, data report) of the mixture, the dataset memory-mapped from `tmp`, which must outlive it."""
    writer, reports = build_sources(args, tokenizer, seed, holdout, tmp)
    report = {"sources": [r.to_dict() for r in reports], "examples": sum(r.examples for r in reports),
              "tokens": sum(r.tokens for r in reports), "trained_tokens": sum(r.trained_tokens for r in reports),
              "length_percentiles": length_percentiles(writer.all_lengths())}
    return writer.finish(fingerprint=key), report


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
    report = memory.SourceReport(name=spec.name, format=fmt, rows_in=0)

    def select(valid: list[int], lengths: Any) -> list[int]:
        return memory._select(spec, args, valid, lengths, seed)

    if fmt == "text":
        text_source(spec, args, tokenizer, seed, reader, writer, tmp, report, select)
    else:
        chat_source(spec, args, tokenizer, seed, reader, fmt, writer, tmp, report, select)
    return report
