"""Everything that changes the tokenized output of a build: the inputs of its cache key (open_sft.data.cache's
cache_key), written beside the entry as key.json."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any, Optional

from transformers import PreTrainedTokenizerBase

from open_sft.config.args import DataArguments
from open_sft.data.cache import resolve_cache_dir, tokenizer_fingerprint, tokenizing_libraries
from open_sft.data.chat.render import DEFAULT_OPTIONS, chat_options
from open_sft.data.chunks import Reader
from open_sft.data.compressed import data_suffix
from open_sft.data.format_detect import source_format
from open_sft.data.formats import without_arrow_fill
from open_sft.data.sources import TEXT_SUFFIX, SourceSpec, parse_mixer_list, saved_by_datasets, source_identity
from open_sft.data.template_date import template_dates
from open_sft.errors import UserError


def key_inputs(args: DataArguments, tokenizer: PreTrainedTokenizerBase, seed: int,
               holdout: Optional[tuple[str, float]] = None,
               clock: Optional[datetime.datetime] = None) -> dict[str, Any]:
    """Everything that changes the tokenized output, for the cache key (and key.json); `clock`: the moment the
    build renders the template's clock at (template_date.clock_at; None: now)."""
    specs = mixer_specs(args)
    # Settings added later enter the key only when set, so the keys of existing caches stay valid.
    later = {"sft_messages_key": args.sft_messages_key} if args.sft_messages_key != "messages" else {}
    if args.dataset_text_field != "text":
        later["dataset_text_field"] = args.dataset_text_field
    if args.add_bos:  # the chat template says it for chat rows; text documents take bos from the flag itself
        later["add_bos"] = True
    documents = text_only(args, specs)  # no chat template renders them: the template is no input
    options = chat_options(args)
    if options != DEFAULT_OPTIONS and not documents:
        later["chat_options"] = {"template_kwargs": options.template_kwargs, "reasoning_loss": options.reasoning_loss,
                                 **({"reasoning_history": options.reasoning_history}
                                    if options.reasoning_history != "template" else {})}
    memo = None if args.dataset_skip_cache else resolve_cache_dir(args.dataset_local_cache_dir)  # file hashes
    if holdout:
        later["eval_split"] = {"side": holdout[0], "ratio": holdout[1]}
    user_tokens = getattr(tokenizer, "open_sft_user_tokens", ())
    if user_tokens:  # --add_tokens / --add_special_tokens: their text in the data is no special text (the report)
        later["user_tokens"] = list(user_tokens)
    dates = None if documents else template_dates(tokenizer.chat_template, clock)
    if dates:  # Llama 3.1's "Today Date: ...": another day's examples are other tokens
        later["template_date"] = dates
    return {
        **later,
        # a local source by its content alone: the same file by another path (another node's mount) is a hit
        "sources": [{**({} if s.is_local else {"name": s.name}), "identity": source_identity(s, memo),
                     "amount": s.amount, "is_fraction": s.is_fraction, "split": s.split,
                     **({"config": s.config_name} if s.config_name else {}),
                     **({"chat_template_kwargs": s.chat_template_kwargs} if s.chat_template_kwargs else {})}
                    for s in specs],
        # the seed draws the rows a source gives (and those --eval_split_ratio holds out): not a key input where no
        # draw is made, so that runs of other seeds over whole copies of their sources (1.0) share one entry
        **({"seed": seed} if draws_rows(args, specs, holdout) else {}),
        "max_seq_length": args.max_seq_length,
        "truncation": args.truncation,
        "train_on": args.train_on,
        "dataset_format": args.dataset_format,
        "dataset_mixer_unit": args.dataset_mixer_unit,
        "on_bad_row": args.on_bad_row,
        "tokenizer_files": tokenizer_fingerprint(tokenizer, template=not documents),
        **({} if documents else {"chat_template": tokenizer.chat_template}),
        "special_tokens": {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())},
        "libraries": tokenizing_libraries(),
    }


def draws_rows(args: DataArguments, specs: list[SourceSpec], holdout: Optional[tuple[str, float]]) -> bool:
    """Whether the seed chooses rows (open_sft.data.mixer): a fraction f takes floor(f) whole copies of a source and
    draws the rest, so a whole fraction (1.0, 2.0) draws none, by rows or by tokens; a row count, a share, and
    --eval_split_ratio's held-out rows are drawn (whether a count is a multiple of the usable rows is known only once
    they are read)."""
    if holdout or args.dataset_mixer_unit == "share":
        return True
    return not all(spec.is_fraction and float(spec.amount).is_integer() for spec in specs)


def keys_template(args: DataArguments) -> bool:
    """Whether the data's cache key holds the chat template and the tokenizer's template (key_inputs): not for a
    mixture of text documents alone (text_only), which no template renders; True for a mixer list that does not
    parse (the data step refuses it)."""
    try:
        return not text_only(args, mixer_specs(args))
    except UserError:
        return True


def mixer_specs(args: DataArguments) -> list[SourceSpec]:
    """--dataset_mixer_list's sources as the key reads them."""
    return parse_mixer_list(args.dataset_mixer_list, args.dataset_mixer_list_splits,
                            config_name=args.dataset_config_name,
                            template_kwargs=args.dataset_mixer_list_chat_template_kwargs)


def text_only(args: DataArguments, specs: list[SourceSpec]) -> bool:
    """Whether every source is text documents, known before the build: under --dataset_format text, or each source's
    first row a document (the build takes a source's format from that row) where that row is cheap to read as the
    build reads it: a .txt file, JSON Lines, a parquet file (its first record batch), a `save_to_disk` directory
    (memory-mapped). A JSON document, a directory laid out as a Hub dataset (datasets picks its split's files and
    unifies their columns as it loads them all) and a Hub dataset are loaded whole first: a mixture holding one keeps
    the template in its key."""
    if args.dataset_format != "auto":
        return args.dataset_format == "text"
    return all(_documents(spec, args) for spec in specs)


def _documents(spec: SourceSpec, args: DataArguments) -> bool:
    import pyarrow

    try:  # a source that cannot be read is the build's to name
        first, where = _first_row(spec)
        return first is not None and source_format(args, first, where) == "text"
    except (UserError, OSError, ValueError, pyarrow.ArrowException):
        return False


def _first_row(spec: SourceSpec) -> tuple[Optional[dict], str]:
    """The source's first row as the build reads it (chunks.Reader.first), where that is cheap; else None."""
    path = Path(spec.name).expanduser()
    if path.is_file() and data_suffix(path) in (".jsonl", ".json", TEXT_SUFFIX):
        reader = Reader.open(spec)  # None: a JSON document
        return reader.first() if reader is not None else (None, "")
    if path.is_file() and path.suffix == ".parquet":  # the build's datasets.Dataset.from_parquet converts it whole
        import pyarrow.parquet

        batch = next(pyarrow.parquet.ParquetFile(path).iter_batches(batch_size=1), None)
        row = batch.to_pylist()[0] if batch is not None and batch.num_rows else None
        return (None if row is None else without_arrow_fill(row)), f"{spec.name} row 0"
    if path.is_dir() and saved_by_datasets(path):
        return Reader.open(spec).first()  # datasets.load_from_disk, as the build opens it
    return None, ""
