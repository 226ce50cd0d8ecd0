#!/usr/bin/env bash
# Demo from a fresh clone: install, build the embedded default (a tiny Llama + BPE tokenizer made offline
# from the demo's bundled tasks), fine-tune it with `accelerate launch` on 2 CPU processes under DeepSpeed
# ZeRO-2, then answer held-out tasks (combinations never seen in training) with the model before and after
# fine-tuning, side by side, with the exact-answer accuracy of both; last, where everything is.
# The tasks: open_sft/embedded/demo_tasks.py. DEMO_DIR (default .demo) holds the models and scores.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
WORK="${DEMO_DIR:-.demo}"
TRAIN=open_sft/embedded/data/demo_train.jsonl
HELD_OUT=open_sft/embedded/data/demo_held_out.jsonl
mkdir -p "$WORK"
START=$SECONDS

echo "[demo] building the embedded model and its tokenizer (trained on the demo's tasks) in $WORK/base"
# One thread for the single-process steps: the model is tiny, and a second thread only waits (on a busy
# machine, 5x slower scoring measured).
OMP_NUM_THREADS=1 python -m open_sft.embedded.demo_tasks base "$WORK/base" >/dev/null

# A rerun trains again (--overwrite_output_dir); the earlier run's TensorBoard events would show beside its own.
rm -rf "$WORK/output/tensorboard"
echo "[demo] fine-tuning it on $TRAIN (configs/examples/demo.yaml) with 2 processes under DeepSpeed ZeRO-2"
accelerate launch --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no \
    --use_deepspeed --deepspeed_config_file configs/ds/zero2.json \
    finetune.py configs/examples/demo.yaml \
    --model_name_or_path "$WORK/base" --output_dir "$WORK/output" --overwrite_output_dir \
    --with_tracking --report_to tensorboard

echo "[demo] the same held-out tasks ($HELD_OUT), answered before and after fine-tuning"
OMP_NUM_THREADS=1 python -m open_sft compare "$WORK/base" "$WORK/output" --tasks "$HELD_OUT" --json "$WORK/held_out_scores.json"

OUT="$(cd "$WORK/output" && pwd)"
cat <<EOF

[demo] done in $((SECONDS - START)) s. Where things are:
  model (safetensors, tokenizer, chat template)  $OUT
  training report and loss plot                  $OUT/report/summary.md, $OUT/report/loss.png
  every held-out answer, before and after        $(cd "$WORK" && pwd)/held_out_scores.json
  TensorBoard                                    tensorboard --logdir $OUT/tensorboard
  chat with the model                            open_sft chat $OUT
  one answer                                     open_sft generate $OUT --prompt "Translate to French: red bird"
  push it to the Hugging Face Hub                open_sft push $OUT --hub_model_id YOUR_NAME/open-sft-demo
EOF
[ "$VENV" = none ] || echo "(open_sft is in $VENV/bin: source $VENV/bin/activate first)"
