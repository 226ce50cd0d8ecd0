#!/usr/bin/env bash
# Run the test suite (CPU, offline). Creates/reuses .venv and installs the project with test extras.
# Extra arguments go to pytest, e.g. ./scripts/test.sh -k config -x  (-n 0: in this process, one test at a time)
# The tests run on one pytest-xdist worker per usable core (at most 8), a test file per worker at a time (its
# module fixtures' runs made once); OPEN_SFT_TEST_WORKERS sets the count.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh test
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
WORKERS="${OPEN_SFT_TEST_WORKERS:-$(python -c 'from open_sft.distributed.env import usable_cpus; print(min(8, usable_cpus()))')}"
exec python -m pytest -q -n "$WORKERS" --dist loadfile --no-loadscope-reorder "$@"
