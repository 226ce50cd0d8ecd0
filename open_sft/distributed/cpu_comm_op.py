"""DeepSpeed's CPU communication op (`deepspeed_shm_comm`), said once instead of a silent minute.

DeepSpeed on CPU (DS_ACCELERATOR=cpu, gloo) builds its shared-memory collective op with torch's JIT extension
loader the first time it starts on a machine: about a minute on 2 cores, then cached in torch's extensions
directory (TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions/<python>_<device>/), so it is compiled once per
machine (and Python/torch build) and loaded in a second by every later run; a second virtual environment sharing
that directory compiles it again (torch's loader rebuilds for another environment's paths), which is said too.
DeepSpeed says nothing while it compiles and then prints "... built successfully" on every rank. `announce` says
before it, on the main process only, whether it compiles now (and where it goes) and drops DeepSpeed's per-rank
print.
"""

from __future__ import annotations

import importlib
import logging
from pathlib import Path
from typing import Optional

logger = logging.getLogger(__name__)

OP = "ShareMemCommBuilder"


def _silent(*args, **kwargs) -> None:
    """Stands for `print` in deepspeed.comm.torch, whose one print is the per-rank 'built successfully'."""


def build_directory(name: str) -> Optional[Path]:
    """Where torch's JIT loader builds and caches the extension `name`; None if torch no longer says."""
    try:
        from torch.utils.cpp_extension import _get_build_directory  # private, stable since torch 1.x

        return Path(_get_build_directory(name, verbose=False))
    except Exception:  # a torch that moved it: the announcement then names no directory
        return None


def is_built(name: str) -> bool:
    """Whether a library of `name` is in its build directory (built by this environment or another)."""
    directory = build_directory(name)
    return directory is not None and (directory / f"{name}.so").is_file()


def is_cached(name: str) -> bool:
    """Whether torch's loader will load `name` as built: the library is there and its build.ninja names this
    torch's headers. The loader rewrites build.ninja with this environment's paths, so a build another Python
    environment made (another venv's torch, sharing the extensions directory) is compiled again."""
    from torch.utils.cpp_extension import include_paths

    if not is_built(name):
        return False
    try:
        ninja = (build_directory(name) / "build.ninja").read_text()
    except OSError:
        return False
    return include_paths()[0] in ninja


def announce(is_main: bool) -> Optional[str]:
    """Before DeepSpeed starts on CPU: the line said (main process) about its communication op, or None when
    nothing is compiled (a GPU run, an op installed prebuilt, one this machine compiled before)."""
    import torch

    if torch.cuda.is_available():
        return None
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops

    if get_accelerator().device_name() != "cpu":
        return None
    # a module global shadows the builtin in that module alone (imported by name: `import deepspeed.comm.torch as m`
    # gives torch itself, which deepspeed.comm imports under that name)
    importlib.import_module("deepspeed.comm.torch").print = _silent
    builder = get_accelerator().create_op_builder(OP)
    if builder is None or installed_ops.get(builder.NAME) or is_cached(builder.name):
        return None
    where = build_directory(builder.name)
    line = (f"compiling DeepSpeed's CPU communication op ({builder.name}): about a minute, once per machine "
            f"(cached in {where or 'the torch extensions directory'}"
            f"{'; the build there is another Python environment’s' if is_built(builder.name) else ''})")
    if is_main:
        logger.info("%s", line)
    return line
