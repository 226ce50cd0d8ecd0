#!/usr/bin/env bash
# Build the image from docker/Dockerfile and check, in real containers, what a cluster job relies on: the
# help, a 2-rank DeepSpeed ZeRO-2 training job as the image's non-root user with data, output and cache on
# mounted volumes, output readable by the host user, SIGTERM → checkpoint + exit 75 → the same command resumes
# to the uninterrupted run's final loss, --push_to_hub to a Hub on loopback with HF_TOKEN from the environment
# (the token in no output file and no log line), an unreadable mounted model named as such, and the demo run as
# another uid (`--user`) without a /cache volume.
# Not part of ./scripts/test.sh: it needs a container engine (and usually root).
#
#   scripts/test_container.sh [BASE_IMAGE]        BASE_IMAGE: any image with python, pip and torch
#                                                 (default: the Dockerfile's CUDA PyTorch image)
#   CONTAINER=docker            the engine command; `build ...` and `run ...` are passed as docker spells them,
#                               e.g. CONTAINER=podman
#   OPEN_SFT_EXTRAS=...         the build's extras (default: the Dockerfile's)
#   KEEP=1                      keep the work directory (data, outputs, logs) and print where it is
#
# Prints one PASS/FAIL line per check and exits non-zero if any failed.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CONTAINER="${CONTAINER:-docker}"
BASE="${1:-$(sed -n 's/^ARG BASE_IMAGE=//p' "$ROOT/docker/Dockerfile")}"
IMAGE="open_sft:container-test"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/open_sft_container.XXXXXX")"
LOGS="$WORK/logs"
TOKEN="hf_containercheck$(od -An -N8 -tx1 /dev/urandom | tr -d ' \n')"
failures=0

# The container runs as uid 1000, which may not be the host user: the work directories are open to it, as a
# cluster's shared output directory would be. What the job writes must come back readable by everyone.
mkdir -p "$LOGS" "$WORK"/{data,out,cache,hub}
chmod 755 "$WORK" && chmod 777 "$WORK"/{data,out,cache,hub}
cleanup() { if [ "${KEEP:-0}" = 1 ]; then echo "work directory kept: $WORK"; else rm -rf "$WORK" 2>/dev/null; fi; }
trap cleanup EXIT

result() {  # NAME STATUS DETAIL
    if [ "$2" = 0 ]; then echo "PASS  $1${3:+: $3}"; else echo "FAIL  $1${3:+: $3}"; failures=$((failures + 1)); fi
}
run() { "$CONTAINER" run --rm "$@"; }
volumes=(-v "$WORK/data:/data:ro" -v "$WORK/out:/out" -v "$WORK/cache:/cache")
final_loss() { grep '"loss"' "$1" | tail -1 | sed 's/.*"loss": *\([-0-9.eE+]*\).*/\1/'; }
same_loss() { awk -v a="$1" -v b="$2" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(a != "" && d <= 1e-6 * (a < 0 ? -a : a)) }'; }
# shellcheck source=scripts/_proc.sh
source "$ROOT/scripts/_proc.sh"  # children_of
descendant_leaf() {  # the engine's client under a wrapper script: the signal must reach the process that proxies it
    local pid="$1" child
    while child="$(children_of "$pid" | head -1)"; [ -n "$child" ]; do
        pid="$child"
    done
    echo "$pid"
}

# --- build -------------------------------------------------------------------------------------------------
extras=()
[ -n "${OPEN_SFT_EXTRAS+x}" ] && extras=(--build-arg "OPEN_SFT_EXTRAS=$OPEN_SFT_EXTRAS")
started=$SECONDS
"$CONTAINER" build -f "$ROOT/docker/Dockerfile" -t "$IMAGE" --build-arg "BASE_IMAGE=$BASE" "${extras[@]}" "$ROOT" \
    > "$LOGS/build.log" 2>&1
status=$?
result "build on $BASE" "$status" "$((SECONDS - started)) s (log: $LOGS/build.log)"
if [ "$status" != 0 ]; then tail -20 "$LOGS/build.log"; KEEP=1; exit 1; fi

size() { run --user 0 --entrypoint du "$1" -sx --block-size=1M / 2>/dev/null | awk '{print $1}'; }
image_mb="$(size "$IMAGE")" base_mb="$(size "$BASE")"
echo "INFO  image size ${image_mb:-?} MiB on disk, of which the base ${base_mb:-?} MiB: open_sft adds $((${image_mb:-0} - ${base_mb:-0})) MiB"

