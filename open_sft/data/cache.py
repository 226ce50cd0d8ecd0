"""The tokenization cache: `<cache_dir>/<sha256 key>/`, built once, loaded memory-mapped.

Layout of an entry: a `datasets` directory (columns `input_ids`, `labels`; one row per training
example before packing) loadable with `datasets.load_from_disk`, `key.json` (the inputs of the key,
for humans), `report.json` (the data report of the build) and `COMPLETE` (written last; holds the
sha256 of every data file, their sizes and the hash of their edges, and the sha256 of key.json and report.json,
so a damaged entry is detected: entries over FULL_CHECK_BYTES are checked on a hit by sizes and edges, smaller
ones by every byte).

Builds happen in `<key>.tmp-<pid>/` and are renamed into place. Concurrent processes (ranks, or
jobs sharing the directory) serialise on a `fcntl` lock: the first builds, the others wait and load. A cache this
process cannot write (a read-only mount) serves the entries it holds, under their locks taken shared.
We lock by hand because `datasets`' own fingerprint cache neither covers the tokenizer and template
nor keeps a crashed half-written build from being reused.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import IO, Any, Callable, Iterator, Optional

from open_sft.data.cache_check import COMPLETE, manifest, sha256_file, verify
from open_sft.data.cache_format import CACHE_FORMAT_VERSION
from open_sft.durable import out_of_space
from open_sft.errors import UserError
from open_sft.file_modes import share_as_umask

logger = logging.getLogger(__name__)


# A local source's sha256 enters the cache key: hashing an 8 GB corpus took ~10 s of every launch, on every rank.
# Files of MEMO_BYTES or more have their hash remembered under <cache_dir>/file_hashes/, keyed by what changes when
# the file does (real path, device, inode, size, modification and status-change times in ns): the bet git's index
# makes. The status-change time (ctime) because the others can all stay: new contents of the same size written in
# place with the old mtime put back (cp -p or rsync --inplace -t onto the file, touch -r) would read the old hash,
# and so the old cache entry; no tool can set a ctime, and one that moves for a chmod only costs a hash.
MEMO_BYTES = 64 << 20


def content_hash(path: Path, cache_dir: Optional[Path]) -> str:
    """sha256 of the file's bytes; remembered for a large file while its stat says it is unchanged."""
    stat = path.stat()
    if cache_dir is None or stat.st_size < MEMO_BYTES:
        return sha256_file(path)
    stamp = f"{path.resolve()}\0{stat.st_dev}\0{stat.st_ino}\0{stat.st_size}\0{stat.st_mtime_ns}\0{stat.st_ctime_ns}"
    memo = cache_dir / "file_hashes" / hashlib.sha256(stamp.encode()).hexdigest()
    try:
        remembered = memo.read_text().strip()
        if len(remembered) == 64:
            return remembered
    except OSError:
        pass
    digest = sha256_file(path)
    after = path.stat()
    if (after.st_mtime_ns, after.st_ctime_ns) == (stat.st_mtime_ns, stat.st_ctime_ns):  # not written while read
        try:  # a memo: a cache that cannot be written is named where its entry is locked
            memo.parent.mkdir(parents=True, exist_ok=True)
            staged = memo.with_name(f"{memo.name}.tmp-{os.getpid()}")
            staged.write_text(digest)
            os.replace(staged, memo)
        except OSError:
            pass
    return digest


# Keys transformers writes into tokenizer_config.json that describe how the tokenizer was loaded, not
# what it does (HF_HUB_OFFLINE sets local_files_only): they must not change the cache key.
_LOAD_ONLY_KEYS = ("local_files_only", "name_or_path", "_commit_hash", "cache_dir", "revision", "token")


TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")  # where save_pretrained writes the chat template


def tokenizer_fingerprint(tokenizer: Any, template: bool = True) -> dict[str, str]:
    """sha256 of every file the tokenizer saves: vocabulary, merges, special tokens, chat template (without it where
    `template` is False: a mixture of text documents, which no template renders)."""
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        config = Path(tmp) / "tokenizer_config.json"
        if config.exists():
            settings = json.loads(config.read_text())
            for key in _LOAD_ONLY_KEYS + (() if template else ("chat_template",)):
                settings.pop(key, None)
            config.write_text(json.dumps(settings, sort_keys=True))
        return {p.name: sha256_file(p) for p in sorted(Path(tmp).iterdir())
                if p.is_file() and (template or p.name not in TEMPLATE_FILES)}


# The libraries whose code turns the same files and template into tokens: an upgrade may change what they make
# (a normalizer fix, the template's rendering), so an entry built by other versions is not reused.
TOKENIZING_LIBRARIES = ("tokenizers", "transformers", "jinja2")


def tokenizing_libraries() -> dict[str, str]:
    return {name: importlib.metadata.version(name) for name in TOKENIZING_LIBRARIES}


