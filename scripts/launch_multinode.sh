#!/usr/bin/env bash
# Start open_sft on this node of a multi-node DeepSpeed job: `accelerate launch` with torchrun on each
# node (--deepspeed_multinode_launcher standard: no pdsh, no ssh between nodes). Run it once per node.
#
#   scripts/launch_multinode.sh [options] [--] FINETUNE_FLAGS...
#
# Options (each falls back to the environment, then SLURM's variables, then a default):
#   --num_machines N            $NUM_MACHINES, $NNODES, $SLURM_NNODES, 1
#   --machine_rank R            $MACHINE_RANK, $NODE_RANK, $SLURM_NODEID, 0
#   --main_process_ip HOST      $MAIN_PROCESS_IP, $MASTER_ADDR, first host of $SLURM_JOB_NODELIST, 127.0.0.1
#   --main_process_port PORT    $MAIN_PROCESS_PORT, $MASTER_PORT, 29500
#   --processes_per_machine G   $PROCESSES_PER_MACHINE, $SLURM_GPUS_ON_NODE, GPUs seen by nvidia-smi, else 1
#                               (no GPU: one process, whose threads use every core this node gives it)
#   --num_processes N           all machines' processes together, as accelerate counts them: N / num_machines here
#   --deepspeed_config FILE     $DEEPSPEED_CONFIG, configs/ds/zero3.json
#   --dry_run_command           print the accelerate command and exit
#
# Example, two nodes of 8 GPUs (run on each node with its rank):
#   scripts/launch_multinode.sh --num_machines 2 --machine_rank 0 --main_process_ip node1 \
#       --processes_per_machine 8 -- --model_name_or_path M --dataset_mixer_list data.jsonl 1.0 --output_dir out
#
# Signals: SIGUSR1/SIGTERM/SIGINT sent to this script go to the training processes (torchrun's workers),
# which checkpoint and exit (finetune.py: code 75). The launcher ignores SIGUSR1, so a SLURM
# `--signal=USR1@N` warning cannot kill it before the workers have saved (SIGUSR1 in PET_SIGNALS_TO_HANDLE, which
# would have torchrun handle it and kill the workers 30 s later, is dropped from it with a line saying so). If the run ends non-zero
# after such a signal, this script exits 75 too: "preempted, resume from the newest checkpoint".
#
# Output: the run's own closing line (an error, the stop after a signal) comes last, after torchrun's summary.
# Without OMP_NUM_THREADS set, each process's share of this node's cores is exported as it (what open_sft would
# give each rank anyway), so torchrun does not set 1 and say so in a banner.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/_proc.sh
source "$ROOT/scripts/_proc.sh"  # children_of

die() { echo "launch_multinode.sh: $*" >&2; exit 2; }

first_slurm_host() {
    if [ -n "${SLURM_JOB_NODELIST:-}" ] && command -v scontrol >/dev/null 2>&1; then
        scontrol show hostnames "$SLURM_JOB_NODELIST" | awk "NR == 1"
    fi
}

local_gpu_count() {
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi --list-gpus 2>/dev/null | grep -c '^GPU' || true
    fi
}

num_machines="${NUM_MACHINES:-${NNODES:-${SLURM_NNODES:-1}}}"
machine_rank="${MACHINE_RANK:-${NODE_RANK:-${SLURM_NODEID:-0}}}"
main_ip="${MAIN_PROCESS_IP:-${MASTER_ADDR:-}}"
main_port="${MAIN_PROCESS_PORT:-${MASTER_PORT:-29500}}"
per_machine="${PROCESSES_PER_MACHINE:-${SLURM_GPUS_ON_NODE:-}}"
ds_config="${DEEPSPEED_CONFIG:-$ROOT/configs/ds/zero3.json}"
print_only=0
total_processes=""

while [ $# -gt 0 ]; do
    case "$1" in
        --num_machines) num_machines="${2:?}"; shift 2 ;;
        --machine_rank) machine_rank="${2:?}"; shift 2 ;;
        --main_process_ip) main_ip="${2:?}"; shift 2 ;;
        --main_process_port) main_port="${2:?}"; shift 2 ;;
        --processes_per_machine) per_machine="${2:?}"; shift 2 ;;
        --num_processes) total_processes="${2:?}"; shift 2 ;;
        --deepspeed_config) ds_config="${2:?}"; shift 2 ;;
        --dry_run_command) print_only=1; shift ;;
        --) shift; break ;;
        *) break ;;
    esac
done

[ -n "$main_ip" ] || main_ip="$(first_slurm_host)"
[ -n "$main_ip" ] || main_ip="127.0.0.1"
for pair in "num_machines:$num_machines" "machine_rank:$machine_rank" "main_process_port:$main_port" \
            "num_processes:${total_processes:-0}"; do
    [[ "${pair#*:}" =~ ^[0-9]+$ ]] || die "--${pair%%:*} must be a non-negative integer, got '${pair#*:}'"
done
if [ -n "$total_processes" ]; then
    [ "$num_machines" -gt 0 ] && [ $((total_processes % num_machines)) = 0 ] && [ "$total_processes" -gt 0 ] \
        || die "--num_processes $total_processes must be a positive multiple of --num_machines $num_machines"
    per_machine=$((total_processes / num_machines))