# A code change rebuilds the source layers only: the dependency layer (torch, DeepSpeed, ...) comes from the cache.
context="$WORK/context"
mkdir -p "$context" && tar -C "$ROOT" --exclude=.venv --exclude=.git --exclude=output -cf - . | tar -C "$context" -xf -
echo "# a code change" >> "$context/open_sft/run.py"
started=$SECONDS
"$CONTAINER" build -f "$context/docker/Dockerfile" -t "$IMAGE-rebuild" --build-arg "BASE_IMAGE=$BASE" "${extras[@]}" \
    "$context" > "$LOGS/rebuild.log" 2>&1
status=$?
deps_cached=1
awk '/pip install --no-cache-dir "\.\/\$\{OPEN_SFT_EXTRAS/ { found = 1; next } found && NF { exit !/Using cache|CACHED/ }' \
    "$LOGS/rebuild.log" && deps_cached=0
result "a code change reuses the dependency layer" "$((status || deps_cached))" "rebuild $((SECONDS - started)) s"

# --- help and user -------------------------------------------------------------------------------------------
help="$(run "$IMAGE" --help 2>&1)"
echo "$help" > "$LOGS/help.log"
grep -q -- "--dataset_mixer_list" <<< "$help"
result "--help lists finetune.py's flags" $?
uid="$(run "$IMAGE" id -u 2>/dev/null)"
[ -n "$uid" ] && [ "$uid" != 0 ]
result "runs as a non-root user" $? "uid ${uid:-?}"

# --- a training job ------------------------------------------------------------------------------------------
run -v "$WORK/data:/data" "$IMAGE" bash -c 'python -m open_sft embedded /data/base --hidden_size 64 --num_layers 2 \
        --num_heads 4 --num_kv_heads 2 && cp /opt/open_sft/open_sft/embedded/data/sample.jsonl /data/train.jsonl' \
    > "$LOGS/setup.log" 2>&1 || { echo "FAIL  could not make the test model"; tail "$LOGS/setup.log"; exit 1; }

# Launch options first (2 processes: no GPU here, so the launcher's default would be 1), then finetune.py's flags.
job=(--num_processes 2 --deepspeed_config /opt/open_sft/configs/ds/zero2.json
     --model_name_or_path /data/base --dataset_mixer_list /data/train.jsonl 1.0 --max_train_steps 200
     --per_device_train_batch_size 4 --learning_rate 3e-3 --warmup_ratio 0.05 --logging_steps 1
     --max_seq_length 128 --checkpointing_steps 50 --seed 1 --torch_dtype float32)
started=$SECONDS
run "${volumes[@]}" "$IMAGE" "${job[@]}" --output_dir /out/full > "$LOGS/train.log" 2>&1
status=$?
uninterrupted="$(final_loss "$WORK/out/full/metrics.jsonl" 2>/dev/null)"
[ "$status" = 0 ] && [ -f "$WORK/out/full/model.safetensors" ] && grep -q '"world_size": 2' "$WORK/out/full/run.json" \
    && grep -q '"distributed_type": "DEEPSPEED"' "$WORK/out/full/run.json"
result "2 ranks under ZeRO-2 train and export" $? "exit $status, $((SECONDS - started)) s, final loss ${uninterrupted:-none}"

# --- preemption: SIGTERM to the container, then the same command again ----------------------------------------
run "${volumes[@]}" "$IMAGE" "${job[@]}" --output_dir /out/preempted > "$LOGS/preempted.log" 2>&1 &
launcher=$!
for _ in $(seq 1 600); do
    logged="$(grep -c '"loss"' "$WORK/out/preempted/metrics.jsonl" 2>/dev/null)"
    [ "${logged:-0}" -ge 5 ] && break
    kill -0 "$launcher" 2>/dev/null || break
    sleep 0.2
done
kill -TERM "$(descendant_leaf "$launcher")" 2>/dev/null
wait "$launcher"
stopped=$?
saved="$(ls -d "$WORK"/out/preempted/checkpoints/step_* 2>/dev/null | head -1)"
[ "$stopped" = 75 ] && [ -n "$saved" ] && [ -f "$saved/COMPLETE" ]
result "SIGTERM → checkpoint and exit 75" $? "exit $stopped, ${saved:+saved ${saved##*/}}"
run "${volumes[@]}" "$IMAGE" "${job[@]}" --output_dir /out/preempted > "$LOGS/resumed.log" 2>&1
status=$?
resumed="$(final_loss "$WORK/out/preempted/metrics.jsonl" 2>/dev/null)"
[ "$status" = 0 ] && grep -qi "resum" "$LOGS/resumed.log" && same_loss "$uninterrupted" "$resumed"
result "the same command resumes to the uninterrupted final loss" $? \
    "exit $status, final loss ${resumed:-none} vs ${uninterrupted:-none}"
