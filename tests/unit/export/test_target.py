"""Where `open_sft export` and `open_sft merge-lora` may write: never over the base model, beside the adapter, or
into a directory of files these commands did not write; again into their own output (replacing it)."""

from __future__ import annotations

import shutil

import pytest
import torch

from open_sft.config.args import LoraArguments
from open_sft.errors import UserError
from open_sft.export.merge_adapter import main as merge_main
from open_sft.export.save import STAGING, staged_export
from open_sft.export.target import check_target


def _tree(directory) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_only_a_new_or_empty_directory_or_these_commands_own_output_is_written(tmp_path) -> None:
    check_target(tmp_path / "new", "open_sft export", {})
    (tmp_path / "empty" / STAGING).mkdir(parents=True)  # a killed export's staging only
    check_target(tmp_path / "empty", "open_sft export", {})
    for command in ("open_sft export", "open_sft merge-lora"):
        with staged_export(tmp_path / command.split()[-1], written_by=command) as staging:
            (staging / "config.json").write_text("{}")
        check_target(tmp_path / command.split()[-1], "open_sft merge-lora", {})
    with staged_export(tmp_path / "run", written_by="finetune.py") as staging:  # a run's own export
        (staging / "config.json").write_text("{}")
    base = tmp_path / "base_copy"
    base.mkdir()
    (base / "config.json").write_text("{}")
    (base / "model.safetensors").write_bytes(b"weights")
    for out in (tmp_path / "run", base):
        with pytest.raises(UserError, match=r"already holds files that open_sft export or open_sft merge-lora did not "
                                            r"write \(.*config.json.*\): .* give a new or empty directory, or remove"):
            check_target(out, "open_sft export", {})
    with pytest.raises(UserError, match=r"base_copy/? is the base model \(.*\), which open_sft merge-lora only reads: "
                                        r"the model it writes would overwrite it .* give a new directory"):
        check_target(base, "open_sft merge-lora", {"the base model": str(base) + "/"})


def test_merge_lora_refuses_the_base_and_the_adapter_and_replaces_its_own_output(tiny_model_dir, tmp_path,
                                                                                 capsys) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from open_sft.export.save import save_lora
    from open_sft.model.lora import apply_lora

    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir, base)
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = apply_lora(AutoModelForCausalLM.from_pretrained(base), LoraArguments(use_lora=True, lora_rank=4), [])
    torch.manual_seed(0)
    with torch.no_grad():
        for param in (p for p in model.parameters() if p.requires_grad):
            param.add_(torch.randn_like(param) * 0.1)
    run = tmp_path / "run"
    save_lora(model, model.state_dict(), tokenizer, run, merge=False)
    before = {d: _tree(d) for d in (base, run)}
    assert merge_main([str(run), str(base) + "/", "--base_model", str(base)]) == 2
    assert "is the base model" in capsys.readouterr().err
    assert merge_main([str(run), str(run)]) == 2
    assert "is the adapter's directory" in capsys.readouterr().err
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    assert merge_main([str(run), str(tmp_path / "other")]) == 2
    assert {d: _tree(d) for d in (base, run)} == before and _tree(tmp_path / "other") == {"notes.txt": b"mine"}
    out = tmp_path / "merged"
    assert merge_main([str(run), str(out)]) == 0
    first = _tree(out)
    assert "model.safetensors" in first and "config.json" in first
    assert merge_main([str(run), str(out), "--dtype", "bfloat16"]) == 0  # again into its own output: replaced
    assert _tree(out).keys() == first.keys() and _tree(out)["model.safetensors"] != first["model.safetensors"]
