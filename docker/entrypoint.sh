#!/usr/bin/env bash
# Container entrypoint: `accelerate launch finetune.py FLAGS...` on this node via
# scripts/launch_multinode.sh (one process per visible GPU, DeepSpeed config from $DEEPSPEED_CONFIG,
# default ZeRO-3; NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT or SLURM's variables for multi-node).
#   docker run IMAGE --model_name_or_path ... --output_dir /out     -> training
#   docker run IMAGE --help                                         -> finetune.py's flags
#   docker run IMAGE python -m open_sft report /out                 -> any other command, as is
set -euo pipefail
APP="${OPEN_SFT_APP:-/opt/open_sft}"

case "${1:-}" in
    --help|-h) exec python "$APP/finetune.py" --help ;;
    ""|-*) exec "$APP/scripts/launch_multinode.sh" -- "$@" ;;
    *) exec "$@" ;;
esac
