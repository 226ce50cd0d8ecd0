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
