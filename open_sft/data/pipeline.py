"""From --dataset_mixer_list to tokenized, labelled training examples and a data report.

read → convert/validate → mix → render + label → truncate; each step is a function of its own
module, this one only wires them together and counts what happened to the rows.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from transformers import PreTrainedTokenizerBase

from open_sft.config import DataArguments
from open_sft.data.formats import RowError, detect_format, to_messages
from open_sft.data.mixer import select_indices
from open_sft.data.cache import cache_key, load_or_build, resolve_cache_dir, tokenizer_fingerprint
from open_sft.data.sources import parse_mixer_list, read_source, source_identity
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


@dataclass
class PreparedData:
    """The tokenized training set (memory-mapped `datasets.Dataset`) and how it was made."""

    dataset: Any
    report: dict[str, Any]
    cache_key: str
    cache_path: Optional[Path]
    cache_hit: bool

    def example(self, index: int) -> Example:
        row = self.dataset[index]
        return Example(row["input_ids"], row["labels"])

    def __len__(self) -> int:
        return len(self.dataset)


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


def key_inputs(args: DataArguments, tokenizer: PreTrainedTokenizerBase, seed: int) -> dict[str, Any]:
    """Everything that changes the tokenized output, for the cache key (and key.json)."""
    specs = parse_mixer_list(args.dataset_mixer_list, args.dataset_mixer_list_splits)
    return {
        "sources": [{"name": s.name, "identity": source_identity(s), "amount": s.amount,
                     "is_fraction": s.is_fraction, "split": s.split} for s in specs],
        "seed": seed,
        "max_seq_length": args.max_seq_length,
        "truncation": args.truncation,
        "train_on": args.train_on,
        "tokenizer_files": tokenizer_fingerprint(tokenizer),
        "chat_template": tokenizer.chat_template,
        "special_tokens": {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())},
    }


def _build(args: DataArguments, tokenizer: PreTrainedTokenizerBase, seed: int) -> tuple[Any, dict[str, Any]]:
    import datasets

    examples, reports = build_examples(args, tokenizer, seed)
    dataset = datasets.Dataset.from_dict({"input_ids": [e.input_ids for e in examples],
                                          "labels": [e.labels for e in examples]})
    report = {"sources": [r.to_dict() for r in reports], "examples": len(examples),
              "tokens": sum(r.tokens for r in reports), "trained_tokens": sum(r.trained_tokens for r in reports)}
    return dataset, report


def prepare_data(args: DataArguments, tokenizer: PreTrainedTokenizerBase, seed: int) -> PreparedData:
    """Tokenized training data from the cache, building (once, under a lock) on a miss."""
    _check_chat_template(tokenizer)
    inputs = key_inputs(args, tokenizer, seed)
    key = cache_key(inputs)
    if args.dataset_skip_cache:
        dataset, report = _build(args, tokenizer, seed)
        return PreparedData(dataset, report, key, None, False)
    cache_dir = resolve_cache_dir(args.dataset_local_cache_dir)
    dataset, report, entry, hit = load_or_build(cache_dir, key, inputs, lambda: _build(args, tokenizer, seed))
    logger.info("tokenized data %s: %s (%d examples)", "loaded from cache" if hit else "built", entry, len(dataset))
    return PreparedData(dataset, report, key, entry, hit)
