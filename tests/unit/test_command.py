"""`open_sft <command>`: one entry to the side tools, with the old `python -m open_sft.<module>` paths kept."""

from __future__ import annotations

import importlib

import pytest

from open_sft.__main__ import COMMANDS, main


def test_usage_lists_every_command(capsys) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in COMMANDS) and "finetune.py --help" in out
    assert main([]) == 2  # no command: the usage, and a failing exit for scripts


def test_unknown_command_names_the_choices(capsys) -> None:
    assert main(["merge"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'merge'" in err and "merge-lora" in err


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_command_runs_its_module_under_its_own_name(command, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: open_sft {command} ")


def test_model_card_of_a_directory_without_a_run_is_a_clear_error(tmp_path, capsys) -> None:
    assert main(["model-card", str(tmp_path)]) == 2
    assert f"{tmp_path / 'run.json'} not found" in capsys.readouterr().err


@pytest.mark.parametrize("old, command", [("push", "push"), ("generate", "generate"), ("report", "report"),
                                          ("model_card", "model-card"), ("lora", "merge-lora")])
def test_old_module_paths_forward_to_the_command(old, command, monkeypatch) -> None:
    """`python -m open_sft.lora merge A B` → `open_sft merge-lora A B`, and so on."""
    import open_sft.__main__ as entry

    seen = []
    monkeypatch.setattr(entry, "main", lambda argv: seen.append(argv) or 0)
    old_args = ["merge", "a", "b"] if old == "lora" else ["a", "b"]
    monkeypatch.setattr("sys.argv", [f"open_sft/{old}.py", *old_args])
    module = importlib.import_module(f"open_sft.{old}")
    with pytest.raises(SystemExit) as exit_info:
        entry.forward(command, drop="merge" if old == "lora" else None)
    assert exit_info.value.code == 0 and seen == [[command, "a", "b"]]
    assert f"open_sft {command}" in module.__doc__


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("{}\n")
    return path


def _adapter(tmp_path):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"base_model_name_or_path": "/nonexistent/base"}')
    return adapter


def test_output_paths_that_cannot_be_written_are_named_before_any_work(tmp_path, a_file, capsys) -> None:
    """A file where a directory goes, a path under a file, a directory where a file goes: one error: line, exit 2,
    before a model loads (FileExistsError, NotADirectoryError, IsADirectoryError tracebacks before)."""
    cases = {
        ("merge-lora", str(_adapter(tmp_path)), str(a_file)):
            f"error: {a_file}: it is a file, not a directory; pass a directory for the merged model",
        ("compare", "before", "after", "--tasks", str(a_file), "--json", str(a_file / "x.json")):
            f"error: --json {a_file / 'x.json'}: its directory {a_file}: it is a file, not a directory",
        ("sample-data", str(a_file / "x.jsonl")):
            f"error: {a_file / 'x.jsonl'}: its directory {a_file}: it is a file, not a directory",
        ("sample-data", str(tmp_path)): f"error: {tmp_path}: it is a directory; give the path of a file",
        ("embedded", str(a_file)): f"error: {a_file}: it is a file, not a directory; give a directory for the model",
    }
    for argv, message in cases.items():
        assert main(list(argv)) == 2, argv
        assert message in capsys.readouterr().err, argv
    assert a_file.read_text() == "{}\n"


def test_merge_lora_names_a_base_model_that_does_not_load(tmp_path, capsys) -> None:
    adapter = _adapter(tmp_path)
    assert main(["merge-lora", str(adapter), str(tmp_path / "out"), "--base_model", str(tmp_path / "nonexist")]) == 2
    assert (f"error: --base_model {tmp_path / 'nonexist'} cannot be loaded here (no such directory); pass "
            "--base_model PATH_OR_ID") in capsys.readouterr().err
    assert main(["merge-lora", str(adapter), str(tmp_path / "out")]) == 2  # the adapter's own base: named so
    assert f"{adapter} is a LoRA adapter on /nonexistent/base, which cannot be loaded here" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_generate_refuses_a_negative_score_sample_before_loading(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", str(tmp_path / "no_model"), "--score_sample", "-1"])
    assert exit_info.value.code == 2
    assert "error: --score_sample must be 0 or more (a number of sample tasks), got -1" in capsys.readouterr().err


def test_side_commands_name_a_path_that_holds_no_adapter_or_no_tokenizer(tmp_path, capsys) -> None:
    """merge-lora of a path that does not exist, or of a full model, said 'ADAPTER/adapter_config.json not found';
    generate of a directory without tokenizer files said transformers' 'install sentencepiece or tiktoken'."""
    full = tmp_path / "full"
    full.mkdir()
    (full / "config.json").write_text('{"model_type": "llama"}')
    (full / "model.safetensors").write_bytes(b"")
    assert main(["merge-lora", str(tmp_path / "nope"), str(tmp_path / "out")]) == 2
    assert f"error: {tmp_path / 'nope'} does not exist; pass the --output_dir of a" in capsys.readouterr().err
    assert main(["merge-lora", str(full), str(tmp_path / "out")]) == 2
    assert f"{full} holds a full model (config.json), not a LoRA adapter: nothing to merge" in capsys.readouterr().err
    assert main(["generate", str(full), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert f"error: {full} holds no tokenizer files (tokenizer.json, tokenizer_config.json" in err
    assert "sentencepiece" not in err


def test_merge_lora_says_only_its_own_lines(tiny_model_dir, tmp_path, capfd) -> None:
    """A redirected `open_sft merge-lora` printed transformers' 'Loading weights' progress bar and the FutureWarning
    about `is_gradient_checkpointing` that peft's own call raises: the model commands quiet them as a run does."""
    import warnings

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    adapter = tmp_path / "adapter"
    config = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), config).save_pretrained(adapter)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (adapter / name).write_bytes((tiny_model_dir / name).read_bytes())
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert main(["merge-lora", str(adapter), str(tmp_path / "merged"), "--dtype", "float32"]) == 0
    out, err = capfd.readouterr()
    assert (tmp_path / "merged" / "model.safetensors").is_file()
    assert "Loading weights" not in out + err and "is_gradient_checkpointing" not in out + err
    assert not [w for w in seen if "is_gradient_checkpointing" in str(w.message)]
    assert out.strip().splitlines()[-1].endswith("merged")
