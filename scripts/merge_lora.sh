#!/usr/bin/env bash
# Merge a trained LoRA adapter into its base model and save a full model.
#
#   scripts/merge_lora.sh ADAPTER_DIR OUTPUT_DIR [options of `python -m open_sft merge-lora`]
#
# ADAPTER_DIR is a run's --output_dir trained with --use_lora/--use_qlora (adapter_config.json names
# the base model; HF_HUB_OFFLINE=1 works when that is a local path). This is a thin wrapper around
# `python -m open_sft merge-lora ADAPTER_DIR OUTPUT_DIR ...` (see its --help for the options).
set -euo pipefail
usage() { sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; }
case "${1:-}" in -h|--help) usage; exit 0 ;; esac
[ $# -ge 2 ] || { usage >&2; exit 2; }
if [ ! -f "$1/adapter_config.json" ]; then
    echo "merge_lora.sh: $1/adapter_config.json not found; pass the --output_dir of a LoRA run" >&2
    exit 2
fi
exec "${PYTHON:-python}" -m open_sft merge-lora "$@"
