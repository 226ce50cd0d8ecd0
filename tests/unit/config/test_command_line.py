"""The command line read as written, or refused saying why: a list flag given twice kept only the last list
(`--dataset_mixer_list a 0.5 --dataset_mixer_list b 0.5` trained on b alone), and `finetune.py cfg.json` did not
say run configs are YAML."""

from __future__ import annotations

import pytest

from open_sft.config.parse import parse_config
from open_sft.errors import UserError

BASE = ["--model_name_or_path", "m", "--dataset_mixer_list", "a.jsonl", "1.0"]


@pytest.mark.parametrize("argv, said", [
    (["--model_name_or_path", "m", "--dataset_mixer_list", "a.jsonl", "0.5", "--dataset_mixer_list", "b.jsonl", "0.5"],
     "--dataset_mixer_list is given 2 times (a.jsonl 0.5; then b.jsonl 0.5): only the last would count"),
    (BASE + ["--report_to", "none", "--report-to", "wandb"], "--report_to is given 2 times (none; then wandb)"),
    (BASE + ["--report_to=tensorboard", "--report_to", "wandb"], "--report_to is given 2 times (tensorboard; then "
                                                                  "wandb)"),
])
def test_a_list_flag_given_twice_is_refused_naming_each_list(argv, said) -> None:
    with pytest.raises(UserError) as refused:
        parse_config(argv)
    assert said in str(refused.value) and "give each list flag once, with all its values after it" in str(refused.value)


def test_one_list_flag_and_repeated_single_value_flags_read_as_before(tmp_path) -> None:
    config = parse_config(["--model_name_or_path", "m", "--dataset_mixer_list", "a.jsonl", "0.5", "b.jsonl", "0.5",
                           "--seed", "1", "--seed", "2"])
    assert config.data.dataset_mixer_list == ["a.jsonl", "0.5", "b.jsonl", "0.5"] and config.train.seed == 2
    path = tmp_path / "run.yaml"  # a flag over the YAML's list replaces it (the YAML gives defaults)
    path.write_text("model_name_or_path: m\ndataset_mixer_list: [a.jsonl, 1.0]\n")
    assert parse_config([str(path), "--dataset_mixer_list", "b.jsonl", "1.0"]).data.dataset_mixer_list == \
        ["b.jsonl", "1.0"]


def test_a_run_config_that_is_not_yaml_is_said_to_be_so(tmp_path) -> None:
    path = tmp_path / "cfg.json"
    path.write_text("{}")
    with pytest.raises(UserError) as refused:
        parse_config([str(path), "--seed", "1"])
    assert str(refused.value) == (f"{path}: a run config is a YAML file (.yaml or .yml), given first; .json files are "
                                  "not read (a JSON object is YAML: rename it to cfg.yaml), or pass the settings as "
                                  "flags")
    with pytest.raises(UserError, match="unexpected argument\\(s\\) extra: every value follows a --flag"):
        parse_config(["extra", "--seed", "1"])
