"""The README's YAML example, run as a new user runs it from a fresh clone: in a directory holding only what a
clone has (configs/, the package with its bundled data), build the model the YAML names with the README's
command, then train with the YAML and a flag overriding it (a few steps here: --max_train_steps)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

from conftest import FINETUNE, ROOT, child_env


def test_readme_yaml_example_runs_from_a_fresh_clone(tmp_path) -> None:
    clone = tmp_path / "clone"
    shutil.copytree(ROOT / "configs", clone / "configs")
    shutil.copytree(ROOT / "open_sft", clone / "open_sft", ignore=shutil.ignore_patterns("__pycache__"))
    readme = (ROOT / "README.md").read_text()
    build = "python -m open_sft embedded .demo/tiny_base --hidden_size 128 --num_layers 4"
    train = "python finetune.py configs/examples/tiny.yaml --learning_rate 1e-4"
    assert build in readme and train in readme  # the commands tested are the README's
    env = child_env()
    subprocess.run([sys.executable, *build.split()[1:]], cwd=clone, env=env, check=True, capture_output=True,
                   timeout=300)
    result = subprocess.run([sys.executable, str(FINETUNE), *train.split()[2:], "--max_train_steps", "3",
                             "--logging_steps", "1"], cwd=clone, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    out = clone / ".demo" / "output_yaml"
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    args = json.loads((out / "run.json").read_text())["args"]
    assert args["train"]["learning_rate"] == 1e-4 and args["model"]["model_name_or_path"] == ".demo/tiny_base"
