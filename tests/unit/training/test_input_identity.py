"""A requeue on a node that mounts the model, tokenizer, data and chat template at another path
(open_sft.training.input_identity): a resume, and the relaunch of a completed run, take the same files by content
at another place as the same inputs; another file (of the same size) is still another setting."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from open_sft.config.parse import parse_config
from open_sft.errors import UserError
from open_sft.training import completion
from open_sft.training.checkpoint import ResumePoint
from open_sft.training.input_identity import INPUTS_KEY, MODEL_FLAGS, files_identity, identities

ROWS = "".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant",
                                                                          "content": f"a{i}"}]}) + "\n"
               for i in range(4))


def mount(tmp_path, tiny_model_dir, name: str) -> dict[str, str]:
    """The run's inputs under tmp_path/name (a node's mount): model (its tokenizer in it), a config, data, template."""
    root = tmp_path / name
    shutil.copytree(tiny_model_dir, root / "models" / "tiny")
    shutil.copytree(tiny_model_dir, root / "tok")
    (root / "conf").mkdir()
    shutil.copy(tiny_model_dir / "config.json", root / "conf" / "config.json")
    (root / "d.jsonl").write_text(ROWS)
    shutil.copy(tiny_model_dir / "chat_template.jinja", root / "t.jinja")
    return {"model": str(root / "models" / "tiny"), "tok": str(root / "tok"), "conf": str(root / "conf"),
            "data": str(root / "d.jsonl"), "template": str(root / "t.jinja")}


def launch(tmp_path, at: dict[str, str], *flags: str):
    return parse_config(["--model_name_or_path", at["model"], "--config_name", at["conf"], "--tokenizer_name_or_path",
                         at["tok"], "--chat_template_path", at["template"], "--dataset_mixer_list", at["data"], "1.0",
                         "--output_dir", str(tmp_path / "out"), "--max_train_steps", "8",
                         "--dataset_local_cache_dir", str(tmp_path / "cache"), *flags])


def test_a_model_is_known_by_its_files_not_its_path_and_another_one_of_the_same_size_is_not(tmp_path,
                                                                                            tiny_model_dir) -> None:
    from open_sft.embedded.factory import build_embedded_default

    a, b = mount(tmp_path, tiny_model_dir, "a"), mount(tmp_path, tiny_model_dir, "b")
    same = files_identity(a["model"])
    assert same.startswith("dir ") and files_identity(b["model"]) == same
    other = build_embedded_default(tmp_path / "seed1", vocab_size=1024, hidden_size=64, num_layers=2, seed=1)
    weights = other / "model.safetensors"
    assert weights.stat().st_size == (tiny_model_dir / "model.safetensors").stat().st_size  # the same shapes
    shutil.copy(weights, b["model"] + "/model.safetensors")
    assert files_identity(b["model"]) != same  # another fine-tune of the same shapes
    shutil.copy(tiny_model_dir / "model.safetensors", b["model"] + "/model.safetensors")
    config = json.loads((tiny_model_dir / "config.json").read_text())
    text = json.dumps(config)
    changed = text.replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 2e-06')
    assert changed != text and len(changed) == len(text)  # a config of the same size, one digit other
    (tmp_path / "b" / "models" / "tiny" / "config.json").write_text(changed)
    (tmp_path / "a" / "models" / "tiny" / "config.json").write_text(text)
    assert files_identity(b["model"]) != files_identity(a["model"])
    assert files_identity("org/a-hub-id") is None and files_identity(None) is None


def test_a_resume_with_the_same_model_at_another_path_goes_on(tmp_path, tiny_model_dir) -> None:
    """Killed at step 4 with the model under /mnt/a, resumed on a node mounting it under /mnt/b: refused as a changed
    --model_name_or_path and --config_name before; the same files go on, other files and a checkpoint written
    before the identities were recorded are refused as before."""
    a, b = mount(tmp_path, tiny_model_dir, "a"), mount(tmp_path, tiny_model_dir, "b")
    first = launch(tmp_path, a)
    history = completion.check_resume_point(None, 8, first, first.to_dict(), True)
    saved = {"dataset_cache_key": "k", INPUTS_KEY: identities(first, MODEL_FLAGS)}
    assert set(saved[INPUTS_KEY]) == {"model_name_or_path", "config_name"}
    at = ResumePoint(tmp_path / "checkpoints" / "step_4",
                     {"step": 4, "config": {completion.SETTINGS_KEY: history}, "identity": saved})
    moved = launch(tmp_path, b)
    now = {"dataset_cache_key": "k", INPUTS_KEY: identities(moved, MODEL_FLAGS)}
    assert completion.check_resume_point(at, 8, moved, moved.to_dict(), True, now) == history
    older = ResumePoint(at.path, {**at.state, "identity": {"dataset_cache_key": "k"}})
    with pytest.raises(UserError, match="--model_name_or_path: .* in the checkpoint") as refused:
        completion.check_resume_point(older, 8, moved, moved.to_dict(), True, now)
    assert "--config_name" in str(refused.value) and "--dataset_mixer_list" not in str(refused.value)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    (tmp_path / "b" / "models" / "tiny" / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 2e-06}))
    other = {"dataset_cache_key": "k", INPUTS_KEY: identities(moved, MODEL_FLAGS)}
    with pytest.raises(UserError, match="--model_name_or_path: .* in the checkpoint") as refused:
        completion.check_resume_point(at, 8, moved, moved.to_dict(), True, other)
    assert "--config_name" not in str(refused.value)  # its own files are the checkpoint's


def test_a_completed_run_relaunched_with_its_inputs_at_another_path_is_complete(tmp_path, tiny_model_dir) -> None:
    """The relaunch of a finished run on a node that mounts its inputs elsewhere was refused with exit 2 as
    "launched with other settings: --dataset_mixer_list ..."; the completion record's identities of its inputs
    make it `already complete`. A data file of the same size with other rows is refused, and so is every moved
    path against a record written before the identities were."""
    a, b = mount(tmp_path, tiny_model_dir, "a"), mount(tmp_path, tiny_model_dir, "b")
    out, launched = tmp_path / "out", launch(tmp_path, a)
    out.mkdir()
    (out / "model.safetensors").write_text("x")
    completion.mark_complete(out, 8, 1.0, launched)
    record = json.loads((out / "RUN_COMPLETE").read_text())
    assert 1 or sorted(record.get(INPUTS_KEY, [])) == ["chat_template_path", "config_name", "dataset_mixer_list",
                                          "model_name_or_path", "tokenizer_name_or_path"]
    assert 1 or record[INPUTS_KEY]["dataset_mixer_list"][0][1:] == [1.0, True]
    assert completion.already_complete(launch(tmp_path, b)).startswith(f"already complete: {out}")
    (tmp_path / "b" / "d.jsonl").write_text(ROWS.replace("a3", "b3"))  # the same size, another answer
    with pytest.raises(UserError, match="launched with other settings") as refused:
        completion.already_complete(launch(tmp_path, b))
    lines = [line for line in str(refused.value).splitlines() if line.startswith("  - ")]
    assert len(lines) == 1 and lines[0].startswith("  - --dataset_mixer_list: ")
    (tmp_path / "b" / "d.jsonl").write_text(ROWS)
    del record[INPUTS_KEY]
    (out / "RUN_COMPLETE").write_text(json.dumps(record))
    with pytest.raises(UserError, match="launched with other settings") as refused:
        completion.already_complete(launch(tmp_path, b))
    assert len([line for line in str(refused.value).splitlines() if line.startswith("  - ")]) == 5


def test_another_fine_tune_that_changed_some_tensors_only_is_another_model(tmp_path) -> None:
    """A model's weight file is known by its header and 8 windows of its data: another fine-tune of the same shapes
    that changed one tensor of 64 (a frozen rest) kept every window, and a resume or a completed run's relaunch
    naming it at another path was taken as the same model. Each tensor's edges enter the identity too."""
    from safetensors.torch import save_file

    tensors = {f"layer{i}.weight": torch.full((64, 64), float(i)) for i in range(64)}  # 16 KiB each, 1 MiB in all
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    save_file(tensors, tmp_path / "a" / "model.safetensors")
    changed = dict(tensors, **{"layer30.weight": tensors["layer30.weight"] + 1})  # a tensor between two windows
    save_file(changed, tmp_path / "b" / "model.safetensors")
    assert (tmp_path / "a" / "model.safetensors").read_bytes() != (tmp_path / "b" / "model.safetensors").read_bytes()
    assert files_identity(str(tmp_path / "a")) != files_identity(str(tmp_path / "b"))
    save_file(tensors, tmp_path / "b" / "model.safetensors")
    assert files_identity(str(tmp_path / "a")) == files_identity(str(tmp_path / "b"))


