# Sourced by demo.sh and test.sh: create/reuse .venv and install the project into it.
# Usage: source scripts/_venv.sh [extras]   (extras like "test")
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${OPEN_SFT_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
EXTRAS="${1:-}"

# OPEN_SFT_VENV=none: no venv and no install, the python on PATH as it is (the Docker image sets it: open_sft and
# its dependencies are installed there, and the checkout in it is not writable).
if [ "$VENV" = none ]; then
    return 0
fi

if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"

# On a machine without an NVIDIA GPU, install the CPU build of torch first: a bare `torch`
# requirement pulls a multi-GB CUDA build. Set OPEN_SFT_TORCH_SPEC to choose another build;
# GPU machines skip this and get torch (with CUDA) from setup.cfg's requirement.
if ! python -c "import torch" 2>/dev/null && ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "[setup] installing CPU torch"
    pip install --quiet ${OPEN_SFT_TORCH_SPEC:-torch==2.13.0} 2> >(grep -v "is ignored: it is neither" >&2)
fi

# Reinstall only when the dependency list changed (a stamp of setup.cfg + extras). An install with extras
# (test.sh's) also serves a request without (demo.sh's): the demo after the tests does not reinstall.
STAMP="$VENV/.open_sft_install"
WANT="$(cat "$ROOT/setup.cfg" "$ROOT/pyproject.toml" | sha256sum | cut -c1-16)-$EXTRAS"
HAVE="$(cat "$STAMP" 2>/dev/null || true)"
if [ "$HAVE" != "$WANT" ] && { [ -n "$EXTRAS" ] || [ "${HAVE%%-*}-" != "$WANT" ]; }; then
    echo "[setup] installing open_sft${EXTRAS:+[$EXTRAS]} into $VENV"
    # (the grep drops pip's notices about this machine's local index mirrors, which are noise here)
    pip install --quiet -e "$ROOT${EXTRAS:+[$EXTRAS]}" 2> >(grep -v "is ignored: it is neither" >&2)
    echo "$WANT" > "$STAMP"
fi

# The suite's --fp8 tests need torchao, but not in the venv: transformers imports an installed torchao while loading
# any model (1.1 s and its C++ kernels' load warnings in every process of every test). It goes to a folder of its
# own, which only the FP8 tests put on their processes' PYTHONPATH (tests/conftest.py FP8_SITE).
FP8_SITE="$VENV/fp8-site"
if [ "$EXTRAS" = "test" ] && [ ! -d "$FP8_SITE/torchao" ]; then
    echo "[setup] installing torchao into $FP8_SITE (the FP8 tests')"
    pip install --quiet --no-deps --target "$FP8_SITE" "torchao==0.18.0" 2> >(grep -v "is ignored: it is neither" >&2)
fi
