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


def test_a_key_given_twice_is_refused_with_both_lines(tmp_path) -> None:
    """PyYAML keeps the last of two learning_rate lines without a word (the run trained with 2e-4)."""
    from open_sft.errors import UserError

    with pytest.raises(UserError) as info:
        _parse(tmp_path, "dataset_mixer_list: [a.jsonl, '1.0']\nlearning_rate: 1.0e-4\nnum_train_epochs: 1\n"
                         "learning_rate: 2.0e-4\n")
    assert str(info.value) == (f"{tmp_path / 'run.yaml'} line 5: learning_rate is given again (first on line 3); "
                               "YAML would keep the last without a word: keep one")
    with pytest.raises(UserError, match=r"run.yaml line 4: a.jsonl is given again \(first on line 3\)"):
        _parse(tmp_path, "dataset_mixer_list:\n  a.jsonl: 1.0\n  a.jsonl: 0.5\n")
    # a merge key's settings may be overridden, as YAML means: no repeat
    _, config = _parse(tmp_path, "dataset_mixer_list: [a.jsonl, '1.0']\nadditional_model_arguments:\n"
                                 "  <<: {attention_dropout: 0.1, rope_theta: 1000.0}\n  attention_dropout: 0.2\n")
    assert "attention_dropout: 0.2" in config.model.additional_model_arguments


@pytest.mark.parametrize("argv, which", [
    (["SECOND"], "a second one"),
    (["--report_to", "none", "SECOND"], "one given after a flag: it was read as a value of --report_to"),
    (["--dataset_mixer_list", "b.jsonl", "1.0", "SECOND"],
     "one given after a flag: it was read as a value of --dataset_mixer_list"),
    (["--learning_rate", "1e-4", "SECOND"], "one given after a flag"),
])
def test_a_run_config_that_is_not_the_first_argument_is_named_as_such(tmp_path, argv, which) -> None:
    """It read as a stray value (`--report_to none run.yaml: give one or more of tensorboard, ...`), a mixer list
    of three values, or a second config 'of .yaml files, which are not read: rename it to second.yaml'."""
    from open_sft.errors import UserError

    first, second = tmp_path / "run.yaml", tmp_path / "second.yaml"
    first.write_text("model_name_or_path: org/model\ndataset_mixer_list: [a.jsonl, '1.0']\n")
    second.write_text("learning_rate: 1.0e-4\n")
    with pytest.raises(UserError) as info:
        parse_config([str(first), *[str(second) if arg == "SECOND" else arg for arg in argv]])
    assert str(info.value) == (f"{second}: a run config is read only as the first argument (python finetune.py "
                               f"run.yaml --flag value ...), and this is {which}; give it first, and one only (merge "
                               "the settings of two into one file, or pass them as flags)")


def test_a_switch_given_no_truth_value_in_yaml_is_refused_with_the_others(tmp_path) -> None:
    """`use_lora: 2` was kept as the int 2 (the switch's --no_use_lora action, which converts nothing, was the one
    consulted), and `packing: maybe` was refused alone by argparse without the file's name."""
    with pytest.raises(ConfigError) as info:
        _parse(tmp_path, "dataset_mixer_list: [a.jsonl, '1.0']\nuse_lora: 2\npacking: maybe\n")
    path = tmp_path / "run.yaml"
    assert [problem.split(" (")[0] for problem in info.value.problems] == [
        f"{path}: use_lora: 2 is not a valid value", f"{path}: packing: 'maybe' is not a valid value"]
    _, config = _parse(tmp_path, "dataset_mixer_list: [a.jsonl, '1.0']\nuse_lora: 'false'\npacking: 1\n")
    assert config.lora.use_lora is False and config.train.packing is True