grep -q "tokenized data loaded from cache" "$LOGS/resumed.log"
result "the tokenization cache on the /cache volume is reused" $?

# --- push to a Hub on loopback, the token from the environment ----------------------------------------------
port=$((20000 + RANDOM % 20000))
run "${volumes[@]}" -v "$ROOT/tests/hub_server.py:/hub_server.py:ro" -v "$WORK/hub:/hub" -e HF_TOKEN="$TOKEN" \
    -e HF_ENDPOINT="http://127.0.0.1:$port" --entrypoint bash "$IMAGE" -c \
    'python /hub_server.py --port '"$port"' --dump /hub & for _ in $(seq 100); do python -c "import socket; \
     socket.create_connection((\"127.0.0.1\", '"$port"'))" 2>/dev/null && break; sleep 0.1; done; \
     exec open_sft-entrypoint "$@"' push "${job[@]}" --max_train_steps 10 --output_dir /out/pushed --push_to_hub \
    --hub_model_id org/container-check > "$LOGS/push.log" 2>&1
status=$?
pushed="$WORK/hub/org/container-check/main"
[ "$status" = 0 ] && [ -f "$pushed/model.safetensors" ] && [ -f "$pushed/config.json" ]
result "--push_to_hub uploads the model with HF_TOKEN from the environment" $? "exit $status"
leaks="$(grep -rl -- "$TOKEN" "$WORK/out" "$WORK/hub" "$LOGS" 2>/dev/null)"
[ -z "$leaks" ]
result "the token is in no output file, pushed file or log line" $? "${leaks:+found in $leaks}"

# --- an input the container's user cannot read --------------------------------------------------------------
cp -r "$WORK/data/base" "$WORK/locked_model"
chmod 755 "$WORK/locked_model"
if [ "$(id -u)" = 0 ]; then chmod 600 "$WORK/locked_model/model.safetensors"; else chmod 000 "$WORK/locked_model/model.safetensors"; fi
run "${volumes[@]}" -v "$WORK/locked_model:/locked:ro" "$IMAGE" "${job[@]}" --model_name_or_path /locked \
    --output_dir /out/locked > "$LOGS/unreadable.log" 2>&1
status=$?
[ "$status" = 2 ] && grep -q "/locked/model.safetensors cannot be read by this user" "$LOGS/unreadable.log" \
    && [ ! -e "$WORK/out/locked" ]
result "an unreadable mounted model is named as such" $? "exit $status: $(grep -m1 'cannot be read' "$LOGS/unreadable.log" | head -c 160)"

# --- the demo, as a cluster runs it: another uid (--user), no /cache mounted ----------------------------------
# Its home is not writable and /cache is the volume the engine makes: every cache must land there, with no warning.
started=$SECONDS
run --user 4321:4321 -e DEMO_DIR=/out/demo -v "$WORK/out:/out" "$IMAGE" /opt/open_sft/scripts/demo.sh \
    > "$LOGS/demo.log" 2>&1
status=$?
accuracy="$(grep -m1 "exact-answer accuracy" "$LOGS/demo.log" | sed 's/.*-> after //')"
[ "$status" = 0 ] && [[ "$accuracy" =~ ^(0\.9|1\.0) ]] && ! grep -qiE "permission denied|MPLCONFIGDIR" "$LOGS/demo.log"
result "the demo as uid 4321 with no /cache mounted" $? "exit $status, $((SECONDS - started)) s, accuracy after ${accuracy:-?}"

# --- what the jobs wrote, as the host user sees it -----------------------------------------------------------
unreadable="$(find "$WORK/out" "$WORK/cache" \( -type f ! -perm -0444 \) -o \( -type d ! -perm -0555 \) 2>/dev/null)"
[ "$(id -u)" = 0 ] || unreadable+="$(find "$WORK/out" "$WORK/cache" ! -readable 2>/dev/null)"
files="$(find "$WORK/out" "$WORK/cache" -type f | wc -l)"
[ -z "$unreadable" ] && [ "$files" -gt 0 ]
result "every file the jobs wrote (outputs, checkpoints, cache) is readable by the host user" $? "$files files${unreadable:+; not readable: $(echo $unreadable | head -c 300)}"

if [ "$failures" != 0 ]; then
    KEEP=1
    echo "$failures check(s) failed; logs in $LOGS"
    exit 1
fi
echo "all checks passed"
