"""--max_shard_size is judged up front, with the forms it takes, not by the exporter after all the training."""

from __future__ import annotations

import pytest
from huggingface_hub.serialization._base import parse_size_to_int

from open_sft.config.parse import parse_config
from open_sft.errors import ConfigError
from open_sft.export.shard_size import shard_size_problem


@pytest.mark.parametrize("value", ["5GB", "500MB", "0.5GB", "100kb", " 2 TB", 1000])
def test_what_is_accepted_the_exporter_reads(value) -> None:
    assert shard_size_problem(value) is None
    if isinstance(value, str):
        assert parse_size_to_int(value) > 0


@pytest.mark.parametrize("value", ["bogus", "5GiB", "1000000", "5 G", "", "0GB", "-1MB", "nanGB"])
def test_what_is_refused_names_the_value_and_the_forms(value) -> None:
    why = shard_size_problem(value)
    assert why is not None and why.startswith(repr(value)) and "5GB, 500MB, 0.5GB" in why


def test_the_flag_is_refused_before_the_run(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"--max_shard_size 'bogus' is not a size; give a number and a unit"):
        parse_config(["--model_name_or_path", "org/model", "--dataset_mixer_list", "a.jsonl", "1.0",
                      "--output_dir", str(tmp_path / "out"), "--max_shard_size", "bogus"])
