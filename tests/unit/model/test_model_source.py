"""Where the model and the tokenizer come from: a missing path, an empty or weights-only directory, a tokenizer.json
file and a Hub id offline are each named for what they are (transformers says "Repo id must be in the form ...",
"install sentencepiece" or "couldn't connect"): up front where the path alone tells, when the tokenizer loads
where a directory's contents do."""

from __future__ import annotations

import json

import pytest

from open_sft.config.args import ModelArguments
from open_sft.config.parse import parse_config
from open_sft.errors import ConfigError, UserError
from open_sft.model.tokenizer import load_tokenizer


def problems(tmp_path, *flags: str) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config([*flags, "--dataset_mixer_list", "a.jsonl", "1.0", "--output_dir", str(tmp_path / "out")])
    return str(info.value)


def tokenizer_error(model: str) -> str:
    with pytest.raises(UserError) as info:
        load_tokenizer(ModelArguments(model_name_or_path=model))
    return str(info.value)


def test_a_missing_path_that_is_no_hub_id_is_a_missing_directory(tmp_path) -> None:
    text = problems(tmp_path, "--model_name_or_path", "path/to/model")
    assert "--model_name_or_path path/to/model: no such directory (nor a Hub id, which reads ORG/NAME)" in text
    assert "Repo id" not in text


def test_an_empty_directory_holds_no_model_and_no_tokenizer(tmp_path) -> None:
    (tmp_path / "empty").mkdir()
    text = tokenizer_error(str(tmp_path / "empty"))
    assert f"{tmp_path / 'empty'} holds no model files (config.json, weights) and no tokenizer files" in text
    assert "sentencepiece" not in text


def test_a_weights_only_directory_names_the_tokenizer_flag(tmp_path) -> None:
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    text = tokenizer_error(str(tmp_path / "weights"))
    assert "weights holds no tokenizer files (tokenizer.json, tokenizer_config.json" in text
    assert "with --tokenizer_name_or_path" in text and "sentencepiece" not in text


def test_a_tokenizer_json_file_is_refused_for_its_directory(tmp_path, tiny_model_dir) -> None:
    text = problems(tmp_path, "--model_name_or_path", str(tiny_model_dir), "--tokenizer_name_or_path",
                    str(tiny_model_dir / "tokenizer.json"))
    assert (f"--tokenizer_name_or_path {tiny_model_dir / 'tokenizer.json'} is a file; --tokenizer_name_or_path "
            "takes the directory holding tokenizer.json, with a tokenizer_config.json naming eos_token") in text


def test_a_model_file_is_refused_once(tmp_path, tiny_model_dir) -> None:
    text = problems(tmp_path, "--model_name_or_path", str(tiny_model_dir / "config.json"))
    assert "config.json is a file; pass the directory holding the model's config.json and weights" in text
    assert text.count("is a file") == 1


def test_a_hub_id_offline_outside_the_cache_says_so() -> None:  # HF_HUB_OFFLINE=1 in tests/conftest.py
    text = tokenizer_error("open-sft-nobody/no-such-model")
    assert ("--model_name_or_path open-sft-nobody/no-such-model: no such local directory, and as a Hub id it is not "
            "in the local Hugging Face cache") in text and "HF_HUB_OFFLINE is set" in text


def test_a_lora_runs_output_is_named_as_an_adapter_with_the_way_on(tmp_path) -> None:
    """A LoRA run's output (adapter_config.json, no config.json) as the model to train from is refused up front,
    before any data is tokenized, as an adapter with the way on: its merged/ where the run wrote one, else open_sft
    merge-lora (it was 'could not load the model config (Unrecognized model ...)' after the data was tokenized)."""
    adapter = tmp_path / "lora_run"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tmp_path / "base")}))
    text = problems(tmp_path, "--model_name_or_path", str(adapter))
    assert (f"--model_name_or_path {adapter} is a LoRA adapter (adapter_config.json, no config.json), not a model to "
            f"fine-tune from; merge it into its base first, `python -m open_sft merge-lora {adapter} "
            f"{adapter}_merged`, and pass that directory") in text
    (adapter / "merged").mkdir()
    (adapter / "merged" / "config.json").write_text("{}")
    assert f"; pass its merged model, {adapter / 'merged'} (--merge_lora_on_save wrote it)" in problems(
        tmp_path, "--model_name_or_path", str(adapter))


