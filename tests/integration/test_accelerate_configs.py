"""Every way users configure DeepSpeed through accelerate: an `accelerate config` YAML without a JSON,
`accelerate launch` flags alone, and a Trainer-style JSON with optimizer/scheduler sections.

The decisions are unit-tested on the environment accelerate hands its workers; real 2-rank runs through
each style must give the per-step losses of the JSON path (configs/ds/zero2.json) tested in test_e2e.

(Its fast in-process tests are in tests/unit/config/test_accelerate_configs.py.)
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from conftest import (DS_CONFIGS, FINETUNE, ROOT, SAMPLE, TRAINER_JSON, child_env, free_port, read_metrics,
                      side_by_side)


ACCELERATE_CONFIGS = ROOT / "configs" / "accelerate"


STEPS = 6


STYLES = {  # name: accelerate launch arguments
    "json_zero2": ["--use_deepspeed", "--deepspeed_config_file", str(DS_CONFIGS / "zero2.json"),
                   "--mixed_precision", "no"],
    "yaml_zero2": ["--config_file", str(ACCELERATE_CONFIGS / "deepspeed_zero2.yaml")],
    "yaml_zero3_offload": ["--config_file", str(ACCELERATE_CONFIGS / "deepspeed_zero3_offload.yaml")],
    "flags_zero3": ["--use_deepspeed", "--zero_stage", "3", "--mixed_precision", "no"],
    "trainer_json_zero3": ["--use_deepspeed", "--deepspeed_config_file", "TRAINER_JSON", "--mixed_precision", "no"],
}


@pytest.fixture(scope="module")
def style_runs(tiny_model_dir, tmp_path_factory) -> dict:
    trainer_json = tmp_path_factory.mktemp("trainer") / "ds_trainer.json"
    trainer_json.write_text(json.dumps(TRAINER_JSON))

    def launch(name: str, launch_args: list[str]) -> dict:
        output_dir = tmp_path_factory.mktemp(name)
        launch_args = [str(trainer_json) if a == "TRAINER_JSON" else a for a in launch_args]
        cmd = [sys.executable, "-m", "accelerate.commands.launch", *launch_args, "--num_processes", "2",
               "--num_machines", "1", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
               str(FINETUNE), "--model_name_or_path", str(tiny_model_dir), "--dataset_mixer_list", str(SAMPLE),
               "1.0", "--output_dir", str(output_dir), "--max_train_steps", str(STEPS),
               "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", "--learning_rate",
               "3e-3", "--logging_steps", "1", "--seed", "1", "--torch_dtype", "float32", "--max_seq_length", "256"]
        result = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"{name}:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
        return {"stdout": result.stdout, "metrics": read_metrics(output_dir),
                "run": json.loads((output_dir / "run.json").read_text())}

    return side_by_side({name: lambda n=name, a=args: launch(n, a) for name, args in STYLES.items()}, processes=2)


@pytest.mark.parametrize("name", [n for n in STYLES if n != "json_zero2"])
def test_each_style_trains_the_same_losses_as_the_json_path(style_runs, name) -> None:
    reference = [m["loss"] for m in style_runs["json_zero2"]["metrics"]]
    losses = [m["loss"] for m in style_runs[name]["metrics"]]
    assert len(losses) == STEPS and reference[0] - reference[-1] > 0.3
    assert losses == pytest.approx(reference, rel=1e-5)


def test_run_json_records_what_each_style_resolved_to(style_runs) -> None:
    yaml_run = style_runs["yaml_zero3_offload"]["run"]
    zero = yaml_run["deepspeed_config"]["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_param"]["device"] == "cpu"
    assert zero["offload_optimizer"]["device"] == "cpu" and zero["stage3_gather_16bit_weights_on_model_save"]
    assert yaml_run["deepspeed_config"]["gradient_accumulation_steps"] == 2  # the flag, over the YAML's 1
    assert yaml_run["deepspeed_config"]["bf16"]["enabled"] is False  # --torch_dtype float32 over bf16
    assert yaml_run["launch"]["accelerate_deepspeed_settings"]["zero3_init_flag"] is True
    assert any("--gradient_accumulation_steps 2 wins" in d for d in yaml_run["launch"]["decisions"])
    assert "--gradient_accumulation_steps 2 wins over accelerate's" in style_runs["yaml_zero3_offload"]["stdout"]
    assert style_runs["flags_zero3"]["run"]["deepspeed_config"]["zero_optimization"]["stage"] == 3
    assert style_runs["yaml_zero2"]["run"]["deepspeed_config"]["zero_optimization"]["stage"] == 2
    trainer = style_runs["trainer_json_zero3"]
    assert "optimizer" not in trainer["run"]["deepspeed_config"]
    assert trainer["stdout"].count("replaced by open_sft's AdamW") == 1  # logged once, by rank 0


def test_zero3_init_loads_partitioned_and_trains_the_same(tiny_model_dir, tmp_path) -> None:
    """ZeRO-3 with zero3_init (the model loaded under deepspeed.zero.Init, each rank holding about half of
    it) and without (loaded whole, partitioned at prepare): the same losses and bit-identical saved
    weights, with a template whose special tokens grow the embeddings (resized and mean-initialised while
    partitioned)."""

    def launch(init: str) -> tuple:
        output_dir = tmp_path / init
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--use_deepspeed", "--zero_stage", "3",
               "--zero3_init_flag", init, "--mixed_precision", "no", "--num_processes", "2", "--num_machines", "1",
               "--dynamo_backend", "no", "--main_process_port", str(free_port()), str(FINETUNE),
               "--model_name_or_path", str(tiny_model_dir), "--dataset_mixer_list", str(SAMPLE), "1.0",
               "--output_dir", str(output_dir), "--max_train_steps", "4", "--per_device_train_batch_size", "2",
               "--learning_rate", "3e-3", "--logging_steps", "1", "--seed", "1", "--torch_dtype", "float32",
               "--max_seq_length", "256", "--chat_template_name", "chatml"]
        result = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"{init}:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
        return result.stdout + result.stderr, read_metrics(output_dir), output_dir

    runs = side_by_side({init: lambda i=init: launch(i) for init in ("true", "false")}, processes=2)
    import re

    from safetensors.torch import load_file

    held = re.search(r"this rank holds (\d+) of its (\d+) partitioned parameters; (\d+) parameters made after "
                     r"loading \(resized embeddings\) are whole until training starts", runs["true"][0])
    assert held and 0.4 < int(held[1]) / int(held[2]) < 0.6, runs["true"][0][-3000:]
    assert int(held[3]) % (1088 * 64) == 0 and int(held[3]) > 0  # the grown embedding rows × hidden 64
    assert "this rank holds" not in runs["false"][0]
    assert [m["loss"] for m in runs["true"][1]] == pytest.approx([m["loss"] for m in runs["false"][1]], rel=1e-6)
    partitioned, whole = (load_file(runs[k][2] / "model.safetensors") for k in ("true", "false"))
    assert partitioned["model.embed_tokens.weight"].shape[0] > 1024  # grown for <|im_start|>, <|im_end|>
    assert all(torch.equal(partitioned[k], whole[k]) for k in whole) and partitioned.keys() == whole.keys()
    for init in ("true", "false"):
        run = json.loads((runs[init][2] / "run.json").read_text())
        assert run["launch"]["zero3_init"] is (init == "true")
