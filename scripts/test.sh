#!/usr/bin/env bash
# Run the test suite (CPU, offline). Creates/reuses .venv and installs the project with test extras.
# Extra arguments go to pytest, e.g. ./scripts/test.sh -k config -x
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh test
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec python -m pytest -q "$@"
