"""Every command line reads its flags whole (open_sft.config.whole_flags): `open_sft compare A B --task t.jsonl` was
read as --tasks, `open_sft report OUT --hel` printed the help, while finetune.py refused the same prefixes; now each
tool refuses a shortened flag as finetune.py does, naming the flags it begins, before anything is read or written."""

from __future__ import annotations

import importlib
import re

import pytest

from conftest import ROOT, load_script
from open_sft.__main__ import COMMANDS, main
from open_sft.config.whole_flags import WholeFlagParser

SHORTENED = {  # command: (its arguments with one flag shortened, the error's flag part)
    "generate": (["MODEL", "--max_new", "3"], "--max_new (flags are not shortened: did you mean --max_new_tokens?)"),
    "chat": (["MODEL", "--sys", "be brief"], "--sys (flags are not shortened: did you mean --system?)"),
    "compare": (["BEFORE", "AFTER", "--task", "t.jsonl"], "--task (flags are not shortened: did you mean --tasks?)"),
    "export": (["CKPT", "OUT", "--save_d", "float32"],
               "--save_d (flags are not shortened: did you mean --save_dtype?)"),
    "push": (["OUT", "--hub_model", "org/m"], "--hub_model (flags are not shortened: did you mean --hub_model_id?)"),
    "merge-lora": (["ADAPTER", "OUT", "--dty", "float32"], "--dty (flags are not shortened: did you mean --dtype?)"),
    "report": (["OUT", "--hel"], "--hel (flags are not shortened: did you mean --help?)"),
    "model-card": (["OUT", "--hel"], "--hel (flags are not shortened: did you mean --help?)"),
    "embedded": (["OUT", "--vocab", "300"], "--vocab (flags are not shortened: did you mean --vocab_size?)"),
    "sample-data": (["OUT/rows.jsonl", "--se", "3"], "--se (flags are not shortened: did you mean --seed?)"),
}


def test_every_command_is_covered() -> None:
    assert set(SHORTENED) == set(COMMANDS)


@pytest.mark.parametrize("command", sorted(SHORTENED))
def test_each_command_refuses_a_shortened_flag_naming_it_before_doing_anything(command, tmp_path, capsys) -> None:
    args, said = SHORTENED[command]
    argv = [arg.replace("OUT", str(tmp_path / "out")) for arg in args]
    with pytest.raises(SystemExit) as exit_info:
        main([command, *argv])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines()[-1] == f"open_sft {command}: error: unknown flag {said}"
    assert captured.out == "" and list(tmp_path.iterdir()) == []


def _parser() -> WholeFlagParser:
    parser = WholeFlagParser(prog="tool")
    parser.add_argument("--model", required=True)
    parser.add_argument("--model_revision")
    parser.add_argument("--prompt")
    parser.add_argument("rest", nargs="*")
    return parser


def test_whole_flags_read_as_before_and_every_unknown_one_is_named_at_once(capsys) -> None:
    args = _parser().parse_args(["--model", "m", "--prompt=--mod", "--model_revision", "r", "x"])
    assert (args.model, args.prompt, args.model_revision, args.rest) == ("m", "--mod", "r", ["x"])
    assert _parser().parse_args(["--model=m", "--prompt", "--a value with spaces", "--", "--mod"]).rest == ["--mod"]
    with pytest.raises(SystemExit):  # (argparse alone: "the following arguments are required: --model")
        _parser().parse_args(["--mod", "m", "--promt", "p", "--zzz"])
    assert capsys.readouterr().err.splitlines()[-1] == (
        "tool: error: unknown flag --mod (flags are not shortened: did you mean --model or --model_revision?), "
        "--promt (did you mean --prompt?), --zzz")


def test_a_mistyped_flag_given_a_value_with_a_space_by_equals_is_refused(capsys) -> None:
    """`--outdir="my dir"` (no such flag: the shell passes `--outdir=my dir`) was read as a positional argument,
    the word holding a space; only a space before the `=` makes a word a value."""
    args = _parser().parse_args(["--model=my model", "--prompt", "--a b=c", "--model_revision=--x=a b"])
    assert (args.model, args.prompt, args.model_revision) == ("my model", "--a b=c", "--x=a b")
    with pytest.raises(SystemExit):
        _parser().parse_args(["--model", "m", "--outdir=my dir", "--a b=c"])
    assert capsys.readouterr().err.splitlines()[-1] == "tool: error: unknown flag --outdir"


def test_a_sub_commands_flags_are_its_own_parsers() -> None:
    parser = WholeFlagParser(prog="tool")
    sub = parser.add_subparsers(dest="command").add_parser("build")
    sub.add_argument("--out_dir")
    assert parser.parse_args(["build", "--out_dir", "d"]).out_dir == "d"
    with pytest.raises(SystemExit):
        parser.parse_args(["build", "--out", "d"])
    assert isinstance(sub, WholeFlagParser)


@pytest.mark.parametrize("parse, said", [
    (lambda: load_script("profile_step").main(["--st", "3", "--", "--model_name_or_path", "m"]),
     "error: unknown flag --st (flags are not shortened: did you mean --step?)"),
    (lambda: importlib.import_module("tests.gpu_check.cli").parse_args(["OUT", "--smo"]),
     "gpu_check.py: error: unknown flag --smo (flags are not shortened: did you mean --smoke?)"),
])
def test_the_scripts_users_run_refuse_a_shortened_flag(parse, said, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse()
    assert exit_info.value.code == 2 and capsys.readouterr().err.splitlines()[-1].endswith(said)


def test_no_command_line_is_built_on_a_plain_argument_parser() -> None:
    """Each parser users meet is a WholeFlagParser: one that is not would read prefixes again."""
    sources = [*(ROOT / "open_sft").rglob("*.py"), *(ROOT / "scripts").glob("*.py"),
               *(ROOT / "tests" / "gpu_check").rglob("*.py")]
    plain = [str(path.relative_to(ROOT)) for path in sources
             if re.search(r"ArgumentParser\(|allow_abbrev=True", path.read_text())]
    assert plain == []