def cache_key(inputs: dict[str, Any]) -> str:
    canonical = json.dumps({"version": CACHE_FORMAT_VERSION, **inputs}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def is_key(name: str) -> bool:
    """Whether `name` is a cache key (cache_key's sha256: 64 lowercase hex digits), as entries, locks and partial
    builds are named by."""
    return len(name) == 64 and all(c in "0123456789abcdef" for c in name)


def resolve_cache_dir(flag_value: str) -> Path:
    """$OPEN_SFT_CACHE when set (it overrides --dataset_local_cache_dir, as CONTRACT.md says), else the flag; absolute
    (the default is relative: --cache_dataset_only's last line, the log and run.json named the entry relative to the
    directory the run started in, which a job started elsewhere did not find)."""
    return Path(os.environ.get("OPEN_SFT_CACHE") or flag_value).expanduser().absolute()


def cache_dir_flag() -> str:
    """How the user named the cache directory, for a message: the variable when set, else the flag."""
    cache = os.environ.get("OPEN_SFT_CACHE")
    return f"OPEN_SFT_CACHE={cache} (it overrides --dataset_local_cache_dir)" if cache else "--dataset_local_cache_dir"


def lock_path(cache_dir: Path, key: str) -> Path:
    """The lock a build of `key` holds from before it reads its partial rows until its entry is in place."""
    return cache_dir / f"{key}.lock"


def open_lock(path: Path, wait: bool = True) -> Optional[IO]:
    """The lock file at `path`, open and locked (`flock`), or None when another process holds it and not `wait`.

    A key's lock file is removed by the process that holds it when the key is left without an entry (a failed
    build, an abandoned partial removed): a process that waited on that file then holds a file no longer at `path`
    and another may have made a new one and locked it, so each one taken is checked to be the one at `path`, and
    taken again from the path if not."""
    while True:
        handle = path.open("a")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
            here = os.stat(path)
        except (BlockingIOError, FileNotFoundError) as exc:
            handle.close()
            if isinstance(exc, BlockingIOError):
                return None
            continue
        except BaseException:
            handle.close()
            raise
        if os.path.samestat(os.fstat(handle.fileno()), here):
            return handle
        handle.close()  # (which lets go of its lock)


WAIT_POLL_S = 0.2  # how often a waiting launch tries the lock again
WAIT_SAY_S = 60.0  # how often it says it still waits


def _holder(path: Path) -> str:
    """Who holds a key's lock, as far as the cache shows: the build whose staging directory is there, else a process
    loading or checking the entry."""
    key = path.name.removesuffix(".lock")
    builds = sorted(path.parent.glob(f"{key}.tmp-*"))
    if builds:
        return f"being built by process {builds[-1].name.rsplit('-', 1)[-1]} in {builds[-1]}"
    return "held by another process (building, loading or checking it)"


def wait_for_lock(path: Path, poll_s: float = WAIT_POLL_S, say_s: float = WAIT_SAY_S) -> IO:
    """open_lock, saying so when another process holds the lock: one line when the wait starts (the entry, its
    lock, and the build holding it) and one every `say_s` seconds while it lasts. A launch waiting silently on
    another job's build of hours looked hung. flock cannot time out, so the wait tries it every `poll_s`."""
    handle = open_lock(path, wait=False)
    if handle is not None:
        return handle
    entry = path.with_suffix("")
    logger.info("waiting for the tokenization cache entry %s, %s (lock %s); it is used once built", entry,
                _holder(path), path)
    started = said = time.monotonic()
    while (handle := open_lock(path, wait=False)) is None:
        time.sleep(poll_s)
        if time.monotonic() - said >= say_s:
            said = time.monotonic()
            logger.info("still waiting for the tokenization cache entry %s (%.0f s so far), %s", entry,
                        said - started, _holder(path))
    return handle


# what flock says on a filesystem without locks (Lustre mounted without -o flock, NFS without its lock service): the
# directory may be writable, so "cannot be written" misled
NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP)


class UnwritableCache(UserError):
    """The cache directory cannot be written (a read-only mount, no permission): an entry already there is read."""


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = wait_for_lock(path)
    except OSError as exc:  # read-only, under a file, no permission: checked up front, unless it changed since
        if exc.errno in NO_LOCKS:
            raise UserError(f"{cache_dir_flag()}: the filesystem of the tokenization cache {path.parent} has no file "
                            f"locks (flock: {exc.strerror or exc}), which keep the builds of processes and jobs "
                            "sharing the cache apart; mount it with locks (Lustre: -o flock), give a directory on "
                            "another filesystem, or --dataset_skip_cache to tokenize without a cache") from exc
        kind = UnwritableCache if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM) else UserError
        raise kind(f"{cache_dir_flag()}: the tokenization cache {path.parent} cannot be written "
                   f"({exc.strerror or exc}); give a directory you can write, or --dataset_skip_cache to "
                   "tokenize without a cache") from exc
    with handle:
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def _shared(path: Path) -> Iterator[None]:
    """A key's lock taken shared through a read-only file where the lock file is there: a build by a process that can
    write the cache holds it until its entry is in place. Nothing is held without the file, or on a filesystem
    without locks."""
    try:
        handle = path.open("rb")
    except OSError:
        handle = None
    with handle or contextlib.nullcontext():
        try:
            if handle is not None:
                fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for the tokenization cache entry %s, %s (lock %s)", path.with_suffix(""),
                        _holder(path), path)
            fcntl.flock(handle, fcntl.LOCK_SH)
        except OSError:
            pass
        yield


