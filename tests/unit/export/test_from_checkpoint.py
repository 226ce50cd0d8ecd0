"""`open_sft export CHECKPOINT OUT` in one process: checkpoints written here in the formats the engines write
(accelerate's model.safetensors, torch distributed checkpoint), exported and compared with what transformers'
save_pretrained writes of the same model; memory one output shard at a time; every refusal before anything is
written. The export of checkpoints written by real runs of each engine is tested in the integration tests of
that engine (tests/export_check.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from open_sft.errors import UserError
from open_sft.export import checkpoint_weights
from open_sft.export.from_checkpoint import export_checkpoint, main
from open_sft.export.save import write_model_files
from open_sft.training.checkpoint import publish


class _Wrapper(torch.nn.Module):  # what a run checkpoints: open_sft.model.loss.TokenLossModel holds `.model`
    def __init__(self, model):
        super().__init__()
        self.model = model


def _model(tiny_model_dir: Path, tied: bool):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.tie_word_embeddings = tied
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def _checkpoint(tiny_model_dir: Path, run_dir: Path, step: int, tied: bool = False, fmt: str = "safetensors",
                metrics: int = 0) -> tuple[Path, torch.nn.Module]:
    """run_dir/checkpoints/step_<step>, as a run writes it: the weights under the wrapper's names in `fmt`,
    trainer_state.json, model/ and COMPLETE; metrics.jsonl with `metrics` steps in run_dir."""
    from accelerate.utils import save
    from transformers import AutoTokenizer

    model = _model(tiny_model_dir, tied)
    tmp = run_dir / "checkpoints" / f"step_{step}.tmp"
    tmp.mkdir(parents=True)
    state = _Wrapper(model).state_dict()
    if fmt == "safetensors":
        save(state, tmp / "model.safetensors", safe_serialization=True)  # accelerate's save_state
    else:
        import torch.distributed.checkpoint as dcp

        dcp.save({"model": state}, checkpoint_id=str(tmp / checkpoint_weights.FSDP_DIR), no_dist=True)
    (tmp / "trainer_state.json").write_text(json.dumps({"step": step, "schedule": {"total_steps": 10},
                                                        "config": {"checkpoint": {"max_shard_size": "5GB"}}}))
    write_model_files(model, AutoTokenizer.from_pretrained(tiny_model_dir), tmp / "model", torch.float32)
    publish(tmp, run_dir / "checkpoints" / f"step_{step}", step)
    (run_dir / "run.json").write_text(json.dumps({"args": {"model": {"model_name_or_path": "org/base"}}}))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "epoch": s / 10, "loss": 1.0 / s}) + "\n"
                                                   for s in range(1, metrics + 1)) + '{"step": 9, "lo')
    return run_dir / "checkpoints" / f"step_{step}", model


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(file))
    return out


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("fmt", ["safetensors", "distributed"])
def test_export_writes_what_save_pretrained_writes(tiny_model_dir, tmp_path, tied, fmt) -> None:
    """Same names (a tied head left out, as save_pretrained does), same shards and index, the same tensors bitwise
    in the asked dtype, from accelerate's file and from a torch distributed checkpoint (FSDP2's)."""
    checkpoint, model = _checkpoint(tiny_model_dir, tmp_path / "run", 4, tied=tied, fmt=fmt)
    out = export_checkpoint(checkpoint, tmp_path / "out", dtype_flag="bfloat16", max_shard_size="100KB")
    reference = tmp_path / "reference"
    model.to(torch.bfloat16).save_pretrained(reference, max_shard_size="100KB")
    ours, theirs = _weights(out), _weights(reference)
    assert sorted(ours) == sorted(theirs) and ("lm_head.weight" in ours) != tied
    assert all(ours[k].dtype == torch.bfloat16 and torch.equal(ours[k], theirs[k]) for k in theirs)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == json.loads((reference / "model.safetensors.index.json").read_text())["weight_map"]
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(reloaded.get_input_embeddings().weight, theirs["model.embed_tokens.weight"])


def test_export_holds_one_output_shard_at_a_time(tiny_model_dir, tmp_path, monkeypatch) -> None:
    checkpoint, _ = _checkpoint(tiny_model_dir, tmp_path / "run", 4)
    loads: list[int] = []
    real = checkpoint_weights.CheckpointWeights.load

    def counted(self, names):
        tensors = real(self, names)
        loads.append(sum(t.numel() * t.element_size() for t in tensors.values()))
        return tensors

    monkeypatch.setattr(checkpoint_weights.CheckpointWeights, "load", counted)
    out = export_checkpoint(checkpoint, tmp_path / "out", max_shard_size="100KB")
    shards = list(out.glob("model-*.safetensors"))
    assert len(loads) == len(shards) > 3
    largest = max(t.numel() * 4 for t in _weights(out).values())
    assert max(loads) <= max(100_000, largest)


def test_export_copies_the_run_files_up_to_the_step_and_the_card_names_it(tiny_model_dir, tmp_path) -> None:
    checkpoint, _ = _checkpoint(tiny_model_dir, tmp_path / "run", 4, metrics=6)
    out = export_checkpoint(checkpoint, tmp_path / "out")
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    record = json.loads((out / "export.json").read_text())
    assert record["step"] == 4 and record["total_steps"] == 10 and record["checkpoint"] == str(checkpoint.resolve())
    card = (out / "README.md").read_text()
    assert "Exported from the checkpoint of step 4 of 10" in card and "(4 optimizer steps)" in card
    for name in ("tokenizer.json", "generation_config.json", "run.json"):
        assert (out / name).is_file()


def test_a_checkpoint_outside_a_runs_checkpoints_exports_beside_itself_without_another_runs_files(
        tiny_model_dir, tmp_path, caplog) -> None:
    """review ckpt 3: the run was taken to be two levels above any checkpoint. A copied /scratch/step_4 was refused
    'inside the run's checkpoints (/scratch), which the run prunes' for OUT /scratch/exported, and run.json and
    metrics.jsonl were copied from whatever sat two levels up; a checkpoint moved aside (checkpoints.previous-1)
    got the live timeline's metrics.jsonl and run.json, so its card showed another run's losses. A checkpoint is a
    run's when its parent is named checkpoints with run.json beside it; else the run's files are left out, said."""
    import logging
    import shutil

    checkpoint, _ = _checkpoint(tiny_model_dir, tmp_path / "run", 4, metrics=6)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    copied = Path(shutil.copytree(checkpoint, scratch / "step_4"))
    aside = tmp_path / "run" / "checkpoints.previous-1"
    aside.mkdir()
    moved = Path(shutil.copytree(checkpoint, aside / "step_4"))
    # moved aside inside a symlinked checkpoints/ target (open_sft.durable.set_aside): checkpoints/previous-1/step_4
    inside = Path(shutil.copytree(checkpoint, tmp_path / "run" / "checkpoints" / "previous-1" / "step_4"))
    for source, out in ((copied, scratch / "exported"), (moved, tmp_path / "run" / "exported"),
                        (inside, tmp_path / "run" / "exported_inside")):
        with caplog.at_level(logging.INFO, logger="open_sft.export.from_checkpoint"):
            export_checkpoint(source, out)
        assert (out / "model.safetensors").is_file() and (out / "export.json").is_file()
        assert not any((out / name).exists() for name in ("run.json", "metrics.jsonl", "data_report.json"))
        assert (f"{source} is not in a run's checkpoints/ (its parent is not named checkpoints with the run's "
                "run.json beside it): run.json, data_report.json and metrics.jsonl are left out of the export"
                ) in caplog.text
        assert "Exported from the checkpoint of step 4 of 10" in (out / "README.md").read_text()
    with pytest.raises(UserError, match="is inside the checkpoint"):
        export_checkpoint(copied, copied / "model_out")


def test_a_second_export_into_the_same_directory_replaces_the_first(tiny_model_dir, tmp_path) -> None:
    checkpoint, _ = _checkpoint(tiny_model_dir, tmp_path / "run", 4)
    out = export_checkpoint(checkpoint, tmp_path / "out", max_shard_size="100KB")
    export_checkpoint(checkpoint, out)
    assert sorted(p.name for p in out.glob("model*.safetensors*")) == ["model.safetensors"]


def test_refusals_name_the_problem_and_write_nothing(tiny_model_dir, tmp_path, capsys) -> None:
    run = tmp_path / "run"
    checkpoint, _ = _checkpoint(tiny_model_dir, run, 4)
    cases = {run: "is the run's own --output_dir", run / "checkpoints" / "exported": "inside the run's checkpoints"}
    for out, message in cases.items():
        with pytest.raises(UserError, match=message):
            export_checkpoint(checkpoint, out)
    assert not (run / "checkpoints" / "exported").exists() and not (run / "config.json").exists()
    base = tmp_path / "base_copy"  # a model that is not this command's: written over, or mixed with the export
    base.mkdir()
    (base / "config.json").write_text("{}")
    (base / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(UserError, match=r"base_copy already holds files that open_sft export or open_sft merge-lora "
                                        r"did not write \(config.json, model.safetensors\)"):
        export_checkpoint(checkpoint, base)
    assert sorted(p.name for p in base.iterdir()) == ["config.json", "model.safetensors"]
    assert (base / "model.safetensors").read_bytes() == b"weights"
    (run / "checkpoints" / "step_2").mkdir()
    assert main([str(run / "checkpoints" / "step_2"), str(tmp_path / "out")]) == 2
    assert "not a usable checkpoint (no COMPLETE marker" in capsys.readouterr().err
    older = tmp_path / "older" / "checkpoints" / "step_4.tmp"
    older.mkdir(parents=True)
    (older / "trainer_state.json").write_text(json.dumps({"step": 4}))
    publish(older, older.with_name("step_4"), 4)
    with pytest.raises(UserError, match="earlier open_sft, before checkpoints kept their model's files"):
        export_checkpoint(older.with_name("step_4"), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_output_dir_that_is_a_file_is_refused_before_anything_is_read(tiny_model_dir, tmp_path, capsys) -> None:
    checkpoint, _ = _checkpoint(tiny_model_dir, tmp_path / "run", 2)
    (tmp_path / "file").write_text("x")
    under = (tmp_path / "file" / "m", f"it lies under {tmp_path / 'file'}")
    for out, why in ((tmp_path / "file", "it is a file"), under):
        assert main([str(checkpoint), str(out)]) == 2
        assert f"error: {out}: {why}" in capsys.readouterr().err
    assert (tmp_path / "file").read_text() == "x"


def test_a_bad_max_shard_size_is_refused_before_anything_is_written(tiny_model_dir, tmp_path, capsys) -> None:
    checkpoint, _ = _checkpoint(tiny_model_dir, tmp_path / "run", 2)
    assert main([str(checkpoint), str(tmp_path / "out"), "--max_shard_size", "bogus"]) == 2
    assert "error: --max_shard_size 'bogus' is not a size; give a number and a unit" in capsys.readouterr().err
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    state["config"]["checkpoint"]["max_shard_size"] = "5XB"  # recorded before the flag was checked (the manifest's
    # byte count kept: the same length)
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(UserError, match=r"the run's --max_shard_size '5XB' is not a size.*pass --max_shard_size"):
        export_checkpoint(checkpoint, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert export_checkpoint(checkpoint, tmp_path / "out", max_shard_size="5GB").is_dir()


def test_a_failed_export_leaves_the_earlier_one(tiny_model_dir, tmp_path, monkeypatch) -> None:
    checkpoint, _ = _checkpoint(tiny_model_dir, tmp_path / "run", 4)
    out = export_checkpoint(checkpoint, tmp_path / "out")
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def broken(self, names):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint_weights.CheckpointWeights, "load", broken)
    with pytest.raises(OSError, match="disk full"):
        export_checkpoint(checkpoint, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    with pytest.raises(OSError):
        export_checkpoint(checkpoint, tmp_path / "fresh")
    assert not (tmp_path / "fresh").exists()


@pytest.mark.parametrize("fresh", [True, False])
def test_a_full_disk_in_open_sft_export_is_the_error_line(tiny_model_dir, tmp_path, monkeypatch, capsys,
                                                            fresh) -> None:
    """safetensors' error on a full OUT was a traceback (exit 1); now one error line (exit 2) saying what OUT
    holds and about how much room the export needs."""
    import shutil
    from collections import namedtuple

    import safetensors.torch
    from safetensors import SafetensorError

    from safetensors.torch import load_file

    from open_sft.durable import human_size

    checkpoint, _ = _checkpoint(tiny_model_dir, tmp_path / "run", 4)
    out = tmp_path / "out"
    export_checkpoint(checkpoint, tmp_path / "whole")
    needs = human_size(sum(t.numel() * t.element_size()
                           for t in load_file(tmp_path / "whole" / "model.safetensors").values()))
    if not fresh:
        export_checkpoint(checkpoint, out)

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: namedtuple("U", "total used free")(1, 1, 0))
    assert main([str(checkpoint), str(out)]) == 2
    left = "it was removed again" if fresh else "it holds what it held before"
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: {out}: the disk is full (0 bytes free): {checkpoint} could not be exported to {out} ({left}); free "
        f"space there (the export needs about {needs}) and rerun the same command")
    assert out.exists() != fresh


def test_a_lora_checkpoints_skeleton_keeps_its_base_without_peft_warning_of_a_rename(tiny_model_dir,
                                                                                    tmp_path) -> None:
    """`open_sft export` of a LoRA step checkpoint printed peft's "base_model_name_or_path was renamed from
    '/path/base' to the checkpoint's directory (the skeleton is built from the config there): it keeps the
    adapter's base."""
    import shutil
    import warnings

    from peft import LoraConfig

    from open_sft.export.from_checkpoint import _peft_skeleton

    files = tmp_path / "model"
    shutil.copytree(tiny_model_dir, files)
    LoraConfig(r=4, target_modules=["q_proj"], base_model_name_or_path="/models/base").save_pretrained(files)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        skeleton = _peft_skeleton(files)
    assert not [w for w in caught if "renamed" in str(w.message)]
    assert skeleton.peft_config["default"].base_model_name_or_path == "/models/base"
