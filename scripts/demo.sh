#!/usr/bin/env bash
# Demo from a fresh clone: install, build the embedded default (tiny Llama + BPE tokenizer made
# offline from the bundled sample data), fine-tune it with `accelerate launch` on 2 CPU processes
# under DeepSpeed ZeRO-2, then print where the model is and generations from it.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
WORK="${DEMO_DIR:-.demo}"
mkdir -p "$WORK"

echo "[demo] building the embedded default model and tokenizer in $WORK/base"
python -m open_sft embedded "$WORK/base" --hidden_size 128 --num_layers 4 --num_heads 4 --num_kv_heads 2 >/dev/null

echo "[demo] fine-tuning on the bundled sample with 2 processes under ZeRO-2"
accelerate launch --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no \
    --use_deepspeed --deepspeed_config_file configs/ds/zero2.json \
    finetune.py \
    --model_name_or_path "$WORK/base" \
    --dataset_mixer_list open_sft/embedded/data/sample.jsonl 1.0 \
    --output_dir "$WORK/output" \
    --per_device_train_batch_size 16 --gradient_accumulation_steps 1 \
    --num_train_epochs "${DEMO_EPOCHS:-4}" --learning_rate 3e-3 --warmup_ratio 0.05 \
    --lr_scheduler_type cosine --max_seq_length 256 --logging_steps 25 --seed 42 \
    --overwrite_output_dir  # a demo trains each time it runs (a finished run is otherwise left as it is)

echo "[demo] model written to $(cd "$WORK/output" && pwd)"
python -m open_sft generate "$WORK/output" \
    --prompt "What is 12 plus 7?" --prompt "Reverse the word planet." --prompt "Convert 3 km to m." \
    --score_sample 100
