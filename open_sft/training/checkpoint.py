"""Resumable training state: atomic checkpoints, which are usable, pruning (choosing one to resume from and
what it must share with the run: open_sft.training.resume).

Layout of OUTPUT_DIR/checkpoints/step_N/ (N = optimizer steps done):
    accelerate's save_state: model + optimizer (DeepSpeed's own per-rank files under ZeRO, else
        model.safetensors + optimizer.bin; under QLoRA model.safetensors holds the trained weights only, not the
        4-bit base: open_sft.training.trained_state) and random_states_<rank>.pkl (python, numpy, torch RNGs per rank)
    model/: everything of the run's export but its weights (config.json, tokenizer, generation config; under LoRA
        adapter_config.json too), so that `open_sft export` makes a model of the checkpoint alone
    trainer_state.json: the step (our data order is a pure function of (seed, epoch, step), and so is the
        learning rate, so the step *is* the exact data and schedule position), token counters, the open logging
        window, the settings a resume must share (cache key, batch layout, seed), the resolved config
    COMPLETE: written last; a manifest of every file with its size

A checkpoint is written to step_N.tmp/, fsynced, renamed to step_N/, then metrics.jsonl (whose lines up to
step N a resume keeps) is fsynced, then COMPLETE is written and fsynced. A directory without COMPLETE, or whose
files do not match the manifest (or whose tensor files' headers do not read: damage_in), is never resumed from and
never pruned (but one without COMPLETE older than a usable one: what a kill while pruning left). Pruning follows
COMPLETE; a kill between the two leaves one checkpoint too many, which the next start
deletes (open_sft.training.checkpointer.Checkpointer.restore).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Collection, Iterator, Optional

from open_sft.durable import FREE_SPACE, fsync_path, human_size, refused_write, remove_tree, write_json
from open_sft.errors import UserError
from open_sft.file_modes import share_as_umask
from open_sft.training.damage import damage_in


logger = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
COMPLETE = "COMPLETE"
STATE_FILE = "trainer_state.json"
MODEL_FILES = "model"
METRICS_FILE = "metrics.jsonl"
FORMAT_VERSION = 1
TIMELINE_KEY = "timeline_from"  # in trainer_state.json: timeline_of
PEEKED_PATH = "peeked_from"  # added by elastic.peek to the trainer state it read (never written): which checkpoint
_STEP_DIR = re.compile(r"^step_(\d+)$")



@dataclass(frozen=True)
class ResumePoint:
    path: Path
    state: dict[str, Any]
    timeline: Optional[str] = None  # the named checkpoint the run continues from (timeline_of)

    @property
    def step(self) -> int:
        return int(self.state["step"])


# ----------------------------------------------------------------------------------------------
# Reading checkpoints
# ----------------------------------------------------------------------------------------------
def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """step_N directories under root (not .tmp ones), newest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return sorted(found, reverse=True)


def problem_with(path: Path) -> Optional[str]:
    """Why `path` is not a usable checkpoint, or None if it is."""
    if not path.is_dir():
        return "a file, not a directory" if path.is_file() else "no such directory"
    complete = path / COMPLETE
    if not complete.is_file():
        return what_else(path) or "no COMPLETE marker (interrupted while being written)"
    try:
        manifest = json.loads(complete.read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return "unreadable COMPLETE manifest"
    for name, size in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, the manifest says {size}"
    try:
        json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError):
        return f"{STATE_FILE} is unreadable"
    return damage_in(path, files)


def what_else(path: Path) -> Optional[str]:
    """What `path`, a directory with no COMPLETE marker, is when it is no interrupted checkpoint: a run's output
    directory or its checkpoints/ (with the newest complete checkpoint to pass instead), or no step_N at all."""
    root = path / CHECKPOINTS if (path / CHECKPOINTS).is_dir() else path
    newest = newest_usable(root)
    pass_newest = f"pass its newest complete checkpoint, {newest}" if newest else "it holds no complete checkpoint"
    if root != path or (path / "run.json").is_file():
        return f"it is a run's output directory, not a checkpoint; {pass_newest}"
    if step_dirs(path):
        return f"it is a run's {CHECKPOINTS}/ directory, not a checkpoint; {pass_newest}"
    return None if _STEP_DIR.match(path.name) else "no COMPLETE marker and not named step_N: no checkpoint"


def continued(setting: str, output_dir: Path) -> Optional[Path]:
    """The newest complete checkpoint of OUTPUT_DIR when a run resumed from the named checkpoint `setting` wrote
    it (a requeue of that command resumes there, as open-instruct's: the output dir's newest checkpoint wins;
    the named one may have been pruned since), else None. Reads only."""
    named = str(Path(setting).expanduser().resolve())
    newest = newest_usable(output_dir / CHECKPOINTS)
    return newest if newest is not None and timeline_of(newest) == named else None


def newest_usable(root: Path) -> Optional[Path]:
    """The newest checkpoint under `root` that problem_with finds nothing wrong with, or None. Reads only (a resume
    moves a damaged one aside: open_sft.training.resume.newest_complete)."""
    return next((path for _, path in step_dirs(root) if problem_with(path) is None), None)


