"""Whether a tokenization cache entry is complete and intact: the manifest its build writes into COMPLETE (written
last: the sha256 of every data file, their sizes and the hash of their edges, and the sha256 of key.json and
report.json), and the check of an entry against it on a hit (open_sft.data.cache)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Optional

COMPLETE = "COMPLETE"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# the entry's JSON records beside its data: hashed apart from the data files ("records" in COMPLETE), so that
# entries written before they were hashed keep matching their manifests; each must parse, hashed or not
RECORDS = ("key.json", "report.json")


def _data_files(entry: Path) -> list[Path]:
    return sorted(p for p in entry.rglob("*") if p.is_file() and p.name not in (COMPLETE, *RECORDS))


# Above this many bytes an entry is checked on a hit by its files' sizes and the hash of each file's first and
# last EDGE_BYTES (every byte is hashed when it is built): hashing a corpus's cache in full at every launch
# would cost a second per GB before training starts.
FULL_CHECK_BYTES = 1 << 30
EDGE_BYTES = 1 << 20


def _edges(path: Path) -> str:
    """sha256 of the file's first and last EDGE_BYTES (and its size)."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with path.open("rb") as handle:
        digest.update(handle.read(EDGE_BYTES))
        handle.seek(max(0, size - EDGE_BYTES))
        digest.update(handle.read(EDGE_BYTES))
    return digest.hexdigest()


def manifest(entry: Path) -> dict[str, Any]:
    files = _data_files(entry)
    return {"files": {str(p.relative_to(entry)): sha256_file(p) for p in files},
            "sizes": {str(p.relative_to(entry)): p.stat().st_size for p in files},
            "edges": {str(p.relative_to(entry)): _edges(p) for p in files},
            "records": {name: sha256_file(entry / name) for name in RECORDS}}


def _record_problem(entry: Path, name: str, digest: Optional[str]) -> Optional[str]:
    """What is wrong with the record `name` (a damaged report.json crashed every launch that hit the entry)."""
    try:
        if digest is not None and sha256_file(entry / name) != digest:
            return f"{name} is damaged (sha256 mismatch)"
        if not isinstance(json.loads((entry / name).read_bytes()), dict):
            return f"{name} is damaged (not a JSON object)"
    except FileNotFoundError:
        return f"{name} is missing"
    except ValueError as exc:  # zeros, a cut: json's (and utf-8's) error
        return f"{name} is damaged ({exc})"
    return None


def verify(entry: Path) -> Optional[str]:
    """None when the entry is complete and intact, else what is wrong with it."""
    marker = entry / COMPLETE
    if not marker.exists():
        return "no COMPLETE marker (an interrupted build)"
    try:
        manifest = json.loads(marker.read_text())
        expected = manifest["files"]
    except (ValueError, KeyError):
        return "unreadable COMPLETE marker"
    records = manifest.get("records") if isinstance(manifest.get("records"), dict) else {}
    for name in RECORDS:
        if problem := _record_problem(entry, name, records.get(name)):
            return problem
    actual = {str(p.relative_to(entry)): p for p in _data_files(entry)}
    if set(actual) != set(expected):
        return f"files differ from the COMPLETE manifest ({sorted(set(actual) ^ set(expected))})"
    sizes, edges = manifest.get("sizes"), manifest.get("edges")
    if sizes is not None:
        for name, size in sizes.items():
            if actual[name].stat().st_size != size:
                return f"{name} is damaged (size {actual[name].stat().st_size}, built {size})"
    if edges is not None and sum(sizes.values()) > FULL_CHECK_BYTES:
        for name, digest in edges.items():
            if _edges(actual[name]) != digest:
                return f"{name} is damaged (sha256 mismatch of its first and last MiB)"
        return None
    for name, digest in expected.items():
        if sha256_file(actual[name]) != digest:
            return f"{name} is damaged (sha256 mismatch)"
    return None