def _copy_without(tiny_model_dir, target, *dropped: str):
    import shutil

    shutil.copytree(tiny_model_dir, target)
    for name in dropped:
        (target / name).unlink()
    return target


def test_a_model_directory_without_config_or_weights_is_refused_up_front(tmp_path, tiny_model_dir) -> None:
    """transformers said these after the data was tokenized, one of them wrongly ('Should have a `model_type` key in
    its config.json' of a directory without config.json); --cache_dataset_only reads neither, so neither is asked."""
    no_config = _copy_without(tiny_model_dir, tmp_path / "no_config", "config.json")
    assert (f"--model_name_or_path {no_config} holds no config.json (the model's architecture); pass the directory "
            "of a downloaded or exported model, or name its config with --config_name") in problems(
        tmp_path, "--model_name_or_path", str(no_config))
    no_weights = _copy_without(tiny_model_dir, tmp_path / "no_weights", "model.safetensors")
    assert (f"--model_name_or_path {no_weights} holds no weights (model.safetensors, pytorch_model.bin or their "
            "shards); copy or download them beside its config.json") in problems(
        tmp_path, "--model_name_or_path", str(no_weights))
    for model in (no_config, no_weights):
        assert parse_config(["--model_name_or_path", str(model), "--dataset_mixer_list", "a.jsonl", "1.0",
                             "--cache_dataset_only"]).data.cache_dataset_only
    config = parse_config(["--model_name_or_path", str(no_config), "--config_name", str(tiny_model_dir),
                           "--dataset_mixer_list", "a.jsonl", "1.0", "--output_dir", str(tmp_path / "out")])
    assert config.model.config_name == str(tiny_model_dir)  # weights here, config there: loadable
    (no_weights / "pytorch_model-00001-of-00002.bin").write_bytes(b"")  # any shard counts
    assert parse_config(["--model_name_or_path", str(no_weights), "--dataset_mixer_list", "a.jsonl", "1.0",
                         "--output_dir", str(tmp_path / "out")]).model.model_name_or_path == str(no_weights)


def test_a_checkpoint_or_an_unexported_run_is_refused_with_the_export_command(tmp_path, tiny_model_dir) -> None:
    run = _copy_without(tiny_model_dir, tmp_path / "run", "config.json", "model.safetensors")
    for step in (5, 10, 40):
        (run / "checkpoints" / f"step_{step}").mkdir(parents=True)
        (run / "checkpoints" / f"step_{step}" / "model.safetensors").write_bytes(b"")
    for step in (5, 10):  # step_40 is incomplete (a kill while saving)
        (run / "checkpoints" / f"step_{step}" / "COMPLETE").write_text("{}")
    step_10 = run / "checkpoints" / "step_10"
    assert (f"--model_name_or_path {run} is a run's output directory from which no model was exported yet; export "
            f"its newest complete checkpoint, `python -m open_sft export {step_10} OUT`, and pass OUT") in problems(
        tmp_path, "--model_name_or_path", str(run))
    assert (f"--model_name_or_path {step_10} is a training checkpoint, not a model; export it first, `python -m "
            f"open_sft export {step_10} OUT`, and pass OUT") in problems(tmp_path, "--model_name_or_path", str(step_10))


def test_a_model_no_causal_lm_class_builds_is_named_with_its_type(tmp_path) -> None:
    """Qwen3-VL (a vision-language model AutoModelForCausalLM does not build) was refused with transformers' list of
    every config class it knows, some 200 names, and advice to check the path, which was right."""
    import torch
    from transformers import AutoConfig

    from open_sft.config.args import ModelArguments
    from open_sft.errors import UserError
    from open_sft.model.load import _from_pretrained

    AutoConfig.for_model("qwen3_vl", text_config={"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
                                                  "num_hidden_layers": 2, "num_attention_heads": 4,
                                                  "num_key_value_heads": 2, "head_dim": 8},
                         vision_config={"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                                        "out_hidden_size": 32}).save_pretrained(tmp_path)
    with pytest.raises(UserError) as refused:
        _from_pretrained(ModelArguments(model_name_or_path=str(tmp_path)), None, torch.float32)
    assert str(refused.value) == (
        f"--model_name_or_path {tmp_path}: transformers has no causal-LM class for model type 'qwen3_vl' "
        "(AutoModelForCausalLM does not build a Qwen3VLConfig: a vision-language, speech or encoder model); open_sft "
        "trains the models AutoModelForCausalLM loads")
