"""Evaluation through finetune.py, the ways a user asks for it: a separate eval mixture every --eval_steps
(one process, and 2 ranks under ZeRO-3 with the same global batch), and a held-out split at the end.

Token-weighted across ranks: the 2-rank ZeRO-3 run counts every eval token once and reports the eval loss of
the 1-process run (their training losses agree by the token-normalised loss, so their weights do)."""

from __future__ import annotations

import json

import pytest

from conftest import SAMPLE, read_metrics, run_finetune

STEPS = 6


def _args(model_dir, output_dir, micro_batch: int, accumulation: int, *extra: str) -> list[str]:
    return ["--model_name_or_path", str(model_dir), "--dataset_mixer_list", str(SAMPLE), "0.05",
            "--output_dir", str(output_dir), "--max_train_steps", str(STEPS), "--logging_steps", "1",
            "--per_device_train_batch_size", str(micro_batch), "--gradient_accumulation_steps", str(accumulation),
            "--learning_rate", "3e-3", "--seed", "3", "--torch_dtype", "float32", "--max_seq_length", "256", *extra]


EVAL_LIST = ("--eval_dataset_mixer_list", str(SAMPLE), "61", "--eval_steps", "3", "--per_device_eval_batch_size", "5")


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory) -> dict:
    layouts = {"list_single": (1, None, 4, 2, EVAL_LIST), "list_zero3": (2, "zero3.json", 2, 2, EVAL_LIST),
               "split": (1, None, 4, 2, ("--eval_split_ratio", "0.1"))}
    out = {}
    for name, (processes, ds_config, micro, accumulation, extra) in layouts.items():
        output_dir = tmp_path_factory.mktemp(name)
        run_finetune(_args(tiny_model_dir, output_dir, micro, accumulation, *extra), processes=processes,
                     deepspeed_config=ds_config)
        metrics = read_metrics(output_dir)
        out[name] = {"train": [m for m in metrics if "loss" in m], "eval": [m for m in metrics if "eval_loss" in m],
                     "dir": output_dir}
    return out


@pytest.mark.parametrize("name", ["list_single", "list_zero3"])
def test_eval_mixture_every_eval_steps(runs, name) -> None:
    evals = runs[name]["eval"]
    assert [e["step"] for e in evals] == [3, 6]
    assert all(e["eval_tokens"] > 0 and 0 < e["eval_loss"] < 20 for e in evals)
    assert evals[1]["eval_loss"] < evals[0]["eval_loss"]  # it learns the task it is evaluated on
    assert [t["step"] for t in runs[name]["train"]] == list(range(1, STEPS + 1))  # training lines unchanged


def test_two_ranks_under_zero3_evaluate_what_one_process_does(runs) -> None:
    single, zero3 = runs["list_single"]["eval"], runs["list_zero3"]["eval"]
    assert [e["eval_tokens"] for e in zero3] == [e["eval_tokens"] for e in single]  # 61 rows over 2 ranks, once
    for one, two in zip(single, zero3):
        assert two["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-4)


def test_held_out_split_is_evaluated_at_the_end(runs) -> None:
    evals = runs["split"]["eval"]
    assert [e["step"] for e in evals] == [STEPS] and evals[0]["eval_tokens"] > 0


def test_the_evaluation_mixture_is_reported_beside_the_training_one(runs) -> None:
    """data_report.json has the eval mixture's own report (rows in, selected, kept, dropped per source; under
    --eval_split_ratio the rows held out: 10 % of the sample's 2,000) and run.json its cache key."""
    for name, held, trained in (("list_single", 61, 100), ("split", 200, 90)):
        report = json.loads((runs[name]["dir"] / "data_report.json").read_text())
        (source,) = report["eval"]["sources"]
        assert source["rows_selected"] == held and source["examples"] + sum(source["rows_dropped"].values()) == held
        # the training side as before: 0.05 of the 2,000 rows, of the 1,800 not held out under the split
        assert report["sources"][0]["rows_selected"] == trained
        key = json.loads((runs[name]["dir"] / "run.json").read_text())["eval_dataset_cache_key"]
        assert len(key) == 64 and key != json.loads((runs[name]["dir"] / "run.json").read_text())["dataset_cache_key"]

