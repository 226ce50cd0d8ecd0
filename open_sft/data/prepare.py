"""Data preparation's public face: from --dataset_mixer_list to the tokenized, labelled training examples
(PreparedData) and the data report, loaded from the cache or built on a miss (open_sft.data.build)."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import logging
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
from transformers import PreTrainedTokenizerBase

from open_sft.config.args import DataArguments
from open_sft.data.build import build_dataset
from open_sft.data.cache import COMPLETE, cache_key, load_or_build, resolve_cache_dir
from open_sft.data.cache_inputs import key_inputs
from open_sft.data.labels import Example
from open_sft.data.mixer import source_names
from open_sft.data.partials import partial_dir, record_sources, remove_abandoned
from open_sft.data.sources import parse_mixer_list
from open_sft.data.template_date import clock_at, read_clock, recorded_dates, remember, template_dates
from open_sft.durable import out_of_space
from open_sft.errors import UserError

logger = logging.getLogger(__name__)


@dataclass
class PreparedData:
    """The tokenized training set (memory-mapped `datasets.Dataset`) and how it was made.

    `sources[i]` is the mixer entry example i came from (an index into `source_names`). Examples are stored in
    mixture order, source after source, so the report's per-source example counts give it without a column in
    the cache."""

    dataset: Any
    report: dict[str, Any]
    cache_key: str
    cache_path: Optional[Path]
    cache_hit: bool
    clock: Optional[datetime.datetime] = None  # the moment its template's clock was read at (template_date)
    sources: np.ndarray = field(init=False)
    source_names: list[str] = field(init=False)

    def __post_init__(self) -> None:
        counts = [int(entry["examples"]) for entry in self.report["sources"]]
        if sum(counts) != len(self.dataset):
            raise ValueError(f"the report counts {sum(counts)} examples for a dataset of {len(self.dataset)}")
        self.sources = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
        self.source_names = source_names([entry["name"] for entry in self.report["sources"]])

    def source(self, index: int) -> int:
        return int(self.sources[index])

    def example(self, index: int) -> Example:
        row = self.dataset[index]
        return Example(row["input_ids"], row["labels"])

    def __len__(self) -> int:
        return len(self.dataset)

    def lengths(self) -> list[int]:
        return list(self.dataset["length"])


@contextlib.contextmanager
def _gc_paused():
    """Pause the cyclic garbage collector for a build. It allocates millions of small objects that
    cannot form cycles (parsed JSON rows, messages, token id lists) and keeps them alive to the end,
    so the collector's full passes over them find nothing and cost about a third of the build. The
    render loop, whose template may make cycles, collects its own young garbage (workers.py)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def how_found(hit: bool, entry: Path, started: float) -> str:
    """How this process came by a cache entry: built it, found it built while it waited for the entry's lock (by
    another rank of the same launch: "loaded from cache" read as if an old entry had been reused), or loaded it."""
    if not hit:
        return "built"
    if (entry / COMPLETE).stat().st_mtime >= started:
        return "built by another process while this one waited"
    return "loaded from cache"


