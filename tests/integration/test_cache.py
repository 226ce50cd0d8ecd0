"""The tokenization cache: key sensitivity, hits that never tokenize, races, crashes and damage.

(Its fast in-process tests are in tests/unit/data/test_cache.py.)
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import datasets
import pytest

from conftest import ROOT, SAMPLE, child_env
from open_sft.run import main


@pytest.fixture()
def data_file(tmp_path):
    path = tmp_path / "data.jsonl"
    shutil.copy(SAMPLE, path)
    return path


RACE = """
import json, sys
from transformers import AutoTokenizer
from open_sft.config.args import DataArguments
from open_sft.data.prepare import prepare_data
tok = AutoTokenizer.from_pretrained(sys.argv[1])
data = prepare_data(DataArguments(dataset_mixer_list=[sys.argv[2], "0.5"], dataset_local_cache_dir=sys.argv[3]), tok, 3)
print(json.dumps({"hit": data.cache_hit, "path": str(data.cache_path),
                  "digest": hash(str(data.dataset["input_ids"]) + str(data.dataset["labels"]))}))
"""


def test_two_processes_racing_build_once(tiny_model_dir, data_file, tmp_path) -> None:
    cache_dir = tmp_path / "race"
    env = child_env(PYTHONHASHSEED="0")
    env.pop("OPEN_SFT_CACHE")
    procs = [subprocess.Popen([sys.executable, "-c", RACE, str(tiny_model_dir), str(data_file), str(cache_dir)],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(r["hit"] for r in results) == [False, True]  # one built, the other waited and loaded
    assert results[0]["path"] == results[1]["path"] and results[0]["digest"] == results[1]["digest"]
    assert [p.name for p in cache_dir.iterdir() if not p.name.endswith(".lock")] == [results[0]["path"].split("/")[-1]]


def test_cache_dataset_only(tiny_model_dir, data_file, tmp_path, capsys) -> None:
    output_dir = tmp_path / "out"
    code = main(["--model_name_or_path", str(tiny_model_dir), "--dataset_mixer_list", str(data_file), "0.1",
                 "--dataset_local_cache_dir", str(tmp_path / "c"), "--cache_dataset_only", "--output_dir", str(output_dir)])
    assert code == 0
    out = capsys.readouterr().out
    last = out.strip().splitlines()[-1]
    assert "data report" in out and json.loads((Path(last) / "report.json").read_text())["sources"][0]["rows_kept"] == 200
    loaded = datasets.load_from_disk(last)
    assert {"input_ids", "labels"} <= set(loaded.column_names) and len(loaded) == 200
    assert not output_dir.exists()
