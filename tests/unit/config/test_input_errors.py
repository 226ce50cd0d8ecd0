"""Bad input → one clear message naming the file, line and fix; exit code 2; nothing written.

The tests of this subject that launch real processes are in tests/integration/test_input_errors.py.
"""

from __future__ import annotations

import json

import pytest

from open_sft.run import main


GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def write_lines(path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def run_main(capsys, model: str, data: str, output_dir) -> str:
    code = main(["--model_name_or_path", model, "--dataset_mixer_list", data, "1.0",
                 "--output_dir", str(output_dir), "--max_train_steps", "1"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert not output_dir.exists(), "a failed run must not leave files in --output_dir"
    return err


@pytest.mark.parametrize(
    "lines, expected",
    [
        ([json.dumps(GOOD), "{not json"], "bad.jsonl line 2: not valid JSON"),
        ([json.dumps(GOOD), json.dumps(GOOD), json.dumps({"text": "hello"})],
         "bad.jsonl line 3: row has no 'messages' (columns: ['text'])"),
        ([json.dumps({"body": "hello"})], "bad.jsonl line 1: cannot tell the data format from the columns ['body']"),
        ([json.dumps({"messages": [{"role": "gpt", "content": "x"}]})],
         "bad.jsonl line 1: message 1 has role 'gpt'; expected one of system, developer, user, assistant, tool"),
        ([json.dumps(GOOD), json.dumps({"messages": [{"role": "user", "content": "only a question"}]})],
         "bad.jsonl line 2: the conversation has no assistant turn (it ends with a user turn)"),
        ([json.dumps({"messages": "hello"})], "bad.jsonl line 1: 'messages' must be a non-empty list"),
        (["[1, 2]"], "bad.jsonl line 1: expected a JSON object, got list"),
        ([json.dumps(GOOD), json.dumps({"messages": [{"role": "gpt", "content": "x"}]}), json.dumps(GOOD), "{oops",
          json.dumps(GOOD)], "bad.jsonl line 4: not valid JSON"),  # a line that is not JSON is reported first
        ([json.dumps(GOOD), json.dumps(GOOD), json.dumps({"messages": [
            {"role": "user", "content": "add 1 and 2"}, {"role": "tool", "content": "3"},
            {"role": "assistant", "content": "3"}]})],  # the tiny model's own template has no tool role
         "bad.jsonl line 3: the chat template rejects this conversation (Unknown role: tool); fix the row"),
    ],
    ids=["malformed-json", "no-messages", "unknown-format", "bad-role", "ends-with-user", "messages-not-list",
         "not-object", "json-before-row-errors", "template-rejects-row"],
)
def test_bad_rows(tmp_path, capsys, tiny_model_dir, lines, expected) -> None:
    data = write_lines(tmp_path / "bad.jsonl", lines)
    err = run_main(capsys, str(tiny_model_dir), data, tmp_path / "out")
    assert expected in err


def test_missing_data_file(tmp_path, capsys, tiny_model_dir) -> None:
    err = run_main(capsys, str(tiny_model_dir), str(tmp_path / "nope.jsonl"), tmp_path / "out")
    assert "data file" in err and "nope.jsonl does not exist" in err


def test_an_unexpanded_glob_is_said_as_such_with_the_directory_instead(tmp_path, capsys, tiny_model_dir) -> None:
    """A quoted glob (or a YAML one) read 'data file DIR/*.jsonl does not exist; check the path'."""
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "a.jsonl").write_text(json.dumps(GOOD) + "\n")
    err = run_main(capsys, str(tiny_model_dir), str(tmp_path / "shards" / "*.jsonl"), tmp_path / "out")
    assert (f"--dataset_mixer_list: data file {tmp_path / 'shards' / '*.jsonl'} does not exist: a glob pattern is not "
            "expanded; give the directory that holds the files (all of them are read, one format), or each file "
            "with its own amount") in err
    err = run_main(capsys, str(tiny_model_dir), str(tmp_path / "shard_dir"), tmp_path / "out")  # said up front
    assert err.startswith("error: invalid configuration (1 problem(s)):\n  - --dataset_mixer_list: data directory "
                          f"{tmp_path / 'shard_dir'} does not exist; check the path"), err


def test_a_missing_data_file_is_said_with_the_flags_problems(tmp_path, capsys, tiny_model_dir) -> None:
    """A missing data file was said only after the other flags' problems were fixed (with a Hub problem: only it)."""
    code = main(["--model_name_or_path", str(tiny_model_dir), "--dataset_mixer_list", str(tmp_path / "nope.jsonl"),
                 "1.0", "--eval_dataset_mixer_list", str(tmp_path / "gone.json"), "10", "--push_to_hub",
                 "--output_dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "--push_to_hub" in err  # the hub's problems, and the files with them
    assert f"--dataset_mixer_list: data file {tmp_path / 'nope.jsonl'} does not exist; check the path" in err
    assert f"--eval_dataset_mixer_list: data file {tmp_path / 'gone.json'} does not exist" in err


def test_a_finished_run_is_relaunched_without_its_data_files(tmp_path, capsys, tiny_model_dir) -> None:
    """A requeue of a completed run reads no data: its data files gone (node-local scratch wiped) it still says
    'already complete' and exits 0, rather than stopping on the missing files."""
    from open_sft.config.parse import parse_config
    from open_sft.training import completion

    out = tmp_path / "out"
    argv = ["--model_name_or_path", str(tiny_model_dir), "--dataset_mixer_list", str(tmp_path / "gone.jsonl"), "1.0",
            "--output_dir", str(out)]
    out.mkdir()
    completion.mark_complete(out, 4, 1.0, parse_config(argv))
    assert main(argv) == 0 and f"already complete: {out}" in capsys.readouterr().out
    assert main(argv + ["--overwrite_output_dir"]) == 2  # training again needs them
    assert "gone.jsonl does not exist" in capsys.readouterr().err


def test_missing_model_path(tmp_path, capsys) -> None:
    data = write_lines(tmp_path / "ok.jsonl", [json.dumps(GOOD)])
    err = run_main(capsys, str(tmp_path / "no_model"), data, tmp_path / "out")
    assert "--model_name_or_path" in err and "no_model: no such directory; check the path" in err


def test_data_file_that_is_not_utf8(tmp_path, capsys, tiny_model_dir) -> None:
    data = tmp_path / "latin1.jsonl"
    data.write_bytes(json.dumps(GOOD).encode() + b"\n" + json.dumps(GOOD).replace("hello", "caf\u00e9").encode("latin1")
                     .replace(b"\\u00e9", b"\xe9") + b"\n")
    err = run_main(capsys, str(tiny_model_dir), str(data), tmp_path / "out")
    assert "latin1.jsonl line 2: not UTF-8 (byte 0xe9 at column" in err
    assert "iconv -f latin1 -t utf-8" in err


def test_ctrl_c_outside_the_training_loop_is_a_message_not_a_traceback(tmp_path, monkeypatch, capsys) -> None:
    """Ctrl-C while the model loads or the export is written (the training loop's own stop is graceful): exit 130
    and a line saying the same command resumes, not a KeyboardInterrupt traceback."""
    import open_sft.run as run_module

    def interrupted(config):
        raise KeyboardInterrupt

    monkeypatch.setattr(run_module, "run", interrupted)
    data = write_lines(tmp_path / "d.jsonl", [json.dumps(GOOD)])
    assert main(["--model_name_or_path", "m", "--dataset_mixer_list", data, "1.0"]) == 130
    err = capsys.readouterr().err
    assert "open_sft: interrupted (Ctrl-C); the same command starts again from where it can" in err and "Traceback" not in err


ONLY_A_QUESTION = {"messages": [{"role": "user", "content": "only a question"}]}
EMPTY_ANSWER = {"messages": [{"role": "user", "content": "say nothing"}, {"role": "assistant", "content": ""}]}
SKIP = "; --on_bad_row drop skips such rows (each counted in the data report)"


@pytest.mark.parametrize("name, text, expected", [
    ("d.jsonl", "\n".join([json.dumps(GOOD), json.dumps(ONLY_A_QUESTION)]),
     "d.jsonl line 2: the conversation has no assistant turn (it ends with a user turn); a training conversation "
     "needs one" + SKIP),
    ("d.jsonl", "\n".join([json.dumps(GOOD), json.dumps(EMPTY_ANSWER)]),
     "d.jsonl line 2: message 2 (assistant) is empty" + SKIP),
    ("d.jsonl", "\n".join([json.dumps(GOOD), "{not json"]), "d.jsonl line 2: not valid JSON"),
    ("d.json", json.dumps([GOOD, ONLY_A_QUESTION], indent=1),
     "d.json line 14: the conversation has no assistant turn (it ends with a user turn); a training conversation "
     "needs one" + SKIP),
    ("t.jsonl", "\n".join([json.dumps({"text": "a document"}), json.dumps({"text": ""})]),
     "t.jsonl line 2: 'text' is empty" + SKIP),
], ids=["no-assistant-turn", "empty-assistant-turn", "not-json", "json-list-file", "empty-text"])
def test_a_bad_row_stops_the_build_saying_how_to_skip_such_rows(tmp_path, capsys, tiny_model_dir, name, text,
                                                                 expected) -> None:
    """open-instruct's default sft_tulu_filter_v1 drops a conversation with no assistant turn unsaid (and trains an
    empty answer's eos): its users' data can hold rows open_sft stops at. The error named the row and the problem
    but not the way on; it now says --on_bad_row drop skips such rows, once (a problem that names it already keeps
    its own words)."""
    (tmp_path / name).write_text(text + "\n")
    err = run_main(capsys, str(tiny_model_dir), str(tmp_path / name), tmp_path / "out")
    assert expected in err and err.count("--on_bad_row drop") == 1, err


def test_a_bad_row_whose_problem_names_the_skip_says_it_once(tmp_path, capsys, tiny_model_dir) -> None:
    tool_row = {"messages": [{"role": "user", "content": "add 1 and 2"}, {"role": "tool", "content": "3"},
                             {"role": "assistant", "content": "3"}]}  # the tiny model's own template has no tool role
    data = write_lines(tmp_path / "d.jsonl", [json.dumps(GOOD), json.dumps(tool_row)])
    err = run_main(capsys, str(tiny_model_dir), data, tmp_path / "out")
    assert "d.jsonl line 2: the chat template rejects this conversation (Unknown role: tool)" in err
    assert err.count("--on_bad_row drop") == 1, err
