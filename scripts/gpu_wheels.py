#!/usr/bin/env python
"""The wheels a GPU machine without network needs for the GPU check, gathered here (package registries reachable).

    python scripts/gpu_wheels.py [OUT]     # default OUT: .gpu_wheels (ignored by git)

writes OUT/core (what open_sft, the TRL comparison and --fp8 need beyond the machine's image) and OUT/qlora
(bitsandbytes, 43 MB: its own carry, as the device tool takes 64 MiB a call), and OUT/install.sh, run there first:

    bash .gpu_wheels/install.sh && PYTHONPATH=.gpu_site:$PWD python3 scripts/gpu_check.py OUT --parts fp8 ...

It installs every wheel carried (core, qlora, or both) into .gpu_site in the checkout, without an index or
dependency resolution (all of them are here). What to carry is resolved here from each wheel's own requirements
(Requires-Dist, markers evaluated for the machine's CPython 3.12 on Linux x86-64): a requirement the image already
meets is left out, others follow with the version this checkout's venv was tested with where it has one. pip does
the downloads (`pip download --no-deps --only-binary` for the machine's platform); only the walk over the
requirements is written here, as pip cannot resolve for another machine's installed packages. DeepSpeed publishes
no wheel: one is built here without its CUDA ops (they are JIT-built there on first use).
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # open_sft from this checkout, installed or not
from open_sft.config.whole_flags import WholeFlagParser  # noqa: E402

# The machine: CPython 3.12 on Linux x86-64 (the device tool's KINDS.md, nvidia-h200)
PLATFORM = ["--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
            "--platform", "manylinux_2_24_x86_64", "--platform", "manylinux2014_x86_64"]
MARKERS = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.3",
           "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
           "implementation_name": "cpython", "platform_python_implementation": "CPython", "os_name": "posix"}
# The image's Python packages (the device tool's KINDS.md, as read on a machine on 2026-11-17: torch 2.11 with CUDA 13,
# transformers 5.17, accelerate 1.15, huggingface-hub 1.33, tokenizers 0.23, safetensors 0.8, ...): a requirement on
# one of them is taken as met, but for the packages named in CORE
IMAGE = {canonicalize_name(n) for n in """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax
fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2
joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-
it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions
nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc
nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir
onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging
pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow
pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-
mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham
simplejson six sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore
threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics
torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig
werkzeug wheel wrapt xarray xxhash yarl zipp
""".split()}
# Carried whatever the image has: the versions open_sft is tested with, and what the checks compare against
CORE = ["transformers", "huggingface-hub", "datasets", "peft", "trl==1.16.0", "torchao==0.18.0", "hjson",
        "pydantic", "liger-kernel"]
QLORA = ["bitsandbytes"]
BUILT_HERE = {"deepspeed"}  # no wheel on PyPI: `pip wheel` from its sdist, without ops


def tested_version(name: str) -> str | None:
    """The version this checkout's environment has (the suite's), if any."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def pinned(requirement: Requirement) -> str:
    """What to fetch for a requirement: the tested version when it satisfies it, else the newest that does."""
    version = tested_version(requirement.name)
    if version is not None and requirement.specifier.contains(version, prereleases=True):
        return f"{requirement.name}=={version}"
    return f"{requirement.name}{requirement.specifier}"


def requirements_of(wheel: Path) -> list[Requirement]:
    """The wheel's own requirements that apply on the machine (extras not asked for are left out)."""
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        lines = archive.read(metadata).decode().splitlines()
    found = [Requirement(line.split(":", 1)[1].strip()) for line in lines if line.startswith("Requires-Dist:")]
    return [r for r in found if r.marker is None or r.marker.evaluate({**MARKERS, "extra": ""})]


def fetch(spec: str, out: Path) -> Path:
    """One wheel for the machine into `out` (built here for BUILT_HERE); its path."""
    name = canonicalize_name(Requirement(spec).name)
    before = set(out.glob("*.whl"))
    if name in BUILT_HERE:
        command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(out), spec]
        env = {"DS_BUILD_OPS": "0"}
    else:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", *PLATFORM,
                   "-d", str(out), spec]
        env = {}
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **env})
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    new = set(out.glob("*.whl")) - before
    matches = [w for w in (new or out.glob("*.whl")) if parse_wheel_filename(w.name)[0] == name]
    if not matches:
        raise SystemExit(f"no wheel of {spec} came into {out}")
    return max(matches, key=lambda w: w.stat().st_mtime)


def gather(specs: list[str], out: Path, skip: set[str]) -> set[str]:
    """The wheels of `specs` and of every requirement the image does not meet, into `out`; the names gathered."""
    out.mkdir(parents=True, exist_ok=True)
    todo, seen = [Requirement(s) for s in specs], set(skip)
    while todo:
        requirement = todo.pop()
        name = canonicalize_name(requirement.name)
        if name in seen:
            continue
        seen.add(name)
        explicit = any(canonicalize_name(Requirement(s).name) == name for s in specs)
        if name in IMAGE and not explicit:
            continue
        spec = str(requirement) if requirement.specifier and explicit else pinned(requirement)
        wheel = fetch(spec, out)
        print(f"  {wheel.name} ({wheel.stat().st_size / 2**20:.1f} MiB)")
        todo.extend(requirements_of(wheel))
    return seen


INSTALL = """#!/usr/bin/env bash
# On the GPU machine, from the checkout: every carried wheel into .gpu_site (no index, no resolution: all are here)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -e .gpu_site/.core ] && ! compgen -G ".gpu_wheels/core/*.whl" > /dev/null; then
  echo "no .gpu_wheels/core here and none installed: carry .gpu_wheels/core first (this machine is a fresh one)" >&2
  exit 1
fi
for part in core qlora; do
  if compgen -G ".gpu_wheels/$part/*.whl" > /dev/null && [ ! -e ".gpu_site/.$part" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target .gpu_site .gpu_wheels/$part/*.whl
    touch ".gpu_site/.$part"
  fi
done
echo "installed into .gpu_site: run with PYTHONPATH=.gpu_site:$PWD"
"""


def main() -> int:
    parser = WholeFlagParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", type=Path, default=ROOT / ".gpu_wheels")
    out = parser.parse_args().out
    print(f"{out}/core:")
    core = gather(CORE + ["deepspeed"], out / "core", skip=set())
    print(f"{out}/qlora:")
    gather(QLORA, out / "qlora", skip=core)
    (out / "install.sh").write_text(INSTALL)
    for part in ("core", "qlora"):
        size = sum(w.stat().st_size for w in (out / part).glob("*.whl")) / 2**20
        print(f"{part}: {size:.1f} MiB (a device call carries 64 MiB with the working tree)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
