#!/usr/bin/env bash
# Tokenize the datasets of a run into the shared cache, without loading the model or training.
# Run it once (e.g. on a CPU node) before a multi-node job so the nodes only read the cache.
#
#   scripts/prepare_data.sh --model_name_or_path M --dataset_mixer_list data.jsonl 1.0 [same data flags as the run]
#   scripts/prepare_data.sh configs/examples/tiny.yaml
#
# Uses the same flags as finetune.py (the cache key comes from the tokenizer, data and data flags, so
# pass exactly those of the training run). OPEN_SFT_CACHE / --dataset_local_cache_dir choose the cache
# directory. The evaluation set is cached too. The last line printed is the training cache's path.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
usage() { sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; }
case "${1:-}" in -h|--help) usage; exit 0 ;; "") usage >&2; exit 2 ;; esac
exec "${PYTHON:-python}" "$ROOT/finetune.py" "$@" --cache_dataset_only
