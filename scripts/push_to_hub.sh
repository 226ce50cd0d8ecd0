#!/usr/bin/env bash
# Upload a finished run's export to the Hugging Face Hub (retries transient failures; run again to resume).
# Usage: HF_TOKEN=... ./scripts/push_to_hub.sh OUTPUT_DIR --hub_model_id my-org/my-model [--hub_revision main] [--no_hub_private]
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${OPEN_SFT_VENV:-$ROOT/.venv}/bin/python"
[ -x "$PY" ] || PY=python3
exec "$PY" -m open_sft push "$@"
