"""The end-of-training export on a disk that fills: one error naming the disk, what failed and where the rerun of
the same command resumes (it was a traceback), with --output_dir left as it was (the export is staged)."""

from __future__ import annotations

import errno
import shutil
from collections import namedtuple
from pathlib import Path
from types import SimpleNamespace

import pytest

from open_sft.errors import UserError

from ..training.test_checkpoint import _checkpointer
from ..training.test_disk_full import _Writes

Usage = namedtuple("Usage", "total used free")


def _config() -> SimpleNamespace:
    return SimpleNamespace(checkpoint=SimpleNamespace(max_shard_size="5GB", save_dtype="auto"),
                           lora=SimpleNamespace(merge_lora_on_save=False, use_qlora=False))


def _model_and_tokenizer():
    import transformers
    from tokenizers import Tokenizer, models

    config = transformers.LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    model = transformers.AutoModelForCausalLM.from_config(config)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"</s>": 0, "a": 1}, unk_token="</s>")), eos_token="</s>")
    return model, tokenizer


def _weights_writer_raises(monkeypatch, exc: BaseException) -> None:
    """save_pretrained's safetensors writer (transformers imports it as safe_save_file) writes half a file, then
    fails as a full disk fails it."""
    import transformers.modeling_utils

    def half_then_raise(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half")
        raise exc

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", half_then_raise)


def _full_disk_at_weights(monkeypatch) -> None:
    _weights_writer_raises(monkeypatch, OSError(errno.ENOSPC, "No space left on device"))
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(1 << 30, (1 << 30) - 4096, 4096))


@pytest.mark.parametrize("checkpoint", [False, True])
def test_a_full_disk_during_the_export_says_where_the_rerun_resumes_and_keeps_the_output_dir(
        tmp_path, monkeypatch, checkpoint) -> None:
    """Without a checkpoint the rerun trains from step 0; with one, from it (the message says which)."""
    import torch

    from open_sft.export.final import write_export

    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("{}\n")
    (out / "README.md").write_text("an earlier export's card")
    if checkpoint:  # a complete checkpoint, as problem_with reads one: its manifest matches its files
        checkpointer = _checkpointer(out, keep=2)
        checkpointer.state_io = _Writes()
        checkpointer.save(6)
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    model, tokenizer = _model_and_tokenizer()
    _full_disk_at_weights(monkeypatch)
    metrics = SimpleNamespace(close=lambda: None)
    with pytest.raises(UserError) as info:
        write_export(_config(), model, SimpleNamespace(metrics=metrics), tokenizer, out, model.state_dict(),
                     torch.float32)
    where = ("from the newest complete checkpoint, step_6 (the export needs about " if checkpoint
             else "from step 0 (no complete checkpoint yet; the export needs about ")
    assert str(info.value).startswith(
        f"{out}: the disk is full (4.0 KiB free): the model could not be exported to {out} (which "
        f"holds what it held before the export); free space there and rerun the same command: it resumes {where}")
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before  # no staging left, nothing replaced
    assert (out / "README.md").read_text() == "an earlier export's card"


def test_other_failures_of_the_export_keep_their_traceback(tmp_path, monkeypatch) -> None:
    import torch

    from open_sft.export.final import write_export

    _weights_writer_raises(monkeypatch, RuntimeError("a bug"))
    model, tokenizer = _model_and_tokenizer()
    with pytest.raises(RuntimeError, match="a bug"):
        write_export(_config(), model, SimpleNamespace(metrics=SimpleNamespace(close=lambda: None)), tokenizer,
                     tmp_path / "run", model.state_dict(), torch.float32)
    assert Path(tmp_path / "run").exists()


def _export(out: Path):
    import torch

    from open_sft.export.final import write_export

    model, tokenizer = _model_and_tokenizer()
    with pytest.raises(UserError) as info:
        write_export(_config(), model, SimpleNamespace(metrics=SimpleNamespace(close=lambda: None)), tokenizer, out,
                     model.state_dict(), torch.float32)
    return str(info.value), model


def test_safetensors_full_disk_in_the_export_says_the_space_it_found_and_what_the_export_needs(
        tmp_path, monkeypatch) -> None:
    """safetensors' own error (no OSError) was a traceback; the free space was measured after the staged files
    were removed (a full disk read '1004.0 KiB free'), and the size said was a checkpoint's, not the export's."""
    from safetensors import SafetensorError

    out = tmp_path / "run"
    out.mkdir()
    _weights_writer_raises(monkeypatch, SafetensorError("Error while serializing: I/O error: No space left on "
                                                        "device (os error 28)"))
    staging = out / ".export.tmp"
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(1 << 30, 0, 0 if staging.exists() else 5 << 20))
    message, model = _export(out)
    size = sum(t.numel() * 4 for t in model.state_dict().values())
    assert message == (f"{out}: the disk is full (0 bytes free): the model could not be exported to {out} (which "
                       "holds what it held before the export); free space there and rerun the same command: it "
                       f"resumes from step 0 (no complete checkpoint yet; the export needs about {size / 1024:.1f} "
                       "KiB)")
    assert not staging.exists()


@pytest.mark.parametrize("where", ["record", "card"])
def test_a_full_disk_after_the_model_files_are_in_place_says_the_export_is_unfinished(
        tmp_path, monkeypatch, where) -> None:
    """The export's record (written after the files are moved in) or the model card failing said OUT 'holds what
    it held before the export', which was false; the record's half-written .tmp stayed."""
    import open_sft.export.final
    from open_sft.export import save

    out = tmp_path / "run"
    out.mkdir()
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(1 << 30, 0, 0))
    if where == "record":
        writes = []
        real = save.write_json

        def second_fails(path, value, indent=1):
            writes.append(path)
            if len(writes) == 2:
                path.with_name(path.name + ".tmp").write_text("{")
                raise OSError(errno.ENOSPC, "No space left on device")
            real(path, value, indent)

        monkeypatch.setattr(save, "write_json", second_fails)
    else:
        def card_fails(directory):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(open_sft.export.final, "write_model_card", card_fails)
    message, _ = _export(out)
    assert message.startswith(f"{out}: the disk is full (0 bytes free): the export to {out} was left unfinished: the "
                              "new model files are in place, not all of the export's record, report and model card, "
                              "and the run is not marked complete; free space there and rerun the same command")
    assert (out / "model.safetensors").is_file()


def test_a_failed_json_write_leaves_no_temporary_file(tmp_path, monkeypatch) -> None:
    from open_sft import durable

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(durable.os, "fsync", full)
    with pytest.raises(OSError):
        durable.write_json(tmp_path / "x.json", {"a": 1})
    assert list(tmp_path.iterdir()) == []
