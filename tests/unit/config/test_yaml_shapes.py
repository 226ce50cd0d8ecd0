"""A YAML value of the wrong shape for its flag (a string where a list belongs, a list where one value does) is a
ConfigError naming the file and key and showing the form to write; open-instruct's mapping form of a mixer list
is read as its dataset_mixer is."""

from __future__ import annotations

import pytest

from open_sft.config.parse import parse_config
from open_sft.errors import ConfigError


def _parse(tmp_path, text: str):
    path = tmp_path / "run.yaml"
    path.write_text("model_name_or_path: org/model\n" + text)
    return path, parse_config([str(path)])


@pytest.mark.parametrize("value", ["data.jsonl 1.0", "data.jsonl", "3"])
def test_a_mixer_list_given_as_a_string_is_named_with_the_list_form(tmp_path, value) -> None:
    with pytest.raises(ConfigError) as info:
        _parse(tmp_path, f"dataset_mixer_list: {value}\n")
    message = str(info.value)
    assert "run.yaml: dataset_mixer_list is the" in message and "not a list" in message
    assert "`dataset_mixer_list: [" in message and "{data.jsonl: 1.0}" in message
    if value == "data.jsonl 1.0":
        assert '`dataset_mixer_list: [data.jsonl, "1.0"]`' in message


def test_a_mixer_list_given_as_a_mapping_is_read_as_open_instructs_dataset_mixer(tmp_path) -> None:
    _, config = _parse(tmp_path, "dataset_mixer_list: {a.jsonl: 1, b.jsonl: 0.5, c.jsonl: 100}\n"
                                 "eval_dataset_mixer_list: {e.jsonl: 1.0}\n")
    assert config.data.dataset_mixer_list == ["a.jsonl", "1.0", "b.jsonl", "0.5", "c.jsonl", "100"]
    assert config.data.eval_dataset_mixer_list == ["e.jsonl", "1.0"]


def test_every_shape_mismatch_is_reported_at_once(tmp_path) -> None:
    with pytest.raises(ConfigError) as info:
        _parse(tmp_path, "dataset_mixer_list: [a.jsonl, '1.0']\n"
                         "learning_rate: [1.0e-4, 2.0e-4]\n"
                         "output_dir: {a: 1}\n"
                         "lora_target_modules: q_proj v_proj\n"
                         "dataset_mixer_list_splits: [[train]]\n"
                         "per_device_train_batch_size: many\n")
    problems = info.value.problems
    assert len(problems) == 5, problems
    assert all(p.startswith(str(tmp_path / "run.yaml")) for p in problems)
    text = "\n".join(problems)
    assert "learning_rate takes one value, got a list" in text
    assert "output_dir takes one value, got a mapping" in text
    assert "`lora_target_modules: [q_proj, v_proj]`" in text
    assert "dataset_mixer_list_splits: the item ['train'] is not a plain value" in text
    assert "per_device_train_batch_size: 'many' is not a valid value" in text


def test_one_word_for_a_list_flag_is_a_list_of_one(tmp_path) -> None:
    _, config = _parse(tmp_path, "dataset_mixer_list: [a.jsonl, '1.0']\nlora_target_modules: all-linear\n"
                                 "dataset_mixer_list_splits: train\n")
    assert config.lora.lora_target_modules == ["all-linear"]
    assert config.data.dataset_mixer_list_splits == ["train"]


def test_open_instructs_ignored_settings_are_not_judged(tmp_path) -> None:
    """A setting open_sft ignores (oe_eval_tasks: AI2's evaluation jobs) keeps whatever shape its YAML gave it."""
    _, config = _parse(tmp_path, "dataset_mixer_list: [a.jsonl, '1.0']\noe_eval_tasks: mmlu:mc::tulu,gsm8k::tulu\n"
                                 "oe_eval_max_length: [4096]\n")
    assert config.data.dataset_mixer_list == ["a.jsonl", "1.0"]
