"""GPUs older than Ampere (compute capability below 8.0: T4 7.5, V100 7.0), with the CUDA queries made up: flash
attention (torch's variable-length kernel, the flash-attn package) refuses them at the first forward ("FlashAttention
only supports Ampere GPUs or newer"), so neither is chosen there, and an explicit flash_attention_2 is refused with
the flags. (bf16 there: tests/unit/model/test_precision.py.)"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from open_sft.config.args import ModelArguments
from open_sft.model import load, packed_attention


@pytest.fixture
def gpu(monkeypatch):
    """A GPU of the capability the test sets, and the flash-attn package installed."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "flash_attn"
                        else find_spec(name, *a))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla T4")

    def with_capability(capability: tuple[int, int]) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    return with_capability


@pytest.mark.parametrize("capability, kernel", [((7, 5), False), ((7, 0), False), ((8, 0), True), ((9, 0), True)])
def test_the_varlen_kernel_and_flash_attention_2_only_from_ampere_on(gpu, capability, kernel) -> None:
    from transformers import LlamaConfig

    gpu(capability)
    assert (packed_attention.varlen_kernel() is not None) == kernel
    chosen = load.attn_implementation(ModelArguments(model_name_or_path="m"), LlamaConfig())
    assert chosen == ("flash_attention_2" if kernel else "sdpa")


def test_no_varlen_kernel_without_a_gpu(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert packed_attention.varlen_kernel() is None


def test_an_explicit_flash_attention_2_is_refused_with_the_flags_before_ampere(gpu, tmp_path) -> None:
    from open_sft.config.parse import parse_config
    from open_sft.errors import ConfigError

    gpu((7, 5))
    with pytest.raises(ConfigError) as info:
        parse_config(["--model_name_or_path", "m", "--dataset_mixer_list", "d.jsonl", "1.0", "--output_dir",
                      str(tmp_path), "--attn_implementation", "flash_attention_2"])
    assert info.value.problems == [
        "--attn_implementation flash_attention_2 needs a GPU of compute capability 8.0 or later (Ampere: A100, A10, "
        "RTX 30xx, and newer); this one is 7.5 (Tesla T4), which flash-attn 2 refuses; use --attn_implementation sdpa"]


@pytest.mark.parametrize("flags, given, fix", [
    (["--use_flash_attn"], "--use_flash_attn",
     "drop --use_flash_attn (or give --use_flash_attn false): attention is then sdpa"),
    (["--use_flash_attn", "--attn_implementation", "flash_attention_2"],
     "--use_flash_attn (and --attn_implementation flash_attention_2)",
     "drop --use_flash_attn and use --attn_implementation sdpa")])
def test_open_instructs_use_flash_attn_is_refused_by_its_own_name_before_ampere(gpu, tmp_path, flags, given, fix):
    """open-instruct's --use_flash_attn on a T4 was refused naming --attn_implementation flash_attention_2, a flag the
    user never typed, and its fix (add --attn_implementation sdpa) contradicts --use_flash_attn; the flag given is
    named with a fix that parses, and that fix gives sdpa there."""
    from open_sft.config.parse import parse_config
    from open_sft.errors import ConfigError

    gpu((7, 5))
    argv = ["--model_name_or_path", "m", "--dataset_mixer_list", "d.jsonl", "1.0", "--output_dir", str(tmp_path)]
    with pytest.raises(ConfigError) as info:
        parse_config(argv + flags)
    assert info.value.problems == [
        f"{given} needs a GPU of compute capability 8.0 or later (Ampere: A100, A10, RTX 30xx, and newer); this one "
        f"is 7.5 (Tesla T4), which flash-attn 2 refuses; {fix}"]
    fixed = parse_config(argv + ["--use_flash_attn", "false"])
    assert load.attn_implementation(fixed.model) == "sdpa"


def test_use_flash_attn_without_the_package_is_refused_by_its_own_name(gpu, monkeypatch, tmp_path) -> None:
    from open_sft.config import checks
    from open_sft.config.parse import parse_config
    from open_sft.errors import ConfigError

    gpu((9, 0))
    monkeypatch.setattr(checks, "_installed", lambda package: package != "flash_attn")
    with pytest.raises(ConfigError) as info:
        parse_config(["--model_name_or_path", "m", "--dataset_mixer_list", "d.jsonl", "1.0", "--output_dir",
                      str(tmp_path), "--use_flash_attn"])
    assert info.value.problems == [
        "--use_flash_attn needs a CUDA GPU and the flash-attn package (CUDA available: True, flash-attn installed: "
        "False); drop --use_flash_attn (or give --use_flash_attn false): attention is then sdpa"]