def _load(entry: Path) -> tuple[Any, dict]:
    import datasets

    return datasets.load_from_disk(str(entry)), json.loads((entry / "report.json").read_text())


def load_or_build(cache_dir: Path, key: str, key_inputs: dict[str, Any],
                  build: Callable[[Path], dict]) -> tuple[Any, dict, Path, bool]:
    """The cached dataset and report for `key`, building them with `build(staging)` on a miss.

    Returns (dataset, report, entry path, hit). `build` writes a `datasets` directory (save_to_disk's layout)
    into the staging directory it is given and returns a JSON-able report.
    """
    try:
        return _load_or_build(cache_dir, key, key_inputs, build)
    except (OSError, RuntimeError) as exc:
        full = out_of_space(exc, cache_dir)
        if full is None:
            raise
        raise UserError(f"{full} while writing the tokenization cache; free space there, or move the cache "
                        f"({cache_dir_flag()}) to a disk with room, and rerun the same command: the build resumes "
                        "from its last complete chunk (nothing partial is used: an entry counts once COMPLETE is "
                        "written)") from exc


def _load_or_build(cache_dir: Path, key: str, key_inputs: dict[str, Any],
                   build: Callable[[Path], dict]) -> tuple[Any, dict, Path, bool]:
    entry, lock = cache_dir / key, lock_path(cache_dir, key)
    try:
        with _locked(lock):
            if entry.exists():
                problem = verify(entry)
                if problem is None:
                    dataset, report = _load(entry)
                    return dataset, report, entry, True
                logger.warning("cache entry %s is unusable (%s); rebuilding it", entry, problem)
                shutil.rmtree(entry)
            _build(cache_dir, key, key_inputs, build, entry, lock)
    except UnwritableCache as refusal:
        dataset, report = _read_only_hit(entry, lock, refusal)
        return dataset, report, entry, True
    dataset, report = _load(entry)  # memory-mapped, like a hit
    return dataset, report, entry, False


def _build(cache_dir: Path, key: str, key_inputs: dict[str, Any], build: Callable[[Path], dict], entry: Path,
           lock: Path) -> None:
    """The entry built in `<key>.tmp-<pid>/` and renamed into place, COMPLETE written last; under the key's lock."""
    for stale in cache_dir.glob(f"{key}.tmp-*"):  # left by a killed build; we hold the lock
        logger.warning("removing the partial build %s", stale)
        shutil.rmtree(stale, ignore_errors=True)
    staging = cache_dir / f"{key}.tmp-{os.getpid()}"
    staging.mkdir(parents=True)
    try:
        report = build(staging)
    except BaseException:  # bad data, an interrupt: no half-written entry is left (a kill leaves it to the next)
        shutil.rmtree(staging, ignore_errors=True)
        lock.unlink(missing_ok=True)  # a key without an entry keeps no lock file (held: see open_lock)
        raise
    (staging / "key.json").write_text(json.dumps(key_inputs, indent=2, sort_keys=True) + "\n")
    (staging / "report.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    with (staging / COMPLETE).open("w") as handle:
        json.dump({"key": key, **manifest(staging)}, handle)
        handle.flush()
        os.fsync(handle.fileno())
    share_as_umask(staging)  # a cache shared by users or containers is readable as the umask says
    os.replace(staging, entry)
    logger.info("cached tokenized data at %s", entry)


def _read_only_hit(entry: Path, lock: Path, refusal: UnwritableCache) -> tuple[Any, dict]:
    """The entry of a cache this process cannot write (built ahead, and mounted read-only where the training runs),
    checked and loaded as a hit is, under its lock taken shared; where it is not there or not usable, the refusal,
    saying how to build it. (A read-only cache was refused even where it held the entry.)"""
    cause = refusal.__cause__
    why = getattr(cause, "strerror", None) or cause
    with _shared(lock):
        problem = verify(entry) if entry.exists() else None
        if entry.exists() and problem is None:
            logger.info("the tokenization cache %s cannot be written (%s): its entry is read as it is", entry.parent,
                        why)
            return _load(entry)
    state = f"is unusable ({problem})" if problem else "is not there"
    raise UnwritableCache(f"{cache_dir_flag()}: the tokenization cache {entry.parent} cannot be written ({why}) and "
                          f"the entry of this data, {entry.name}, {state}: build it where the cache can be written "
                          "(this command with --cache_dataset_only), or give a directory you can write, or "
                          "--dataset_skip_cache to tokenize without a cache") from cause
