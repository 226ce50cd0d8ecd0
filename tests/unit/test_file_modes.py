"""What a run writes is readable as the umask says (safetensors alone writes 0600), and an input this user may not
read is named as such before anything loads. The permission denials are real: as root (who reads everything)
the check runs under another effective uid; as any other user the file loses its read bits."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path

import pytest

from open_sft.config.parse import parse_config
from open_sft.errors import ConfigError
from open_sft.file_modes import current_umask, share_as_umask, unreadable

NOBODY = 65534


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


@contextlib.contextmanager
def umask(value: int):
    old = os.umask(value)
    try:
        yield
    finally:
        os.umask(old)


@contextlib.contextmanager
def denied(path: Path):
    """`path` cannot be read by this process inside the block."""
    if os.geteuid() == 0:
        os.chmod(path, 0o600)  # root's own file, and the process is somebody else for the block
        os.seteuid(NOBODY)
        try:
            yield
        finally:
            os.seteuid(0)
    else:
        before = mode(path)
        os.chmod(path, 0)
        try:
            yield
        finally:
            os.chmod(path, before)


@pytest.fixture
def open_dir():
    """A directory every user may enter (pytest's tmp_path sits under a 0700 directory)."""
    path = Path(tempfile.mkdtemp(prefix="open_sft_modes_"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_current_umask_is_read_without_changing_it() -> None:
    with umask(0o027):
        assert current_umask() == 0o027
        assert current_umask() == 0o027


def test_files_and_directories_get_the_bits_the_umask_gives(tmp_path) -> None:
    root = tmp_path / "out"
    (root / "sub").mkdir(parents=True)
    (root / "sub").chmod(0o700)
    for name, bits in (("model.safetensors", 0o600), ("open.json", 0o666), ("run.sh", 0o700), ("g.txt", 0o640)):
        (root / name).write_text(name)
        (root / name).chmod(bits)
    (root / "sub" / "inner.safetensors").write_text("x")
    (root / "sub" / "inner.safetensors").chmod(0o600)
    (root / "link").symlink_to(root / "model.safetensors")
    assert share_as_umask(root, umask=0o077) == 0  # the umask gives nothing beyond what they have
    assert share_as_umask(root, umask=0o022) == 5
    assert {p.name: oct(mode(p)) for p in [root, *root.rglob("*")] if not p.is_symlink()} == {
        "out": oct(0o755), "sub": oct(0o755), "model.safetensors": oct(0o644), "open.json": oct(0o666),
        "run.sh": oct(0o744), "g.txt": oct(0o644), "inner.safetensors": oct(0o644)}  # bits are added, never removed


def test_a_real_model_export_is_readable_by_group_and_others_under_umask_022(tmp_path) -> None:
    from open_sft.embedded.factory import build_embedded_default

    with umask(0o022):
        out = build_embedded_default(tmp_path / "m", vocab_size=300, hidden_size=16, num_layers=1, num_heads=2,
                                     num_kv_heads=1)
    assert (out / "model.safetensors").exists()
    assert {p.name: oct(mode(p)) for p in out.iterdir()} == {p.name: oct(0o644) for p in out.iterdir()}
    with umask(0o027):
        out = build_embedded_default(tmp_path / "g", vocab_size=300, hidden_size=16, num_layers=1, num_heads=2,
                                     num_kv_heads=1)
    assert {oct(mode(p)) for p in out.iterdir()} == {oct(0o640)}


def test_a_published_checkpoint_is_readable_as_the_umask_says(tmp_path) -> None:
    from open_sft.training.checkpoint import publish

    tmp = tmp_path / "step_3.tmp"
    (tmp / "pytorch_model").mkdir(parents=True)
    (tmp / "model.safetensors").write_bytes(b"w")
    (tmp / "model.safetensors").chmod(0o600)
    with umask(0o022):
        publish(tmp, tmp_path / "step_3", 3)
    assert mode(tmp_path / "step_3" / "model.safetensors") == 0o644
    assert mode(tmp_path / "step_3" / "COMPLETE") == 0o644


def test_an_unreadable_weights_file_is_named_with_its_mode_and_owner(open_dir) -> None:
    model = open_dir / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"weights")
    assert unreadable(model) is None
    with denied(model / "model.safetensors"):
        why = unreadable(model)
    assert why is not None and why.startswith(f"{model / 'model.safetensors'} cannot be read by this user")
    assert "-rw-------" in why or "----------" in why
    assert f"owned by uid {os.geteuid()}" in why and "chmod -R a+rX" in why
    assert unreadable(open_dir / "absent") is None  # a missing path has its own message


def _flags(model: Path, data: Path, out: Path) -> list[str]:
    return ["--model_name_or_path", str(model), "--dataset_mixer_list", str(data), "1.0", "--output_dir", str(out)]


def test_finetune_flags_name_the_input_they_cannot_read(open_dir, tiny_model_dir) -> None:
    model = Path(shutil.copytree(tiny_model_dir, open_dir / "model"))
    for path in [model, *model.iterdir()]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    data = open_dir / "train.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant",
                                                                              "content": "b"}]}) + "\n")
    data.chmod(0o644)
    parse_config(_flags(model, data, open_dir / "out"))  # readable: accepted (and every module it needs imported)
    with denied(model / "model.safetensors"), pytest.raises(ConfigError) as raised:
        parse_config(_flags(model, data, open_dir / "out"))
    assert f"--model_name_or_path {model}: {model / 'model.safetensors'} cannot be read by this user" in str(raised.value)
    with denied(data), pytest.raises(ConfigError) as raised:
        parse_config(_flags(model, data, open_dir / "out"))
    assert f"--dataset_mixer_list {data}: {data} cannot be read by this user" in str(raised.value)
    assert not (open_dir / "out").exists()


