"""Flags that act only beside another flag, given without it, are never silently ignored: `--lora_rank 8` alone ran
a full fine-tune, `--hub_model_id` alone uploaded nothing, `--eval_steps` without evaluation data evaluated nothing,
and `--additional_model_arguments '{"nosuch_attr": 3}'` (or a misspelled key) changed nothing, all without a word."""

from __future__ import annotations

import pytest

from open_sft.config.args import ModelArguments
from open_sft.config.parse import parse_config
from open_sft.errors import ConfigError, UserError

BASE = ["--model_name_or_path", "org/model", "--dataset_mixer_list", "a.jsonl", "1.0"]


def test_lora_target_modules_without_lora_is_refused() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(BASE + ["--lora_target_modules", "q_proj", "v_proj"])
    assert info.value.problems == [
        "--lora_target_modules q_proj v_proj chooses what LoRA adapts, but neither --use_lora nor --use_qlora is "
        "given: the run would fine-tune the whole model. Add --use_lora (or --use_qlora), or drop "
        "--lora_target_modules"]
    assert parse_config(BASE + ["--use_lora", "--lora_target_modules", "q_proj"]).warnings == ()


def test_open_instructs_lora_flags_without_lora_are_warned_about() -> None:
    warnings = parse_config(BASE + ["--lora_rank", "8", "--lora_dropout", "0.05"]).warnings
    assert warnings == ("--lora_rank 8, --lora_dropout 0.05 set up LoRA, but neither --use_lora nor --use_qlora is "
                        "given: this run fine-tunes the whole model and ignores --lora_rank --lora_dropout. Add "
                        "--use_lora (or --use_qlora) to train LoRA adapters",)
    assert parse_config(BASE + ["--use_lora", "--lora_rank", "8"]).warnings == ()
    # open-instruct's dumped configs carry the defaults with use_lora false
    assert parse_config(BASE + ["--lora_rank", "64", "--lora_alpha", "16", "--lora_dropout", "0.1"]).warnings == ()


def test_hub_settings_without_a_push_are_warned_about(monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    warnings = parse_config(BASE + ["--hub_model_id", "o/m"]).warnings
    assert len(warnings) == 1 and warnings[0].startswith("--hub_model_id without --push_to_hub: nothing is uploaded")
    assert "python -m open_sft push OUTPUT_DIR --hub_model_id o/m" in warnings[0]
    assert "--hub_model_id o/m" in parse_config(BASE + ["--hf_entity", "o", "--hf_repo_id", "m"]).warnings[0]
    assert parse_config(BASE + ["--hub_model_id", "o/m", "--push_to_hub"]).warnings == ()
    # open-instruct's --hf_entity named --hub_model_id: the warning names the flag the user gave
    entity = parse_config(BASE + ["--hf_entity", "allenai"]).warnings[0]
    assert entity.startswith("--hf_entity (naming --hub_model_id allenai/open_sft) without --push_to_hub")
    assert parse_config(BASE + ["--hub_model_id", "o/m", "--no_push_to_hub"]).warnings == ()


def test_eval_steps_without_evaluation_data_is_refused() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(BASE + ["--eval_steps", "10"])
    assert info.value.problems == ["--eval_steps 10 evaluates held-out data, and there is none: add "
                                   "--eval_dataset_mixer_list NAME AMOUNT or --eval_split_ratio R (e.g. 0.02), or drop "
                                   "--eval_steps"]
    assert parse_config(BASE + ["--eval_steps", "10", "--eval_split_ratio", "0.1"])
    assert parse_config(BASE + ["--eval_steps", "10", "--eval_dataset_mixer_list", "b.jsonl", "1.0"])


@pytest.mark.parametrize("overrides, message", [
    ('{"nosuch_attr": 3}', "--additional_model_arguments: 'nosuch_attr' is not a LlamaConfig setting; transformers "
                           "would ignore it"),
    ('{"num_hidden_layer": 3}', "'num_hidden_layer' is not a LlamaConfig setting (did you mean 'num_hidden_layers'?)"),
    ('{"rope_theta": 500000}', "'rope_theta' is not a LlamaConfig setting; it is part of rope_parameters: give "
                               "'{\"rope_parameters\": {..., \"rope_theta\": VALUE}}'"),
    ('{"rope_thetta": 5}', "'rope_thetta' is not a LlamaConfig setting; did you mean 'rope_theta'? it is part of "
                           "rope_parameters"),
])
def test_a_model_config_override_the_config_lacks_is_refused_with_the_nearest_setting(tiny_model_dir, overrides,
                                                                                       message) -> None:
    from open_sft.model.load import load_model_config

    with pytest.raises(UserError) as refused:
        load_model_config(ModelArguments(model_name_or_path=str(tiny_model_dir), additional_model_arguments=overrides))
    assert message in str(refused.value)
    config = load_model_config(ModelArguments(model_name_or_path=str(tiny_model_dir),
                                              additional_model_arguments='{"max_position_embeddings": 96}'))
    assert config.max_position_embeddings == 96
