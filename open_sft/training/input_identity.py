"""What a run's local inputs hold, by which a launch that names them at another path is known to give the same ones
(a requeue on a node that mounts the model, tokenizer, data or chat template elsewhere: /mnt/a/models/llama against
/mnt/b/models/llama): a checkpoint's run identity records the model's and its config's (a resume lets their paths
differ where they match, open_sft.training.completion.check_resume_point), the completion record all of them (the
relaunch of a finished run is `already complete` where they match: completion._differences).

A data source is known by the content hash the tokenized data's cache key holds (data.sources.source_identity, a
large file's remembered: cheap on a second look); a model, config, tokenizer or template file or directory by each
of its files (a directory's top level, by name): a weight file by its size, safetensors header and windows of its
tensor data (trained_state.sample_weights: a multi-GB model is not read whole), as is any file over 64 MiB; any
other file by all of its bytes (configs, tokenizer files, templates).
A Hub id, or a path that is not there, has no identity here: its setting is compared as written.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Collection, Optional

from open_sft.errors import UserError
from open_sft.training.trained_state import HEADER_MAX, WEIGHT_FILES, sample_weights

INPUTS_KEY = "inputs"  # in a checkpoint's identity and the completion record: {flag: identity}
MODEL_FLAGS = ("model_name_or_path", "config_name")  # a checkpoint's: its data's cache key holds the others
INPUT_FLAGS = (*MODEL_FLAGS, "tokenizer_name_or_path", "chat_template_path", "dataset_mixer_list")
TENSOR_EDGE = 256  # bytes read at each end of every tensor of a safetensors file (tensor_edges)
# The data a completion record or a relaunch hashes to know its sources at another path (the end of every run
# writes the record): beyond it (--dataset_skip_cache, whose hashes nobody remembers, or many small files), the
# sources are compared by path as before.
DATA_HASH_MAX = 2 << 30
WHOLE_MAX = 64 << 20  # a larger file is sampled as weights are (a Hub snapshot's tf_model.h5, flax_model.msgpack)


def identities(config: Any, flags: Collection[str] = INPUT_FLAGS) -> dict[str, Any]:
    """The identity of each of `flags` this launch's inputs have (see the module's docstring)."""
    return {flag: found for flag in flags if (found := identity(config, flag)) is not None}


def same_by_content(recorded: Optional[dict[str, Any]], config: Any, flags: Collection[str]) -> set[str]:
    """Those of `flags` whose identity `recorded` holds and this launch's inputs have (a record written before
    identities were recorded holds none: none is the same by content)."""
    recorded = recorded if isinstance(recorded, dict) else {}
    return {flag for flag in flags if recorded.get(flag) is not None and identity(config, flag) == recorded[flag]}


def identity(config: Any, flag: str) -> Optional[Any]:
    """The identity of the input `flag` names, or None (unset, a Hub id, missing)."""
    if flag == "dataset_mixer_list":
        return _sources(config.data)
    section = config.data if flag == "chat_template_path" else config.model
    return files_identity(getattr(section, flag))


def files_identity(name: Optional[str]) -> Optional[str]:
    """A local file's or directory's identity: each file of a directory's top level by name, size and content
    (weights and files over WHOLE_MAX sampled: trained_state.sample_weights; any other file whole); a single file
    by its size and content alone."""
    path = Path(name).expanduser() if name else None
    if path is None or not path.exists():
        return None
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    digest = hashlib.sha256()
    for file in files:
        if file != path:
            digest.update(f"{file.name}\0".encode())
        digest.update(f"{file.stat().st_size}\0".encode())
        if file.stat().st_size > WHOLE_MAX or any(file.match(pattern) for pattern in WEIGHT_FILES):
            sample_weights(file, digest)
            tensor_edges(file, digest)
        else:
            with file.open("rb") as handle:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(block)
    return f"{'file' if path.is_file() else 'dir'} {digest.hexdigest()}"


def tensor_edges(file: Path, digest: Any) -> None:
    """Into `digest`: the first and last TENSOR_EDGE bytes of every tensor of a safetensors file (nothing for other
    formats). The file's windows (sample_weights) fall where they fall: another fine-tune of the same shapes that
    changed some tensors only (a frozen part, a LoRA merged into q/v) could keep every window; each tensor's edges
    catch it, at two small reads per tensor."""
    if file.suffix != ".safetensors":
        return
    import json

    with file.open("rb") as handle:
        length = int.from_bytes(handle.read(8), "little")
        if length > HEADER_MAX or 8 + length > file.stat().st_size:
            return
        try:
            header = json.loads(handle.read(length))
        except ValueError:
            return
        spans = sorted(tuple(entry["data_offsets"]) for name, entry in header.items()
                       if name != "__metadata__" and isinstance(entry, dict) and "data_offsets" in entry)
        for begin, end in spans:
            for offset in sorted({begin, max(begin, end - TENSOR_EDGE)}):
                handle.seek(8 + length + offset)
                digest.update(handle.read(min(TENSOR_EDGE, end - offset)))


def _sources(data: Any) -> Optional[list[list[Any]]]:
    """Each source of --dataset_mixer_list with its amount: a local one by the content hash its data's cache key
    holds, a Hub dataset by its name; None where a source cannot be read (its setting is compared as written)."""
    from open_sft.data.cache import resolve_cache_dir
    from open_sft.data.sources import parse_mixer_list, source_identity

    memo = None if data.dataset_skip_cache else resolve_cache_dir(data.dataset_local_cache_dir)
    try:
        specs = parse_mixer_list(data.dataset_mixer_list, data.dataset_mixer_list_splits)
        if _bytes_to_hash([s for s in specs if s.is_local], memo is not None) > DATA_HASH_MAX:
            return None
        return [[source_identity(s, memo) if s.is_local else s.name, s.amount, s.is_fraction] for s in specs]
    except (UserError, OSError):
        return None


def _bytes_to_hash(specs: list[Any], remembered: bool) -> int:
    """The bytes source_identity would read for these local sources: every file's, or, where the cache remembers
    large files' hashes (the build hashed them), the files below MEMO_BYTES'."""
    from open_sft.data.cache import MEMO_BYTES

    total = 0
    for spec in specs:
        path = Path(spec.name).expanduser()
        for file in [path] if path.is_file() else (p for p in path.rglob("*") if p.is_file()):
            size = file.stat().st_size
            total += size if size < MEMO_BYTES or not remembered else 0
    return total