def _build_uncached(args: DataArguments, tokenizer: PreTrainedTokenizerBase, seed: int, key: str,
                    holdout: Optional[tuple[str, float]]) -> tuple[Any, dict]:
    """--dataset_skip_cache: the dataset built in a temporary directory (TMPDIR) that lives as long as this process
    (the examples' files are read from there); a disk that fills says so, and how to give the build room."""
    import datasets

    tmp = Path(tempfile.mkdtemp(prefix="open_sft_build_"))
    atexit.register(shutil.rmtree, tmp, True)
    try:
        with _gc_paused():
            report = build_dataset(args, tokenizer, seed, key, holdout, tmp / "spill", tmp / "data")
    except (OSError, RuntimeError) as exc:
        full = out_of_space(exc, tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        if full is None:
            raise
        raise UserError(f"{full} while tokenizing (--dataset_skip_cache builds in the temporary directory); set "
                        "TMPDIR to a directory on a disk with room, or drop --dataset_skip_cache and give the cache "
                        "room (--dataset_local_cache_dir)") from exc
    shutil.rmtree(tmp / "spill", ignore_errors=True)
    return datasets.load_from_disk(str(tmp / "data")), report


class ResumedDataDiffer(UserError):
    """The tokenized data a resume would train on are not its checkpoint's (their cache keys differ), found before
    they are tokenized; the run phase (open_sft.run) names the flags that changed in their place."""

    def __init__(self, recorded: str, key: str):
        super().__init__(f"cannot resume: the checkpoint's tokenized data are {recorded}, this run's {key}; relaunch "
                         "with the checkpoint's data settings, or start over with --resume_from_checkpoint none")
        self.recorded, self.key = recorded, key


def prepare_data(args: DataArguments, tokenizer: PreTrainedTokenizerBase, seed: int,
                 holdout: Optional[tuple[str, float]] = None, resuming: Optional[dict] = None,
                 clock: Optional[datetime.datetime] = None) -> PreparedData:
    """Tokenized training data from the cache, building (once, under a lock) on a miss. `holdout` ("train" or
    "eval", ratio) builds one side of --eval_split_ratio, each side with its own cache entry. `resuming`: the
    trainer state of the checkpoint a resume reads (its data are kept where only the template's date differs; other
    data are refused here, ResumedDataDiffer).
    `clock`: the run's moment for a template that writes the date (template_date.read_clock, read once per run;
    read here where not given): the key holds its date and every render of the build writes it."""
    clock = clock or read_clock(tokenizer.chat_template)
    inputs = key_inputs(args, tokenizer, seed, holdout, clock)
    key = cache_key(inputs)
    inputs, key, identity_key = _resumed_dates(args, inputs, key, resuming)
    recorded = ((resuming or {}).get("identity") or {}).get("dataset_cache_key")
    if recorded and "seed" not in inputs and cache_key({**inputs, "seed": seed}) == recorded:
        identity_key = recorded  # a checkpoint of a version that keyed every run's seed, drawn or not: the same rows
    if recorded and recorded != identity_key:  # the resume would refuse them, after tokenizing and the model
        raise ResumedDataDiffer(recorded, identity_key)
    remember(identity_key, inputs.get("template_date"))
    if args.dataset_skip_cache:
        with clock_at(clock):
            built = _build_uncached(args, tokenizer, seed, key, holdout)
        return PreparedData(*built, identity_key, None, False, clock)
    cache_dir = resolve_cache_dir(args.dataset_local_cache_dir)
    # A build's tokenized rows are spilled to <key>.partial, chunk by chunk (open_sft.data.spill): a build that is
    # killed leaves them, and the next build of the entry (it holds the entry's lock) resumes after the last
    # chunk they hold. Bad data (a UserError) leaves nothing to resume. The abandoned partials of other keys (the
    # data changed, or nobody relaunched them) go when a build starts (open_sft.data.partials).
    partial = partial_dir(cache_dir, key)
    specs = parse_mixer_list(args.dataset_mixer_list, args.dataset_mixer_list_splits,
                             config_name=args.dataset_config_name)

    def build(staging: Path) -> dict[str, Any]:
        remove_abandoned(cache_dir, building=key)  # we hold this key's lock: a build has started
        record_sources(partial, [Path(spec.name).expanduser() for spec in specs if spec.is_local])
        try:
            report = build_dataset(args, tokenizer, seed, key, holdout, partial, staging)
        except UserError:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        shutil.rmtree(partial, ignore_errors=True)
        return report

    started = time.time()
    with _gc_paused(), clock_at(clock):
        dataset, report, entry, hit = load_or_build(cache_dir, key, inputs, build)
    logger.info("tokenized data %s: %s (%d examples)", how_found(hit, entry, started), entry, len(dataset))
    # an entry is found by the sources' contents: built from other paths, its report names them as this run does
    names = [spec.name for spec in specs]
    report = {**report, "sources": [{**source, "name": name} for source, name in zip(report["sources"], names)]}
    return PreparedData(dataset, report, identity_key, entry, hit, clock)


def prepare_run_data(args: DataArguments, tokenizer: PreTrainedTokenizerBase, seed: int,
                     resuming: Optional[dict] = None, clock: Optional[datetime.datetime] = None
                     ) -> tuple[PreparedData, Optional[PreparedData]]:
    """A run's training examples and its evaluation examples (--eval_dataset_mixer_list, or the side
    --eval_split_ratio holds out; None without either), under one reading of the template's clock (`clock`, else
    read now)."""
    clock = clock or read_clock(tokenizer.chat_template)  # a template that writes the date: one date for the run
    ratio = args.eval_split_ratio  # held out of each source before its amount is taken (split before upsampling)
    data = prepare_data(args, tokenizer, seed, ("train", ratio) if ratio else None, resuming, clock)
    if args.eval_dataset_mixer_list:  # built under --cache_dataset_only too: the training job then only loads it
        return data, prepare_data(args.evaluation_sources(), tokenizer, seed, clock=clock)
    return data, prepare_data(args, tokenizer, seed, ("eval", ratio), clock=clock) if ratio else None


def on_main_clock(args: DataArguments, tokenizer: PreTrainedTokenizerBase, seed: int, resuming: Optional[dict],
                  data: PreparedData, eval_data: Optional[PreparedData]) -> tuple[PreparedData, Optional[PreparedData]]:
    """The run's data (prepare_run_data's) as the main rank made them. Collective: every rank calls it, once there is
    a process group. Each rank read the template's clock at the data phase, before ranks could talk: ranks started
    on either side of midnight made data of two dates. A rank whose date is not the main rank's takes the main
    rank's data (its cache entry; else built under its moment); the others keep theirs."""
    from open_sft.distributed.collectives import broadcast_object

    main, template = broadcast_object(data.clock), tokenizer.chat_template
    if data.clock is None or template_dates(template, main) == template_dates(template, data.clock):
        return data, eval_data
    logger.warning("this rank read the date the chat template writes (%s) on another day than the main rank (%s): "
                   "it takes the main rank's data", data.clock.date(), main.date())
    return prepare_run_data(args, tokenizer, seed, resuming, main)


def _resumed_dates(args: DataArguments, inputs: dict[str, Any], key: str, resuming: Optional[dict]
                   ) -> tuple[dict[str, Any], str, str]:
    """The key inputs, the key to load or build and the key the run is known by. A resumed run whose template
    writes today's date (template_date), on another day: its checkpoint's data differ from today's in that date
    alone (the recorded key is these inputs with the recorded date). They are reused where the cache has them;
    else today's are built and the resume goes on under the run's key (the examples' date is today's): the resume
    is not refused for the date."""
    recorded, dates = recorded_dates(resuming)
    if not dates or not recorded or recorded == key or "template_date" not in inputs:
        return inputs, key, key
    theirs = {**inputs, "template_date": dates}
    if cache_key(theirs) != recorded:  # something else differs: the resume's own check says what
        return inputs, key, key
    day, today = ", ".join(sorted(set(dates.values()))), ", ".join(sorted(set(inputs["template_date"].values())))
    if not args.dataset_skip_cache and (resolve_cache_dir(args.dataset_local_cache_dir) / recorded / COMPLETE).exists():
        logger.info("resuming a run whose chat template writes the date: its tokenized data (dated %s) are reused, "
                    "not rebuilt with today's date (%s)", day, today)
        return theirs, recorded, recorded
    logger.warning("resuming a run whose chat template writes the date: its tokenized data (dated %s) are not in "
                   "this cache, so they are built again with today's date (%s), which the examples now carry; the "
                   "resume goes on", day, today)
    return inputs, key, recorded

