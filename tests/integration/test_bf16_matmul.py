"""bf16 matmuls on fp32 kernels (CPUs without native bf16): the same numerics as bf16 autocast, chosen
when the probe measures bf16 slower, or forced with OPEN_SFT_BF16_MATMULS.

(Its fast in-process tests are in tests/unit/model/test_bf16_matmul.py.)
"""

from __future__ import annotations

import json

from open_sft.model import bf16_matmul
from conftest import read_metrics, run_finetune
from integration.test_e2e import common_args


def test_training_via_fp32_kernels_tracks_native_bf16(tiny_model_dir, tmp_path, monkeypatch) -> None:
    """Through finetune.py: the same run with native bf16 matmuls and on fp32 kernels, loss for loss."""
    losses = {}
    for mode in ("native", "fp32"):
        monkeypatch.setenv(bf16_matmul.ENV, mode)
        output_dir = tmp_path / mode
        result = run_finetune(common_args(tiny_model_dir, output_dir, 4, 2) + ["--torch_dtype", "bfloat16"])
        choice = json.loads((output_dir / "run.json").read_text())["compute_dtype_choice"]
        assert choice["dtype"] == "bfloat16" and choice["bf16_matmuls_via_fp32"] is (mode == "fp32")
        assert ("linear layers run on fp32 kernels" in result.stdout) is (mode == "fp32")
        losses[mode] = [m["loss"] for m in read_metrics(output_dir)]
    assert len(losses["fp32"]) == len(losses["native"]) >= 4
    assert max(abs(a - b) / b for a, b in zip(losses["fp32"], losses["native"])) < 5e-3
