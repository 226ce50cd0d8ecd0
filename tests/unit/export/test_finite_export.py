"""A run whose weights hold NaN or inf after training is not exported nor marked complete: `--learning_rate inf`
broke the weights in step 1's update, step 2's non-finite loss was skipped (below --max_nonfinite_steps), and the
NaN model was exported with exit 0 and RUN_COMPLETE."""

from __future__ import annotations

import json

import pytest
import torch

from open_sft.errors import UserError
from open_sft.export.save import finite_state_dict


class _Engine:
    def __init__(self, state_dict):
        self.state_dict, self.fp32 = state_dict, None

    def full_state_dict(self, fp32=False):
        self.fp32 = fp32
        return self.state_dict


def test_a_state_dict_with_nan_or_inf_is_refused_naming_the_tensors() -> None:
    weights = {"a.weight": torch.ones(2), "b.weight": torch.tensor([1.0, float("nan")]),
               "c.weight": torch.tensor([float("inf")], dtype=torch.bfloat16), "steps": torch.tensor([3])}
    with pytest.raises(UserError) as refused:
        finite_state_dict(_Engine(weights), fp32=True, is_main=True)
    assert "the trained model's 2 of 4 weight tensors (b.weight, c.weight) hold NaN or inf: nothing was exported" \
        in str(refused.value)
    assert "--resume_from_checkpoint" in str(refused.value) and "--learning_rate" in str(refused.value)
    finite = _Engine({"a.weight": torch.ones(2), "steps": torch.tensor([3])})
    assert finite_state_dict(finite, fp32=True, is_main=True) is finite.state_dict and finite.fp32 is True
    # a rank that holds no gathered weights takes the main process's verdict (one process: its own, none)
    assert finite_state_dict(_Engine({}), fp32=False, is_main=False) == {}


def test_a_run_whose_update_broke_the_weights_exits_2_without_export_or_completion(tiny_model_dir, tmp_path,
                                                                                   monkeypatch, capsys) -> None:
    from conftest import SAMPLE
    from open_sft import run

    monkeypatch.setattr("open_sft.training.trainer.lr_multiplier", lambda *args: float("inf"))  # lr inf
    out = tmp_path / "out"
    argv = ["--model_name_or_path", str(tiny_model_dir), "--dataset_mixer_list", str(SAMPLE), "8",
            "--max_train_steps", "2", "--checkpointing_steps", "1", "--torch_dtype", "float32",
            "--per_device_train_batch_size", "4", "--max_seq_length", "128", "--report_to", "none",
            "--output_dir", str(out), "--dataset_local_cache_dir", str(tmp_path / "cache")]
    assert run.main(argv) == 2
    assert "hold NaN or inf: nothing was exported and the run is not marked complete" in capsys.readouterr().err
    assert not (out / "RUN_COMPLETE").exists() and not list(out.glob("*.safetensors"))
    assert json.loads((out / "checkpoints" / "step_1" / "COMPLETE").read_text()) is not None  # checkpoints kept
