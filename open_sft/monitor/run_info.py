"""What run.json records besides the arguments: library versions and the git revision of open_sft."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

LIBRARIES = ("open_sft", "torch", "transformers", "accelerate", "deepspeed", "datasets", "peft", "tokenizers",
             "safetensors", "huggingface-hub")


def git_revision() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def library_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def write_json(path: Path, payload: dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)
