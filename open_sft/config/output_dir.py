"""What --output_dir may be, checked up front (before the data is tokenized and the model loaded): a directory
this process can write; none of the run's inputs (the export writes config.json, the weights, the tokenizer and
README.md there and removes an earlier export's weights, and a dataset directory would read the run's files as
data); and new, empty, or an open_sft run's own, unless --overwrite_output_dir says to write over what is there.
`--dry_run` and `--cache_dataset_only` write nothing there and are not checked, but for an empty --output_dir, which
names no directory (the current one, in effect) and is refused whatever the run does."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from open_sft.data.cache import resolve_cache_dir
from open_sft.file_modes import permitted, writable_dir_problem
from open_sft.training.checkpoint import CHECKPOINTS, METRICS_FILE
from open_sft.training.completion import MARKER
from open_sft.training.output_lock import LOCK_NAME

if TYPE_CHECKING:
    from open_sft.config.args import FinetuneConfig

# What marks a directory as an open_sft run's, in the order a run writes them: the lock (taken before anything
# else is written: a run killed while loading leaves it, and the relaunch must go on), metrics.jsonl, run.json,
# checkpoints/ (checkpoints.previous-N/ after a start over), RUN_COMPLETE. `open_sft export` copies run.json too.
RUN_MARKERS = (LOCK_NAME, METRICS_FILE, "run.json", CHECKPOINTS, MARKER)
# what a freshly made filesystem holds at its root (a volume mounted as --output_dir)
NOT_CONTENT = ("lost+found",)
INPUT_FLAGS = ("model_name_or_path", "tokenizer_name_or_path", "config_name", "add_tokens", "add_special_tokens")


def holds_run(directory: Path) -> bool:
    """Whether `directory` holds an open_sft run (finished, in progress, or killed after taking its lock)."""
    return any((directory / name).exists() for name in RUN_MARKERS) or \
        any(directory.glob(f"{CHECKPOINTS}.previous-*"))


def output_dir_problems(config: FinetuneConfig) -> list[str]:
    """Every problem with --output_dir, each with its fix."""
    given = config.train.output_dir
    if not (given or "").strip():
        return ["--output_dir is empty: it would be the current directory, whose files the run's model card, "
                "config.json and weights would be written over; give a directory of its own (it is created if "
                "missing), e.g. --output_dir output/my-run"]
    if config.train.dry_run or config.data.cache_dataset_only:  # neither writes there
        return []
    path = Path(given).expanduser().absolute()
    why = writable_dir_problem(path)
    if why is None and path.is_dir() and not permitted(path, os.R_OK):  # write-only: its content cannot be listed
        why = "no permission to read it (a run lists what it holds before writing there)"
    if why:
        return [f"--output_dir {given}: {why}; give a directory you can read and write (it is created if missing)"]
    problems = _input_problems(config, path.resolve())
    if not problems and path.is_dir() and not config.checkpoint.overwrite_output_dir:
        problems += _foreign_content_problems(given, path)
    return problems


def _local_inputs(config: FinetuneConfig) -> list[tuple[str, str, bool]]:
    """(flag, value, is a dataset) of each input given as a local path that exists."""
    m, d = config.model, config.data
    named = [(flag, getattr(m, flag), False) for flag in INPUT_FLAGS]
    named.append(("chat_template_path", d.chat_template_path, False))
    named += [("dataset_mixer_list", name, True) for name in d.dataset_mixer_list[0::2]]
    named += [("eval_dataset_mixer_list", name, True) for name in d.eval_dataset_mixer_list[0::2]]
    return [(flag, value, dataset) for flag, value, dataset in named
            if value and isinstance(value, str) and Path(value).expanduser().exists()]


def _input_problems(config: FinetuneConfig, out: Path) -> list[str]:
    """--output_dir that is an input, holds one, or lies inside a dataset directory or the tokenization cache."""
    problems = []
    given = config.train.output_dir
    for flag, value, dataset in _local_inputs(config):
        source = Path(value).expanduser().resolve()
        if source == out or out in source.parents:
            what = "is" if source == out else "holds"
            problems.append(f"--output_dir {given} {what} --{flag} {value}: the run writes its model there "
                            "(config.json, model*.safetensors, the tokenizer, README.md) and removes an earlier "
                            f"export's weights, which would destroy that input; give another --output_dir (a new "
                            "directory of its own)")
        elif dataset and source.is_dir() and source in out.parents:
            problems.append(f"--output_dir {given} lies inside the dataset directory --{flag} {value}: the run's "
                            "files there (metrics.jsonl, run.json, ...) would be read as data by the next run; give "
                            "an --output_dir outside it")
    cache = resolve_cache_dir(config.data.dataset_local_cache_dir).resolve()
    if not config.data.dataset_skip_cache and (cache == out or cache in out.parents):
        flag = "OPEN_SFT_CACHE" if os.environ.get("OPEN_SFT_CACHE") else "--dataset_local_cache_dir"
        problems.append(f"--output_dir {given} {'is' if cache == out else 'lies inside'} the tokenization cache "
                        f"({flag} {cache}), whose entries the run's files would be mixed with; give an --output_dir "
                        "outside it")
    return problems


def _foreign_content_problems(given: str, path: Path) -> list[str]:
    """A directory that holds, but no open_sft run, files of the names a run writes (config.json, README.md, the
    weights, the tokenizer, merged/): the export would write over them, or beside them and a loader then reads a
    mix. Other files (the job's own log, redirected there before the run starts: `> OUT/train.log`, SLURM's
    --output) are left alone by the export, so they are no reason to refuse."""
    if holds_run(path):
        return []
    clashing = sorted(p.name for p in path.iterdir() if p.name not in NOT_CONTENT and _run_writes(p.name))
    if not clashing:
        return []
    shown = ", ".join(clashing[:5]) + (f" (+{len(clashing) - 5} more)" if len(clashing) > 5 else "")
    return [f"--output_dir {given} already exists and holds files a run writes ({shown}) but no open_sft run (no "
            "run.json, checkpoints/ or RUN_COMPLETE): the run's export would write over them; give a new or empty "
            "directory, or pass --overwrite_output_dir to write into it anyway"]


# The names a run (its export, report and bookkeeping) writes at the top of --output_dir
RUN_WRITES = frozenset({"config.json", "generation_config.json", "README.md", "data_report.json", "report", "merged",
                        "tensorboard", "chat_template.jinja", "tokenizer.json", "tokenizer_config.json",
                        "special_tokens_map.json", "vocab.json", "merges.txt", "added_tokens.json", "tokenizer.model"})
RUN_WRITES_PREFIXES = ("model.", "model-", "pytorch_model", "adapter_", "data_order.", "activations.")


def _run_writes(name: str) -> bool:
    return name in RUN_WRITES or name.startswith(RUN_WRITES_PREFIXES)
