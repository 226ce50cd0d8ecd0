"""Per-source loss through finetune.py: a 2-source mixture in which one source is trivially learnable (the
assistant always gives the same answer) and the other is real instructions.

- the learnable source's loss falls far below the other's;
- in every logging window the token-weighted mean of the per-source losses is the logged `loss`, and the
  per-source trained tokens add up to the window's trained tokens (eval likewise);
- 2 ranks under ZeRO-2 with the same global batch log the per-source losses of one process within 1e-6 (the
  sums are all-reduced: each token is counted once), padded and packed;
- TensorBoard gets them as train/loss/<source>, and the report draws loss_by_source.png.
"""

from __future__ import annotations

import json

import pytest

from conftest import SAMPLE, assert_png, read_metrics, run_finetune, side_by_side

STEPS = 24
NAMES = ("usual", "sample")


def _easy_source(path) -> str:
    with path.open("w") as handle:
        for i in range(200):
            handle.write(json.dumps({"messages": [
                {"role": "user", "content": f"Reply with the usual answer, please ({i})."},
                {"role": "assistant", "content": "Yes yes yes yes yes yes yes yes yes yes."}]}) + "\n")
    return str(path)


def _args(model_dir, easy: str, output_dir, micro: int, accumulation: int, lr: str, *extra: str) -> list[str]:
    return ["--model_name_or_path", str(model_dir), "--dataset_mixer_list", easy, "1.0", str(SAMPLE), "0.05",
            "--output_dir", str(output_dir), "--max_train_steps", str(STEPS), "--logging_steps", "4",
            "--per_device_train_batch_size", str(micro), "--gradient_accumulation_steps", str(accumulation),
            "--learning_rate", lr, "--seed", "3", "--torch_dtype", "float32", "--max_seq_length", "256",
            "--eval_split_ratio", "0.1", "--eval_steps", "12", *extra]


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory) -> dict:
    easy = _easy_source(tmp_path_factory.mktemp("data") / "usual.jsonl")
    # A high learning rate shows learning within 24 steps; the layout comparisons use a low one, under which one
    # process and 2 ranks (fp32, different reduction orders) stay on the same trajectory to the end.
    layouts = {"single": (1, None, 4, 2, "1e-2", ("--with_tracking", "--report_to", "tensorboard")),
               "packed_single": (1, None, 4, 2, "1e-2", ("--packing",)),
               "slow_single": (1, None, 4, 2, "1e-3", ()),
               "slow_zero2": (2, "zero2.json", 2, 2, "1e-3", ()),
               # packed: 4 micro-batches of 512 tokens per step in both layouts, so the plans are the same
               "slow_packed_single": (1, None, 4, 4, "1e-3", ("--packing", "--max_tokens_per_batch", "512")),
               "slow_packed_zero2": (2, "zero2.json", 2, 2, "1e-3", ("--packing", "--max_tokens_per_batch", "512"))}

    def launch(name: str) -> dict:
        processes, ds_config, micro, accumulation, lr, extra = layouts[name]
        output_dir = tmp_path_factory.mktemp(name)
        run_finetune(_args(tiny_model_dir, easy, output_dir, micro, accumulation, lr, *extra), processes=processes,
                     deepspeed_config=ds_config)
        metrics = read_metrics(output_dir)
        return {"dir": output_dir, "train": [m for m in metrics if "loss" in m],
                "eval": [m for m in metrics if "eval_loss" in m]}

    out = {name: launch(name) for name, layout in layouts.items() if layout[0] == 1}
    return {**out, **side_by_side({name: lambda n=name: launch(n) for name, layout in layouts.items()
                                   if layout[0] == 2}, processes=2)}


@pytest.mark.parametrize("name", ["single", "packed_single"])
def test_the_learnable_source_is_learned_and_the_other_is_not(runs, name) -> None:
    first, last = runs[name]["train"][0], runs[name]["train"][-1]
    assert last["loss/usual"] < 0.25 * last["loss/sample"]
    assert last["loss/usual"] < first["loss/usual"] / 5
    assert runs[name]["eval"][-1]["eval_loss/usual"] < 0.25 * runs[name]["eval"][-1]["eval_loss/sample"]


@pytest.mark.parametrize("name", ["single", "slow_zero2", "packed_single", "slow_packed_zero2"])
def test_per_source_losses_weighted_by_tokens_are_the_logged_loss(runs, name) -> None:
    train_tokens = 0
    for record in runs[name]["train"]:
        tokens = [record[f"tokens/{s}"] for s in NAMES]
        assert all(t > 0 for t in tokens) and all(f"loss/{s}" in record for s in NAMES)
        assert sum(tokens) == record["train_tokens"] - train_tokens  # the window's trained tokens
        train_tokens = record["train_tokens"]
        weighted = sum(record[f"loss/{s}"] * record[f"tokens/{s}"] for s in NAMES) / sum(tokens)
        assert weighted == pytest.approx(record["loss"], rel=1e-6)
    assert [e["step"] for e in runs[name]["eval"]] == [12, 24]
    for record in runs[name]["eval"]:
        tokens = [record[f"eval_tokens/{s}"] for s in NAMES]
        assert sum(tokens) == record["eval_tokens"]
        weighted = sum(record[f"eval_loss/{s}"] * record[f"eval_tokens/{s}"] for s in NAMES) / sum(tokens)
        assert weighted == pytest.approx(record["eval_loss"], rel=1e-6)


@pytest.mark.parametrize("one, two", [("slow_single", "slow_zero2"), ("slow_packed_single", "slow_packed_zero2")])
def test_two_ranks_log_the_per_source_losses_of_one_process(runs, one, two) -> None:
    for kind in ("train", "eval"):
        for a, b in zip(runs[one][kind], runs[two][kind], strict=True):
            keys = sorted(k for k in a if "/" in k)
            assert keys == sorted(k for k in b if "/" in k) and keys
            for key in keys:
                if "tokens/" in key:
                    assert b[key] == a[key], (kind, a["step"], key)
                else:  # measured: within 2e-8 (the same micro-batches, fp32 under DeepSpeed and without it)
                    assert b[key] == pytest.approx(a[key], rel=1e-6), (kind, a["step"], key)


def test_tensorboard_and_the_report_show_each_source(runs) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = runs["single"]
    events = EventAccumulator(str(run["dir"] / "tensorboard"))
    events.Reload()
    for source in NAMES:
        scalars = events.Scalars(f"train/loss/{source}")
        assert [s.step for s in scalars] == [m["step"] for m in run["train"]]
        assert [s.value for s in scalars] == pytest.approx([m[f"loss/{source}"] for m in run["train"]], rel=1e-6)
        assert [s.step for s in events.Scalars(f"eval/loss/{source}")] == [12, 24]
    assert_png(run["dir"] / "report" / "loss_by_source.png")
    assert "loss_by_source.png" in (run["dir"] / "report" / "summary.md").read_text()
