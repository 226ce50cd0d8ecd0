"""Bad input → one clear message naming the file, line and fix; exit code 2; nothing written.

(Its fast in-process tests are in tests/unit/config/test_input_errors.py.)
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import FINETUNE, ROOT, child_env


GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def write_lines(path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.mark.parametrize("args, env, expected", [
    (["--learning_rat", "1e-4", "--learnin_rate_x", "1"], {},
     "error: unknown flag --learnin_rate_x (did you mean --learning_rate?)"),
    (["--chat_templ", "tulu"], {}, "error: ambiguous option: --chat_templ could match --chat_template_name, "
                                   "--chat_template, --chat_template_path; write the whole flag name"),
    (["--per_device_train_batch_size", "two"], {}, "error: argument --per_device_train_batch_size"),
    (["--clip_grad_norm", "1.0"], {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": "DS_JSON"},
     "error: DeepSpeed config DS_JSON: gradient_clipping=0.3 conflicts with --clip_grad_norm 1.0; set it to \"auto\""),
    ([], {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_MIXED_PRECISION": "fp8"},
     "error: accelerate's mixed_precision=fp8 is not supported with --torch_dtype auto"),
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
