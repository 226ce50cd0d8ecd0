"""scripts/benchmark_trl.py as a user runs it (docs/benchmarks.md: `--compare_loss RUN`): its flags read whole, and
nothing it imports fetches code from the Hub that the run it compares never fetched."""

from __future__ import annotations

import os
import sys

import pytest

from conftest import load_script


def test_a_mistyped_flag_is_one_error_naming_the_flag_it_meant(capsys) -> None:
    """`benchmark_trl.py --compare RUN` (and `--help`) was read as benchmark.py's JSON argument: a JSONDecodeError
    traceback after a second of TRL imports."""
    script = load_script("benchmark_trl")
    with pytest.raises(SystemExit) as exit_:
        script.cli(["--compare", "RUN"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "benchmark_trl.py --compare_loss: error: unknown flag --compare (flags are not shortened: did you mean "
        "--compare_loss?)")
    with pytest.raises(SystemExit) as exit_:
        script.cli(["--help"])
    assert exit_.value.code == 0 and "--trl_precision {fp32,autocast,bf16_weights}" in capsys.readouterr().out


def test_loading_the_script_keeps_bitsandbytes_from_fetching_its_kernel_before_trl_imports_peft(monkeypatch) -> None:
    """--compare_loss imported trl (peft, so bitsandbytes) before open_sft: on a CPU with AVX512-BF16 bitsandbytes
    asked the Hub for kernels-community/quantization-bitsandbytes ('Failed to load CPU gemm_4bit_forward from
    kernels-community: ... could not verify publisher trust status'), which the LoRA run it compares never did. The
    script imports the package first, which names that kernel in LOCAL_KERNELS with no path."""
    monkeypatch.delenv("LOCAL_KERNELS", raising=False)
    monkeypatch.delenv("USE_HUB_KERNELS", raising=False)
    monkeypatch.delitem(sys.modules, "open_sft")  # as in the script's own process, where nothing imported it yet
    load_script("benchmark_trl")
    assert os.environ["LOCAL_KERNELS"] == f"kernels-community/quantization-bitsandbytes={os.devnull}"
    assert os.environ["USE_HUB_KERNELS"] == "NO"
