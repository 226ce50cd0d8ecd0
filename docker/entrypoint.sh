#!/usr/bin/env bash
# Container entrypoint: `accelerate launch finetune.py FLAGS...` on this node via
# scripts/launch_multinode.sh (one process per visible GPU, or one process on a machine without GPUs; DeepSpeed
# config from $DEEPSPEED_CONFIG, default ZeRO-3; NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT or SLURM's variables
# for multi-node). Launch options come first, then finetune.py's flags:
#   docker run IMAGE --model_name_or_path ... --output_dir /out                    -> training
#   docker run IMAGE --num_processes 2 --deepspeed_config F --model_name_or_path ...  -> the launch chosen
#   docker run IMAGE --help                                                        -> finetune.py's flags
#   docker run IMAGE python -m open_sft report /out                                -> any other command, as is
# Every branch execs: the launch script becomes PID 1 and gets `docker stop`'s SIGTERM, which it forwards to
# the training processes (they checkpoint and exit 75).
set -euo pipefail
APP="${OPEN_SFT_APP:-/opt/open_sft}"

case "${1:-}" in
    --help|-h) exec python "$APP/finetune.py" --help ;;
    ""|-*) exec "$APP/scripts/launch_multinode.sh" "$@" ;;
    *) exec "$@" ;;
esac
