"""From --dataset_mixer_list to tokenized, labelled training examples and a data report.

read → convert/validate → mix → render + label → truncate; each step is a function of its own
module, this one only wires them together and counts what happened to the rows.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from open_sft.config import DataArguments
from open_sft.data.formats import RowError, detect_format, to_messages
from open_sft.data.mixer import select_indices
from open_sft.data.sources import parse_mixer_list, read_source
from open_sft.data.tokenize import (
    IGNORE_INDEX,
    Example,
    special_markers,
    tokenize_conversations,
    trained_spans,
    truncate_example,
)
from open_sft.errors import UserError

logger = logging.getLogger(__name__)


@dataclass
class SourceReport:
    name: str
    format: str
    rows_in: int
    rows_selected: int = 0
    rows_kept: int = 0
    dropped: Counter = field(default_factory=Counter)
    truncated: int = 0
    tokens: int = 0
    trained_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "format": self.format, "rows_in": self.rows_in,
            "rows_selected": self.rows_selected, "rows_kept": self.rows_kept,
            "rows_dropped": dict(self.dropped), "truncated": self.truncated,
            "tokens": self.tokens, "trained_tokens": self.trained_tokens,
        }


def _check_chat_template(tokenizer: PreTrainedTokenizerBase) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(
            f"the tokenizer {tokenizer.name_or_path!r} has no chat template; use a tokenizer that has one "
            "(tokenizer_config.json 'chat_template' or chat_template.jinja)"
        )


def count_trained(labels: list[int]) -> int:
    """Tokens that get a loss: labels are shifted by one inside the model, so position 0 never does."""
    return sum(1 for label in labels[1:] if label != IGNORE_INDEX)


def build_examples(
    args: DataArguments, tokenizer: PreTrainedTokenizerBase, seed: int
) -> tuple[list[Example], list[SourceReport]]:
    """All training examples of the mixture, in mixture order, and a report per source."""
    _check_chat_template(tokenizer)
    markers = special_markers(tokenizer)
    examples: list[Example] = []
    reports = []
    for spec in parse_mixer_list(args.dataset_mixer_list, args.dataset_mixer_list_splits):
        source = read_source(spec)
        fmt = detect_format(source.rows[0], source.where(0))
        report = SourceReport(name=spec.name, format=fmt, rows_in=len(source.rows))
        conversations = [to_messages(row, fmt, source.where(i)) for i, row in enumerate(source.rows)]
        selected = select_indices(spec, len(conversations), seed)
        report.rows_selected = len(selected)

        unique = sorted(set(selected))
        rendered = []
        for i in unique:
            try:
                rendered.append(trained_spans(tokenizer, conversations[i], args.train_on, markers))
            except RowError as exc:
                raise UserError(f"{source.where(i)}: {exc}") from None
        by_index: dict[int, tuple[Example | None, str]] = {}
        for i, example in zip(unique, tokenize_conversations(tokenizer, rendered)):
            kept, reason = truncate_example(example, args.max_seq_length, args.truncation)
            if kept is not None and count_trained(kept.labels) == 0:
                kept, reason = None, "no_trained_tokens"
            by_index[i] = (kept, reason)

        for i in selected:
            kept, reason = by_index[i]
            if kept is None:
                report.dropped[reason] += 1
                continue
            report.truncated += reason == "truncated"
            report.rows_kept += 1
            report.tokens += len(kept.input_ids)
            report.trained_tokens += count_trained(kept.labels)
            examples.append(kept)
        reports.append(report)
        logger.info("source %s: %d rows, %d selected, %d kept", spec.name, report.rows_in,
                    report.rows_selected, report.rows_kept)
    if not examples:
        raise UserError("no training examples are left after mixing, truncation and filtering; see the data report")
    return examples, reports
