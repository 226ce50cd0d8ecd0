"""The model card of a LoRA run and of its merged/ model: `base_model` in the front matter (a Hub id: the one the
run was given, or the one a Hub cache snapshot path stands for; a plain local directory is named in the text, as
the Hub takes only ids there), the adapter's settings as adapter_config.json has them, and the epochs the run
really trained (a 6-step run of a 2-epoch request)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

from conftest import SAMPLE, read_metrics, run_finetune
from open_sft.export.model_card import main as model_card_main

HUB_ID = "open-sft/tiny-base"
SNAPSHOT = "0123456789abcdef0123456789abcdef01234567"
STEPS, BATCH, ROWS = 6, 8, 2000  # 6 × 8 of 2,000 rows: 0.024 epochs of the 2 --num_train_epochs asks for


def hub_cache_with(model_dir: Path, cache: Path) -> Path:
    """`cache` laid out as huggingface_hub's cache holding `model_dir` as HUB_ID (loadable offline); returns the
    snapshot directory."""
    repo = cache / f"models--{HUB_ID.replace('/', '--')}"
    shutil.copytree(model_dir, repo / "snapshots" / SNAPSHOT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SNAPSHOT)
    return repo / "snapshots" / SNAPSHOT


@pytest.fixture(scope="module")
def hub_lora_run(tiny_model_dir, tmp_path_factory) -> dict:
    """A LoRA run (--merge_lora_on_save) of the tiny model given by its Hub id, from a Hub cache, offline."""
    cache = tmp_path_factory.mktemp("hub_cache")
    snapshot = hub_cache_with(tiny_model_dir, cache)
    out = tmp_path_factory.mktemp("card_lora")
    before = os.environ.get("HF_HUB_CACHE")
    os.environ["HF_HUB_CACHE"] = str(cache)  # the run's environment (conftest.child_env copies it)
    try:
        run_finetune(["--model_name_or_path", HUB_ID, "--dataset_mixer_list", str(SAMPLE), "1.0",
                      "--output_dir", str(out), "--max_train_steps", str(STEPS), "--learning_rate", "1e-2",
                      "--logging_steps", "2", "--max_seq_length", "128", "--per_device_train_batch_size", str(BATCH),
                      "--torch_dtype", "float32", "--use_lora", "--lora_rank", "4", "--lora_alpha", "8",
                      "--lora_dropout", "0.05", "--lora_target_modules", "q_proj", "v_proj", "--merge_lora_on_save"])
    finally:
        if before is None:
            os.environ.pop("HF_HUB_CACHE")
        else:
            os.environ["HF_HUB_CACHE"] = before
    return {"out": out, "snapshot": snapshot}


def split_card(path: Path) -> tuple[dict, str]:
    """(front matter as YAML reads it, the Markdown after it)."""
    text = path.read_text()
    assert text.startswith("---\n")
    front, body = text[4:].split("\n---\n", 1)
    return yaml.safe_load(front), body


def assert_adapter_and_epochs(body: str, out: Path) -> None:
    """The adapter's rows are adapter_config.json's; the epochs are the ones trained, not the ones asked for."""
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"], adapter["lora_dropout"]) == (4, 8, 0.05)
    assert sorted(adapter["target_modules"]) == ["q_proj", "v_proj"]
    for row in ("| type | LoRA |", f"| base model | `{HUB_ID}` |", "| rank (r) | 4 |", "| alpha | 8.0 |",
                "| dropout | 0.05 |", "| target modules | q_proj, v_proj |"):
        assert row in body, row
    last = read_metrics(out)[-1]
    assert (last["step"], last["epoch"]) == (STEPS, STEPS * BATCH / ROWS)
    assert f"Trained for {last['epoch']:g} epochs ({STEPS} optimizer steps)." in body
    assert f"| epochs trained | {last['epoch']:g} |" in body
    assert f"| num_train_epochs | 2 (not reached: --max_train_steps {STEPS} ended the run) |" in body
    assert "| num_train_epochs | 2 |" not in body


def test_lora_card_names_its_base_adapter_and_epochs_trained(hub_lora_run) -> None:
    out = hub_lora_run["out"]
    front, body = split_card(out / "README.md")
    assert front == {"library_name": "peft", "tags": ["open_sft", "sft", "lora"], "base_model": HUB_ID}
    assert body.startswith(f"# {out.name}\n\nA LoRA adapter for `{HUB_ID}`")
    assert "or use `merged/`" in body and "local directory" not in body
    assert_adapter_and_epochs(body, out)


def test_merged_model_has_a_card_of_its_own(hub_lora_run) -> None:
    out = hub_lora_run["out"]
    front, body = split_card(out / "merged" / "README.md")
    assert front == {"library_name": "transformers", "tags": ["open_sft", "sft", "lora"], "base_model": HUB_ID}
    assert body.startswith(f"# {out.name}/merged\n\n`{HUB_ID}` fine-tuned with LoRA, the adapter merged into its "
                           "weights: a full model")
    assert_adapter_and_epochs(body, out)
    assert "| source | format |" in body and "## Final metrics" in body  # the run's data and metrics too


def test_card_of_a_local_base_and_of_a_hub_cache_path(hub_lora_run, tiny_model_dir, tmp_path) -> None:
    """Regenerated (`open_sft model-card`) for a copy whose adapter names another base: a plain local directory
    is said in the text, with no `base_model` the Hub would refuse; a Hub cache snapshot path stands for its id.
    Without metrics.jsonl the epochs come from run.json's schedule."""
    copy = tmp_path / "run"
    shutil.copytree(hub_lora_run["out"], copy, ignore=shutil.ignore_patterns("checkpoints", "*.safetensors"))
    adapter = json.loads((copy / "adapter_config.json").read_text())
    for base, expected in ((str(tiny_model_dir), None), (str(hub_lora_run["snapshot"]), HUB_ID)):
        adapter["base_model_name_or_path"] = base
        (copy / "adapter_config.json").write_text(json.dumps(adapter))
        assert model_card_main([str(copy)]) == 0
        for card in (copy / "README.md", copy / "merged" / "README.md"):
            front, body = split_card(card)
            assert front.get("base_model") == expected and f"| base model | `{base}` |" in body
            assert ("is a local directory, not a Hugging Face Hub id" in body) == (expected is None)
    (copy / "metrics.jsonl").unlink()
    assert model_card_main([str(copy)]) == 0
    _, body = split_card(copy / "README.md")
    schedule = json.loads((copy / "run.json").read_text())["schedule"]
    assert (schedule["total_steps"], schedule["steps_per_epoch"]) == (STEPS, ROWS // BATCH)
    assert f"Trained for {STEPS * BATCH / ROWS:g} epochs ({STEPS} optimizer steps)." in body
