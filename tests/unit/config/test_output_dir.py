"""--output_dir checked up front against what the run would write over: its own inputs (the base model, the
tokenizer, a dataset, the tokenization cache)."""

from __future__ import annotations

import pytest

from open_sft.config.parse import parse_config
from open_sft.errors import ConfigError


def _model_dir(path):
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"weights")
    return path


def test_an_output_dir_that_is_or_holds_an_input_is_refused(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("OPEN_SFT_CACHE", str(tmp_path / "cache"))
    base = _model_dir(tmp_path / "base")
    data = tmp_path / "data.jsonl"
    data.write_text('{"messages": []}\n')
    flags = ["--model_name_or_path", str(base), "--dataset_mixer_list", str(data), "1.0"]
    for out in (str(base), str(base) + "/", str(tmp_path / "base" / ".." / "base")):
        with pytest.raises(ConfigError, match=r"--output_dir .*base/? is --model_name_or_path .*base: the run writes "
                                              r"its model there .* give another --output_dir"):
            parse_config(flags + ["--output_dir", out])
    tokenizer = _model_dir(tmp_path / "runs" / "tok")
    with pytest.raises(ConfigError, match=r"--output_dir .*runs holds --tokenizer_name_or_path .*tok"):
        parse_config(flags + ["--tokenizer_name_or_path", str(tokenizer), "--output_dir", str(tmp_path / "runs")])
    with pytest.raises(ConfigError, match=r"is --config_name"):
        parse_config(flags + ["--config_name", str(tokenizer), "--output_dir", str(tokenizer)])
    # --overwrite_output_dir does not make an input writable
    with pytest.raises(ConfigError, match=r"is --model_name_or_path"):
        parse_config(flags + ["--output_dir", str(base), "--overwrite_output_dir"])
    # a base model's directory may hold the run's (nothing of the base is written over)
    assert parse_config(flags + ["--output_dir", str(base / "sft")])


def test_an_output_dir_at_a_dataset_or_the_cache_is_refused(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("OPEN_SFT_CACHE", str(tmp_path / "cache"))
    dataset = tmp_path / "ds"
    dataset.mkdir()
    (dataset / "train.jsonl").write_text('{"messages": []}\n')
    flags = ["--model_name_or_path", "org/model", "--dataset_mixer_list", str(dataset), "1.0"]
    with pytest.raises(ConfigError, match=r"--output_dir .*ds is --dataset_mixer_list .*ds"):
        parse_config(flags + ["--output_dir", str(dataset)])
    with pytest.raises(ConfigError, match=r"--output_dir .*ds/out lies inside the dataset directory "
                                          r"--dataset_mixer_list .*ds: the run's files there .* read as data"):
        parse_config(flags + ["--output_dir", str(dataset / "out")])
    with pytest.raises(ConfigError, match=r"--output_dir .* holds --eval_dataset_mixer_list .*eval.jsonl"):
        (tmp_path / "o").mkdir()
        (tmp_path / "o" / "eval.jsonl").write_text('{"messages": []}\n')
        parse_config(flags + ["--eval_dataset_mixer_list", str(tmp_path / "o" / "eval.jsonl"), "1.0",
                              "--output_dir", str(tmp_path / "o"), "--overwrite_output_dir"])
    for out in (tmp_path / "cache", tmp_path / "cache" / "run"):
        with pytest.raises(ConfigError, match=r"the tokenization cache \(OPEN_SFT_CACHE .*cache\)"):
            parse_config(flags + ["--output_dir", str(out)])
    monkeypatch.delenv("OPEN_SFT_CACHE")
    with pytest.raises(ConfigError, match=r"--output_dir .*c2 is the tokenization cache \(--dataset_local_cache_dir"):
        parse_config(flags + ["--dataset_local_cache_dir", str(tmp_path / "c2"), "--output_dir", str(tmp_path / "c2")])
    assert parse_config(flags + ["--dataset_local_cache_dir", str(tmp_path / "c2"), "--output_dir",
                                 str(tmp_path / "c2"), "--dataset_skip_cache"])  # no cache is written
    # --dry_run and --cache_dataset_only write nothing there
    assert parse_config(flags + ["--output_dir", str(dataset), "--dry_run"])
    assert parse_config(flags + ["--output_dir", str(tmp_path / "run")])


def test_a_directory_with_files_but_no_open_sft_run_needs_overwrite_output_dir(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("OPEN_SFT_CACHE", str(tmp_path / "cache"))
    flags = ["--model_name_or_path", "org/model", "--dataset_mixer_list", "a.jsonl", "1.0"]
    theirs = tmp_path / "project"
    (theirs / "merged").mkdir(parents=True)
    for name in ("README.md", "config.json", "notes.txt"):
        (theirs / name).write_text("mine")
    with pytest.raises(ConfigError, match=r"--output_dir .*project already exists and holds files a run writes "
                                          r"\(README.md, config.json, merged\) but no open_sft run .* pass "
                                          r"--overwrite_output_dir to write into it anyway"):
        parse_config(flags + ["--output_dir", str(theirs)])
    # the job's own log, redirected there before the run starts (`> OUT/train.log`, SLURM's --output): no clash
    logged = tmp_path / "logged"
    logged.mkdir()
    (logged / "train.log").write_text("starting\n")
    (logged / "slurm-123.out").write_text("")
    assert parse_config(flags + ["--output_dir", str(logged)])
    assert parse_config(flags + ["--output_dir", str(theirs), "--overwrite_output_dir"])
    for writes_nothing_there in ("--dry_run", "--cache_dataset_only"):
        assert parse_config(flags + ["--output_dir", str(theirs), writes_nothing_there])
    # new, empty (a fresh volume's lost+found aside), or an open_sft run's: each written first by some run
    empty = tmp_path / "empty"
    (empty / "lost+found").mkdir(parents=True)
    assert parse_config(flags + ["--output_dir", str(empty)])
    assert parse_config(flags + ["--output_dir", str(tmp_path / "new")])
    for marker in (".open_sft.lock", "metrics.jsonl", "run.json", "RUN_COMPLETE", "checkpoints/",
                   "checkpoints.previous-1/"):
        run = tmp_path / marker.strip("/").replace(".", "_")
        run.mkdir()
        (run / "notes.txt").write_text("a user's note beside a run")
        (run / marker).mkdir() if marker.endswith("/") else (run / marker).write_text("{}")
        assert parse_config(flags + ["--output_dir", str(run)]), marker


def test_an_empty_output_dir_is_refused(tmp_path, monkeypatch) -> None:
    """`--output_dir ""` wrote the run into the current directory (a project's README.md became the model card)."""
    monkeypatch.chdir(tmp_path)
    flags = ["--model_name_or_path", "org/model", "--dataset_mixer_list", "a.jsonl", "1.0"]
    for empty in ("", " "):
        for extra in ([], ["--overwrite_output_dir"], ["--dry_run"]):
            with pytest.raises(ConfigError, match=r"--output_dir is empty: it would be the current directory.* give "
                                                  r"a directory of its own"):
                parse_config(flags + ["--output_dir", empty, *extra])
    assert parse_config(flags + ["--output_dir", "run"])


def test_an_output_dir_this_process_may_write_but_not_read_is_refused_not_crashed(tmp_path, monkeypatch) -> None:
    """A write-only directory (mode 0333: `ls` is denied) made the emptiness check crash with a PermissionError
    traceback; a read-only filesystem went on to fail at the first write. Both are one line naming the flag."""
    import os
    import shutil
    import tempfile
    from pathlib import Path

    from open_sft.config.output_dir import output_dir_problems

    monkeypatch.setenv("OPEN_SFT_CACHE", str(tmp_path / "cache"))
    shared = Path(tempfile.mkdtemp(prefix="open_sft_outdir_"))  # pytest's tmp_path is 0700: another user stops there
    try:
        shared.chmod(0o755)
        out = shared / "run"
        config = parse_config(["--model_name_or_path", "org/model", "--dataset_mixer_list", "a.jsonl", "1.0",
                               "--output_dir", str(out)])
        out.mkdir(mode=0o333)
        out.chmod(0o333)
        as_nobody = os.geteuid() == 0  # root reads every directory: judge it as another user
        if as_nobody:
            os.chown(out, 65534, 65534)
            os.seteuid(65534)
        try:
            problems = output_dir_problems(config)
        finally:
            if as_nobody:
                os.seteuid(0)
        assert problems == [f"--output_dir {out}: no permission to read it (a run lists what it holds before "
                            "writing there); give a directory you can read and write (it is created if missing)"]
    finally:
        shutil.rmtree(shared, ignore_errors=True)
