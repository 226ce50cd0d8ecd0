"""open-instruct users' command lines and train configs run unchanged.

OPEN_INSTRUCT_FLAGS is every field of open-instruct's FlatArguments (open_instruct/finetune.py) and
TokenizerConfig (open_instruct/dataset_transformation.py) at commit e6c3044aa6201c8bfa4573c1b03142af599e730d,
extracted by name, plus the fields of older versions that are still pasted (add_seed_and_date_to_exp_name,
overwrite_output_dir, reduce_loss, run_name, train_file, use_flash_attn).

(Its fast in-process tests are in tests/unit/config/test_open_instruct_compat.py.)
"""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from conftest import FINETUNE, ROOT, SAMPLE, child_env, read_metrics


def test_an_open_instruct_command_line_trains(tiny_model_dir, tmp_path) -> None:
    """open-instruct's scripts/train/debug/finetune.sh, flags as written, model and data local; 4 steps with the
    8-bit optimizer, --add_bos and the tulu template, then the same with --dry_run."""
    out = tmp_path / "out"
    args = [str(FINETUNE), "--model_name_or_path", str(tiny_model_dir), "--tokenizer_name", str(tiny_model_dir),
            "--max_seq_length", "256", "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "4",
            "--learning_rate", "5e-04", "--lr_scheduler_type", "linear", "--warmup_ratio", "0.03",
            "--weight_decay", "0.0", "--num_train_epochs", "2", "--report_to", "tensorboard", "--logging_steps", "1",
            "--model_revision", "main", "--dataset_mixer_list", str(SAMPLE), "100", "--add_bos", "--seed", "123",
            "--chat_template_name", "tulu", "--with_tracking", "--max_train_steps", "4", "--use_8bit_optimizer",
            "--exp_name", "debug_sft", "--use_slow_tokenizer", "--keep_last_n_checkpoints", "-1",
            "--checkpointing_steps", "2", "--clean_checkpoints_at_end", "--output_dir", str(out)]
    result = subprocess.run([sys.executable, *args], cwd=ROOT, env=child_env(), capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    losses = [m["loss"] for m in read_metrics(out)]
    assert len(losses) == 4 and all(loss == loss for loss in losses)
    run = json.loads((out / "run.json").read_text())
    assert run["optimizer"]["class"].endswith("AdamW8bit")
    assert run["args"]["data"]["add_bos"] and not (out / "checkpoints").exists()
    assert "accepted and ignored: --use_slow_tokenizer" in result.stdout
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text.startswith(tokenizer.bos_token + "<|user|>\n")
    dry = subprocess.run([sys.executable, *args[:-1], str(tmp_path / "dry"), "--dry_run"], cwd=ROOT,
                         env=child_env(), capture_output=True, text=True, timeout=600)
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert "time estimate:" in dry.stdout and not (tmp_path / "dry").exists()
    assert torch.isfinite(torch.tensor(losses)).all()
