"""Bad input → one clear message naming the file, line and fix; exit code 2; nothing written."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import FINETUNE, ROOT, child_env
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
         "bad.jsonl line 1: message 1 has role 'gpt'; expected one of system, user, assistant, tool"),
        ([json.dumps(GOOD), json.dumps({"messages": [{"role": "user", "content": "only a question"}]})],
         "bad.jsonl line 2: the conversation ends with a user turn; it must end with an assistant turn"),
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


def test_missing_model_path(tmp_path, capsys) -> None:
    data = write_lines(tmp_path / "ok.jsonl", [json.dumps(GOOD)])
    err = run_main(capsys, str(tmp_path / "no_model"), data, tmp_path / "out")
    assert "--model_name_or_path" in err and "no_model: no such file or directory" in err


def test_data_file_that_is_not_utf8(tmp_path, capsys, tiny_model_dir) -> None:
    data = tmp_path / "latin1.jsonl"
    data.write_bytes(json.dumps(GOOD).encode() + b"\n" + json.dumps(GOOD).replace("hello", "caf\u00e9").encode("latin1")
                     .replace(b"\\u00e9", b"\xe9") + b"\n")
    err = run_main(capsys, str(tiny_model_dir), str(data), tmp_path / "out")
    assert "latin1.jsonl line 2: not UTF-8 (byte 0xe9 at column" in err
    assert "iconv -f latin1 -t utf-8" in err


@pytest.mark.parametrize("args, env, expected", [
    (["--learning_rat", "1e-4", "--learnin_rate_x", "1"], {},
     "error: unknown flag --learnin_rate_x (did you mean --learning_rate?)"),
    (["--chat_templ", "tulu"], {}, "error: ambiguous option: --chat_templ could match --chat_template_name, "
                                   "--chat_template, --chat_template_path; write the whole flag name"),
    (["--per_device_train_batch_size", "two"], {}, "error: argument --per_device_train_batch_size"),
    (["--clip_grad_norm", "1.0"], {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": "DS_JSON"},
     "error: DeepSpeed config DS_JSON: gradient_clipping=0.3 conflicts with --clip_grad_norm 1.0; set it to \"auto\""),
    ([], {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_MIXED_PRECISION": "fp16"},
     "error: accelerate's mixed_precision=fp16 is not supported with --torch_dtype auto"),
])
def test_command_line_mistakes_are_one_error_line(tmp_path, tiny_model_dir, args, env, expected) -> None:
    """No traceback for a user's mistake: one `error:` line on stderr, exit 2, nothing written."""
    ds_json = tmp_path / "ds.json"
    ds_json.write_text(json.dumps({"zero_optimization": {"stage": 2}, "gradient_clipping": 0.3}))
    data = write_lines(tmp_path / "ok.jsonl", [json.dumps(GOOD)] * 3)
    env = {k: v.replace("DS_JSON", str(ds_json)) for k, v in env.items()}
    result = subprocess.run([sys.executable, str(FINETUNE), "--model_name_or_path", str(tiny_model_dir),
                             "--dataset_mixer_list", data, "1.0", "--output_dir", str(tmp_path / "out"), *args],
                            cwd=ROOT, env=child_env(**env), capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith(expected.replace("DS_JSON", str(ds_json))), result.stderr
    assert not (tmp_path / "out").exists()


def test_exit_code_from_the_command_line(tmp_path, tiny_model_dir) -> None:
    data = write_lines(tmp_path / "bad.jsonl", [json.dumps(GOOD), "{oops"])
    result = subprocess.run([sys.executable, str(FINETUNE), "--model_name_or_path", str(tiny_model_dir),
                             "--dataset_mixer_list", data, "1.0", "--output_dir", str(tmp_path / "out")],
                            cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "bad.jsonl line 2: not valid JSON" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()
