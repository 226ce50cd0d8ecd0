"""The build of a mixture's training examples into a `datasets` directory, source by source, streaming where
it can.

Every source but a JSON list file streams (open_sft.data.stream); a JSON list file is one JSON document, read
whole by the in-memory build (open_sft.data.in_memory), whose examples are written the same way.
The result is a `datasets` directory (save_to_disk's layout, written in place) and the data report.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any, Optional

import numpy as np
from transformers import PreTrainedTokenizerBase

from open_sft.config.args import DataArguments
from open_sft.data.chunks import Reader
from open_sft.data.formats import needs_chat_template
from open_sft.data.in_memory import check_chat_template, mixture_specs, source_format, source_rows
from open_sft.data.labels import Example
from open_sft.data.mixer import select_row_array
from open_sft.data.spill import ExampleWriter
from open_sft.data.stream import chat_source, text_source
from open_sft.data.summary import SourceReport, length_percentiles, no_usable_rows_message, nothing_left_message
from open_sft.errors import UserError

logger = logging.getLogger(__name__)


def build_sources(args: Any, tokenizer: Any, seed: int, holdout: Optional[tuple[str, float]], out: Path,
                  tmp: Path) -> tuple[ExampleWriter, list[Any]]:
    """The mixture's examples written to `out` (save_to_disk's layout, once the writer is finished), in mixture
    order, and a SourceReport each; `tmp` holds the spilled tokens meanwhile."""
    out.mkdir(parents=True, exist_ok=True)
    writer = ExampleWriter(out)
    reports = []
    for number, spec in enumerate(mixture_specs(args, holdout)):
        report = _stream_source(spec, args, tokenizer, seed, writer, tmp / f"source{number}")
        if report is None:  # read whole: a JSON list file, or a first row that does not say the format
            rows, report = source_rows(spec, args, tokenizer, seed)
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
    fmt = source_format(args, first, where)
    if needs_chat_template(fmt, first):
        check_chat_template(tokenizer)
    tmp.mkdir(parents=True, exist_ok=True)
    report = SourceReport(name=spec.name, format=fmt, rows_in=0)

    def select(valid: Any, lengths: Any) -> np.ndarray:
        if not len(valid):  # every row dropped as bad: counted by reason in the report by now
            raise UserError(no_usable_rows_message(report))
        return select_row_array(spec, args.dataset_mixer_unit, valid, lengths, seed)

    if fmt == "text":
        text_source(spec, args, tokenizer, reader, writer, tmp, report, select)
    else:
        chat_source(spec, args, tokenizer, reader, fmt, writer, tmp, report, select)
    return report


def build_examples(args: DataArguments, tokenizer: PreTrainedTokenizerBase,
                   seed: int) -> tuple[list[Example], list[SourceReport]]:
    """The mixture's examples as the cache gets them (streamed), and a report per source."""
    import datasets

    with tempfile.TemporaryDirectory() as tmp:
        writer, reports = build_sources(args, tokenizer, seed, None, Path(tmp) / "data", Path(tmp) / "spill")
        writer.finish("")
        rows = datasets.load_from_disk(str(Path(tmp) / "data"))
        return [Example(row["input_ids"], row["labels"]) for row in rows], reports

