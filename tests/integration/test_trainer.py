"""The training loop: the non-finite guard skips and counts bad steps (in-process, and under ZeRO-2/3 and DDP with
2 real ranks), and eval_loss is the token-weighted mean a direct computation gives.

(Its fast in-process tests are in tests/unit/training/test_trainer.py.)
"""

from __future__ import annotations

import glob
import json
import math
import os
import subprocess

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, SAMPLE, child_env, launch_command, read_metrics


POISONED_FINETUNE = """
import os, sys
from open_sft.model import loss
from open_sft import run
poison = {int(c) for c in os.environ["POISON_CALLS"].split(",")} if os.environ["RANK"] == "1" else set()
forward, calls = loss.TokenLossModel.forward, [0]
def poisoned(self, **batch):
    out = forward(self, **batch)
    calls[0] += 1
    if calls[0] - 1 not in poison:
        return out
    # POISON_VALUE_ONLY: the loss's value NaN, its gradient finite (only the loss check sees it); else both NaN
    return out + float("nan") if os.environ.get("POISON_VALUE_ONLY") else out * float("nan")
loss.TokenLossModel.forward = poisoned
sys.exit(run.main())
"""


def saved_tensors(checkpoint) -> dict[str, torch.Tensor]:
    """Every tensor a checkpoint holds: DeepSpeed's (all ranks: weights, fp32 master partitions, Adam state) or
    accelerate's (the weights and the optimizer's state, whose Adam step counts are tensors)."""
    def walk(obj, prefix):
        if isinstance(obj, torch.Tensor):
            yield prefix, obj
        elif isinstance(obj, dict):
            for key, value in obj.items():
                yield from walk(value, f"{prefix}/{key}")
        elif isinstance(obj, (list, tuple)):
            for i, value in enumerate(obj):
                yield from walk(value, f"{prefix}/{i}")
    found = {}
    for path in sorted(glob.glob(str(checkpoint / "pytorch_model" / "*.pt")) + [str(checkpoint / "optimizer.bin")]):
        if os.path.exists(path):
            found.update(walk(torch.load(path, map_location="cpu", weights_only=False), os.path.basename(path)))
    if (checkpoint / "model.safetensors").exists():
        found.update(walk(load_file(checkpoint / "model.safetensors"), "model.safetensors"))
    return found


@pytest.mark.parametrize("ds_config", ["zero2.json", "zero3.json", None], ids=["zero2", "zero3", "ddp"])
def test_nan_step_is_skipped_on_every_rank(tiny_model_dir, tmp_path, ds_config) -> None:
    """2 ranks, fp32: a NaN on one micro-batch of rank 1 at steps 2, 4 and 5. DeepSpeed (on its own verdict) or,
    under DDP, the fused AdamW (on the verdict the ranks agree on the device, read by no host before the step)
    skips each such step on every rank (under DDP a NaN of the loss's value only, its gradient finite: rank 0 sees
    a finite loss and gradient norm and skips on rank 1's word), so the checkpoint after it equals the one before it tensor for tensor
    (weights, fp32 master partitions, exp_avg, exp_avg_sq, Adam step count); step 3 trains; the second NaN in a row
    aborts."""
    script = tmp_path / "poisoned_finetune.py"
    script.write_text(POISONED_FINETUNE)
    out = tmp_path / "out"
    args = ["--model_name_or_path", str(tiny_model_dir), "--dataset_mixer_list", str(SAMPLE), "1.0",
            "--output_dir", str(out), "--max_train_steps", "5", "--per_device_train_batch_size", "2",
            "--gradient_accumulation_steps", "2", "--learning_rate", "3e-3", "--logging_steps", "1", "--seed", "1",
            "--torch_dtype", "float32", "--max_seq_length", "256", "--max_nonfinite_steps", "2",
            "--checkpointing_steps", "1", "--keep_last_n_checkpoints", "10"]
    # 2 micro-batches per step: the second micro-batch of steps 2, 4 and 5 is forward call 3, 7, 9.
    result = subprocess.run(launch_command(2, ds_config)[:-1] + [str(script)] + args, cwd=ROOT,
                            env=child_env(POISON_CALLS="3,7,9", **({} if ds_config else {"POISON_VALUE_ONLY": "1"})), capture_output=True, text=True, timeout=600)
    assert result.returncode != 0
    assert ("2 optimizer steps in a row had a non-finite loss or gradient (last at step 5)"
            in result.stdout + result.stderr), result.stderr[-4000:]
    # every rank skips the step alike, and rank 0 says so, once
    assert (result.stdout + result.stderr).count("step 2: non-finite loss or gradient; the update was skipped") == 1

    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]  # step 5 aborted before it was logged
    assert [m["nonfinite_steps"] for m in metrics] == [0, 1, 1, 2]
    assert math.isfinite(metrics[0]["loss"]) and math.isfinite(metrics[2]["loss"])
    assert math.isnan(metrics[1]["loss"]) and math.isnan(metrics[3]["loss"])  # windows of skipped steps only
    assert [m["learning_rate"] for m in metrics] == pytest.approx([3e-3, 3e-3, 2.25e-3, 1.5e-3])  # schedule by step

    counters = [json.loads((out / "checkpoints" / f"step_{step}" / "trainer_state.json").read_text())
                for step in (1, 2, 3, 4)]  # a resumed run continues the counts (and the in-a-row abort)
    assert [(c["nonfinite_steps"], c["nonfinite_in_a_row"]) for c in counters] == [(0, 0), (1, 1), (1, 0), (2, 1)]
    state = {step: saved_tensors(out / "checkpoints" / f"step_{step}") for step in (1, 2, 3, 4)}
    if ds_config is not None:
        assert sum("optim_states" in key and "exp_avg_sq" in key for key in state[1]) >= 2  # both ranks' Adam state
    else:
        assert "optimizer.bin/state/0/exp_avg_sq" in state[1] and "optimizer.bin/state/0/step" in state[1]
    for before, after, changes in ((1, 2, False), (2, 3, True), (3, 4, False)):
        assert state[before].keys() == state[after].keys()
        changed = [key for key in state[before] if not torch.equal(state[before][key], state[after][key])]
        if changes and ds_config is not None:  # every rank's optimizer partition moved on the good step
            assert {key.split("/")[0] for key in changed} >= {
                os.path.basename(p) for p in glob.glob(str(out / "checkpoints/step_3/pytorch_model/*optim*"))}
        elif changes:  # the weights, the moments and the step count moved on the good step
            assert {"model.safetensors", "optimizer.bin"} == {key.split("/")[0] for key in changed}
            assert "optimizer.bin/state/0/step" in changed
        else:
            assert changed == [], (before, after, changed[:5])