def test_the_walk_enters_no_symlinked_directory_and_names_a_subdirectory_it_cannot_read(open_dir) -> None:
    data = open_dir / "data"
    (data / "part").mkdir(parents=True)
    (data / "part" / "a.jsonl").write_text("{}\n")
    (data / "self").symlink_to(".")  # followed, a loop (ELOOP traceback); `/` would walk the whole filesystem
    (data / "root").symlink_to("/")
    (data / "gone.jsonl").symlink_to(open_dir / "absent.jsonl")  # a broken link: no load reads it
    elsewhere = open_dir / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "secret.jsonl").write_text("{}\n")
    (data / "linked").symlink_to(elsewhere)
    for path in (open_dir, data, data / "part", elsewhere):
        path.chmod(0o755)
    for path in (data / "part" / "a.jsonl", elsewhere / "secret.jsonl"):
        path.chmod(0o644)
    assert unreadable(data) is None
    with denied(elsewhere / "secret.jsonl"):
        assert unreadable(data) is None  # behind a symlinked directory: not entered
        assert unreadable(data / "linked").startswith(str(data / "linked" / "secret.jsonl"))  # the input itself is one
    with denied(data / "part"):
        why = unreadable(data)
    assert why is not None and why.startswith(f"{data / 'part'} cannot be read by this user")


def test_a_model_directory_is_checked_for_its_own_files_not_its_subdirectories(open_dir) -> None:
    model = open_dir / "model"
    (model / "old_checkpoints").mkdir(parents=True)
    (model / "model.safetensors").write_bytes(b"w")
    (model / "old_checkpoints" / "optimizer.pt").write_bytes(b"o")
    for path in (model, model / "old_checkpoints"):
        path.chmod(0o755)
    for path in (model / "model.safetensors", model / "old_checkpoints" / "optimizer.pt"):
        path.chmod(0o644)
    with denied(model / "old_checkpoints" / "optimizer.pt"):
        assert unreadable(model, recursive=False) is None  # from_pretrained reads none of it
        assert unreadable(model) is not None
    with denied(model / "model.safetensors"):
        assert unreadable(model, recursive=False).startswith(str(model / "model.safetensors"))


def test_a_directory_to_write_is_judged_without_raising(open_dir, tmp_path) -> None:
    from open_sft.file_modes import output_file_problem, writable_dir_problem

    (open_dir / "file").write_text("x")
    assert writable_dir_problem(open_dir / "new" / "dir") is None
    assert writable_dir_problem(open_dir / "file") == "it is a file, not a directory"
    assert writable_dir_problem(open_dir / "file" / "a" / "b").startswith(f"it lies under {open_dir / 'file'}")
    assert output_file_problem(open_dir) == "it is a directory; give the path of a file"
    private = open_dir / "private"
    private.mkdir(mode=0o700)
    with denied(private):  # a parent this user may not enter: os.stat raises EACCES
        assert writable_dir_problem(private / "cache").startswith("it cannot be reached (Permission denied")
