"""Bad input → one clear message naming the file, line and fix; exit code 2; nothing written. Under a launcher the
message is also the last thing printed: the root cause of torchrun's closing summary.

(Its fast in-process tests are in tests/unit/config/test_input_errors.py.)
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import FINETUNE, ROOT, SAMPLE, child_env, launch_command


GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def write_lines(path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.mark.parametrize("args, env, expected", [
    (["--learning_rat", "1e-4", "--learnin_rate_x", "1"], {},
     "error: unknown flag --learning_rat (flags are not shortened: did you mean --learning_rate?), --learnin_rate_x "
     "(did you mean --learning_rate?)"),
    (["--chat_templ", "tulu"], {}, "error: unknown flag --chat_templ (flags are not shortened: did you mean "
                                   "--chat_template_name or --chat_template_path or --chat_template_kwargs?)"),
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


def test_under_accelerate_launch_our_error_is_the_root_cause_printed_last(tmp_path, tiny_model_dir) -> None:
    """2 ranks under `accelerate launch`, and a flag value found wrong only once the data is built and the model
    loaded (LoRA target modules the model does not have): torchrun's summary, the end of the output, names our
    one-line error as the root cause with our exit code 2 (not "To enable traceback see ..." after a traceback
    of the launcher), the ranks leave 2 as their code, and nothing is written."""
    codes = tmp_path / "codes"
    codes.mkdir()
    args = ["--model_name_or_path", str(tiny_model_dir), "--dataset_mixer_list", str(SAMPLE), "64",
            "--output_dir", str(tmp_path / "out"), "--max_train_steps", "2", "--max_seq_length", "128",
            "--use_lora", "--lora_target_modules", "no_such_proj"]
    result = subprocess.run(launch_command(2, None) + args, cwd=ROOT, env=child_env(OPEN_SFT_EXIT_CODE_DIR=str(codes)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert result.returncode != 0  # torchrun's own code; the ranks' are below and in its summary
    message = ("error: --lora_target_modules no_such_proj: Target modules {'no_such_proj'} not found in the base "
               "model")
    lines = [line.strip() for line in result.stdout.splitlines() if line.strip()]
    assert lines[-1].strip("=") == "" and lines[-2].startswith(f"traceback : {message}"), "\n".join(lines[-12:])
    root = lines[max(i for i, line in enumerate(lines) if line == "Root Cause (first observed failure):"):]
    assert "exitcode  : 2 (pid:" in " ".join(root) and "To enable traceback" not in result.stdout
    assert sum(line.startswith(message) for line in lines) == 1  # printed once, by the main process
    # rank 0's code is 2; rank 1 left 2 too unless the launcher stopped it first (torchrun ends the others); the
    # message beside each code is what scripts/launch_multinode.sh prints last
    assert (codes / "rank0").read_text().strip() == "2" and (codes / "rank0.message").read_text().startswith(message)
    assert {p.read_text().strip() for p in codes.iterdir() if not p.suffix} == {"2"}
    assert not (tmp_path / "out").exists()