@contextmanager
def rerun_after_full_disk(disk: Path, root: Path, what: str | Callable[[BaseException], str], room: str = "",
                          needs: str = "") -> Iterator[None]:
    """A write under the block that the disk holding `disk` refuses for want of space (durable.out_of_space: torch's
    and the Rust writers' errors, a DCP CheckpointException's too, a BaseException), or as read-only or not this
    user's (durable.refused_write), becomes a UserError saying `what` failed (a callable: told the exception), the
    fix (`room`: a way to need less space) and where the rerun of the same command resumes: the newest complete
    checkpoint under `root` (the run's checkpoints/), and what the rerun needs (`needs`; by default one more
    checkpoint: as much as the newest). Other errors pass through."""
    try:
        yield
    except BaseException as exc:
        refused = None if isinstance(exc, (KeyboardInterrupt, SystemExit)) else refused_write(exc, disk)
        if refused is None:
            raise
        reason, fix = refused
        newest = newest_usable(root)
        full = fix == FREE_SPACE  # what the rerun needs and a way to need less: said of a full disk
        size = f" ({needs or human_size(_size(newest)) + ': about what one more needs'})" if full and newest else ""
        where = (f"from the newest complete checkpoint, {newest.name}{size}" if newest is not None
                 else f"from step 0 (no complete checkpoint yet{f'; {needs}' if needs and full else ''})")
        what = what(exc) if callable(what) else what
        room = f" ({room})" if room and full else ""
        raise UserError(f"{reason}: {what}; {fix}{room} and rerun the same command: it resumes {where}") from exc


def timeline_of(checkpoint: Optional[Path]) -> Optional[str]:
    """The named checkpoint (resolved path) the run that wrote `checkpoint` started from, None for a run trained
    from step 0 or one whose checkpoints predate the record: checkpoints of one timeline carry the same one."""
    if checkpoint is None:
        return None
    return json.loads((checkpoint / STATE_FILE).read_text()).get(TIMELINE_KEY)


# ----------------------------------------------------------------------------------------------
# Writing checkpoints
# ----------------------------------------------------------------------------------------------
def _manifest(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


def _size(root: Path) -> int:
    return sum(_manifest(root).values())


def publish(tmp: Path, final: Path, step: int, covers: Collection[Path] = ()) -> None:
    """step_N.tmp → step_N, then the files it `covers` (metrics.jsonl up to step N) on disk, then COMPLETE (the
    manifest) written, flushed and renamed into place."""
    if final.exists():  # an unusable leftover of an earlier attempt at this step
        remove_tree(final)
    share_as_umask(tmp)  # safetensors writes 0600 whatever the umask
    os.rename(tmp, final)
    fsync_path(final.parent)
    for path in covers:
        if path.is_file():
            fsync_path(path)
    write_json(final / COMPLETE, {"step": step, "files": _manifest(final), "format": FORMAT_VERSION})


def prune(root: Path, keep: int, busy: Collection[Path] = ()) -> list[Path]:
    """Delete complete checkpoints beyond the newest `keep` usable ones (COMPLETE first: a kill part-way leaves an
    incomplete one, never resumed from), nor one in `busy` (under --push_checkpoints: not recorded as uploaded; a
    later prune deletes it). An incomplete one is never touched unless it is older than a usable one: then it can
    only be what a kill during an earlier prune left (a kill while one is written leaves the newest), and it is
    deleted, with a line. A deletion that fails is a warning (`_delete`): the save that prunes has published.
    keep -1: keep all."""
    if keep < 0:
        return []
    usable, newest, removed = 0, None, []
    for _, path in step_dirs(root):
        if not (path / COMPLETE).is_file():
            if newest is not None and _delete(path):
                logger.info("deleted %s: it has no COMPLETE and is older than %s, a usable checkpoint: what a kill "
                            "while pruning it left", path, newest.name)
            continue
        if usable < keep:
            if problem_with(path) is None:
                usable, newest = usable + 1, newest or path
            continue
        if path in busy:
            logger.info("keeping old checkpoint %s until it is uploaded", path)
        elif _delete(path):
            removed.append(path)
    return removed


def _delete(path: Path) -> bool:
    """An old checkpoint deleted, COMPLETE first; True when it is gone. A symlinked one (the user's, routed to
    another disk) loses its link alone: its target may be a copy the user keeps, and nothing outside the run's
    directories is deleted. A failure (on NFS, the .nfsXXXX of a file another process still reads; a permission) is a
    warning, never the save's failure: what is left has no COMPLETE, and the next pruning deletes it."""
    try:
        if path.is_symlink():
            target = path.resolve()
            path.unlink()
            logger.warning("old checkpoint %s is a link to %s: the link was removed, its target is left (delete it "
                           "yourself to free its space)", path, target)
            return True
        (path / COMPLETE).unlink(missing_ok=True)
        shutil.rmtree(path)
        return True
    except OSError as exc:
        logger.warning("could not delete old checkpoint %s (%s); the next pruning deletes what is left", path, exc)
        return False


def remove_all(output_dir: Path) -> None:
    """--clean_checkpoints_at_end: the run is exported, its checkpoints are no longer needed. A symlinked
    checkpoints/ keeps its link and target (the next run's routing): the run's step_N* in it are deleted, nothing
    else. A failure is a warning: the run is complete."""
    root = output_dir / CHECKPOINTS
    try:
        if root.is_symlink() and root.is_dir():
            for path in (path for path in root.glob("step_*") if path.is_dir()):
                remove_tree(path)
        elif root.is_dir():
            shutil.rmtree(root)
        else:
            return
        logger.info("deleted %s (--clean_checkpoints_at_end)", root)
    except OSError as exc:
        logger.warning("--clean_checkpoints_at_end: could not delete %s (%s); delete it yourself", root, exc)