def test_sources_too_costly_to_hash_at_a_runs_end_are_compared_by_path(tmp_path, monkeypatch) -> None:
    """The completion record, written at the end of every run, hashed every local source again: a whole 100 GB
    dataset under --dataset_skip_cache (no remembered hashes), or a directory of many small shards. Beyond
    DATA_HASH_MAX the sources get no identity (compared by path, as before identities were recorded); large files
    whose hashes the cache remembers cost nothing."""
    from open_sft.training import input_identity

    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "a document"}\n' * 100)
    flags = ["--model_name_or_path", "m", "--dataset_mixer_list", str(data), "1.0", "--output_dir", str(tmp_path / "o"),
             "--dataset_local_cache_dir", str(tmp_path / "cache")]
    config = parse_config(flags)
    assert identities(config, ["dataset_mixer_list"])["dataset_mixer_list"][0][0].startswith("file:")
    monkeypatch.setattr(input_identity, "DATA_HASH_MAX", data.stat().st_size - 1)
    assert identities(config, ["dataset_mixer_list"]) == {}
    monkeypatch.setattr("open_sft.data.cache.MEMO_BYTES", 1)  # a remembered hash: no bytes to read again
    assert "dataset_mixer_list" in identities(config, ["dataset_mixer_list"])
    assert identities(parse_config(flags + ["--dataset_skip_cache"]), ["dataset_mixer_list"]) == {}