fi
[ -n "$per_machine" ] || per_machine="$(local_gpu_count)"
[ -n "$per_machine" ] && [ "$per_machine" != "0" ] || per_machine=1
per_machine="${per_machine%%(*}"  # SLURM_GPUS_ON_NODE may read like "8(IDX:0-7)" on some sites
[[ "$per_machine" =~ ^[0-9]+$ ]] || die "--processes_per_machine must be a non-negative integer, got '$per_machine'"
[ "$machine_rank" -lt "$num_machines" ] || die "--machine_rank $machine_rank must be below --num_machines $num_machines"
[ -f "$ds_config" ] || die "DeepSpeed config '$ds_config' not found (see configs/ds/)"

cmd=(accelerate launch
     --num_machines "$num_machines" --machine_rank "$machine_rank"
     --main_process_ip "$main_ip" --main_process_port "$main_port"
     --num_processes "$((num_machines * per_machine))"
     --use_deepspeed --deepspeed_config_file "$ds_config"
     --deepspeed_multinode_launcher standard --rdzv_backend static --same_network
     --mixed_precision no --dynamo_backend no
     "$ROOT/finetune.py" "$@")

if [ "$print_only" = 1 ]; then
    printf '%q ' "${cmd[@]}"; echo
    exit 0
fi
echo "[launch_multinode] machine $machine_rank/$num_machines, $per_machine process(es) here, main $main_ip:$main_port" >&2
if [ -z "${OMP_NUM_THREADS:-}" ] && [ "$per_machine" -gt 1 ]; then
    # shellcheck disable=SC2015  # a failed look-up leaves it unset: torchrun's default and banner, as before
    OMP_NUM_THREADS="$(cd "$ROOT" && python -c "from open_sft.distributed.env import threads_per_rank
print(threads_per_rank($per_machine))")" && export OMP_NUM_THREADS || unset OMP_NUM_THREADS
fi

# torchrun handles the signals of PET_SIGNALS_TO_HANDLE (accelerate launch passes no --signals_to_handle): with SIGUSR1
# among them it would take SIGUSR1 back from the `trap ''` below, forward it and SIGKILL the workers 30 s later, in
# the middle of their checkpoint. This script forwards SIGUSR1 itself, so it is dropped from that list.
if [[ ",${PET_SIGNALS_TO_HANDLE:-}," =~ ,[[:space:]]*SIGUSR1[[:space:]]*, ]]; then
    kept=""
    IFS=, read -ra handled <<< "$PET_SIGNALS_TO_HANDLE"
    for name in "${handled[@]}"; do
        [[ "$name" =~ ^[[:space:]]*SIGUSR1[[:space:]]*$ ]] || kept="${kept:+$kept,}$name"
    done
    now="${kept:-unset: torchrun default}"
    echo "[launch_multinode] PET_SIGNALS_TO_HANDLE=$PET_SIGNALS_TO_HANDLE: SIGUSR1 dropped (now $now); this script" \
         "forwards SIGUSR1 to the workers itself, where torchrun would kill them 30 s after it, before their" \
         "checkpoint is written" >&2
    if [ -n "$kept" ]; then export PET_SIGNALS_TO_HANDLE="$kept"; else unset PET_SIGNALS_TO_HANDLE; fi
fi

PREEMPTED_EXIT_CODE=75
stop_requested=0
# torchrun exits 1 whatever its workers' codes; each rank leaves its own here (2 bad input, 3 Hub, 75 preempted)
OPEN_SFT_EXIT_CODE_DIR="$(mktemp -d "${TMPDIR:-/tmp}/open_sft_exit.XXXXXX")"
export OPEN_SFT_EXIT_CODE_DIR
( trap '' USR1; exec "${cmd[@]}" ) &  # ignored signals stay ignored across exec
launcher=$!

# shellcheck disable=SC2317,SC2086  # called from traps; $workers is a list of pids
forward() {  # torchrun's workers are the launcher's children; the launcher itself keeps supervising
    local workers
    workers="$(children_of "$launcher" | tr "\n" " ")"
    stop_requested=1
    echo "[launch_multinode] got SIG$1, forwarding to ${workers:-no workers yet}" >&2
    [ -z "$workers" ] || kill -s "$1" $workers 2>/dev/null || true
}
trap 'forward USR1' USR1
trap 'forward TERM' TERM
trap 'forward INT' INT

status=0
while true; do
    wait "$launcher" && status=0 || status=$?
    kill -0 "$launcher" 2>/dev/null || break  # a trapped signal interrupted `wait`: keep waiting
done
rank_code="$(cat "$OPEN_SFT_EXIT_CODE_DIR"/rank*[0-9] 2>/dev/null | grep -v '^0$' | sort -n | tail -1 || true)"
closing=""  # a rank's closing line (rankR.message; ranks say the same, or each names the peer it lost)
for file in "$OPEN_SFT_EXIT_CODE_DIR"/rank*.message; do
    [ -f "$file" ] && closing="$(cat "$file")" && break
done
rm -rf "$OPEN_SFT_EXIT_CODE_DIR"
if [ "$status" != 0 ] && [ "$stop_requested" = 1 ]; then
    echo "[launch_multinode] stopped on a signal (launcher exit $status): exiting $PREEMPTED_EXIT_CODE" >&2
    status="$PREEMPTED_EXIT_CODE"
elif [ "$status" != 0 ] && [ -n "$rank_code" ]; then
    status="$rank_code"  # the workers' own code (the highest, when ranks differ), not torchrun's 1
fi
[ "$status" = 0 ] || [ -z "$closing" ] || echo "$closing" >&2  # after torchrun's summary: what the run said, last
exit "$status"
