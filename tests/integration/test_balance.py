"""Token-balanced ranks through finetune.py, 2 real ranks under ZeRO-2, on a generated real-length mix
(prompts and answers from a few to ~2,000 tokens, long-tailed):

- balancing (the default) lowers the logged busiest-rank / mean-rank positions per step, padded and packed;
- it does not change the math: the per-step losses equal those of the shuffled layout
  (--balance_micro_batches false), since each step trains the same examples under token normalisation;
- the ranks still train disjoint examples that together are the step's.
"""

from __future__ import annotations

import json
import random

import pytest

from conftest import read_metrics, run_finetune, side_by_side

STEPS = 6
WORDS = ("the model reads each token of the answer and learns how the sentence goes on from there with "
         "care about every word it has seen so far").split()


def _long_tailed_data(path) -> str:
    rng = random.Random(7)
    with path.open("w") as handle:
        for i in range(96):
            words = min(1400, max(4, int(rng.lognormvariate(4.2, 1.2))))
            answer = " ".join(rng.choice(WORDS) for _ in range(words))
            handle.write(json.dumps({"messages": [{"role": "user", "content": f"Say something ({i})."},
                                                  {"role": "assistant", "content": answer}]}) + "\n")
    return str(path)


def _args(model_dir, data: str, output_dir, *extra: str) -> list[str]:
    return ["--model_name_or_path", str(model_dir), "--dataset_mixer_list", data, "1.0",
            "--output_dir", str(output_dir), "--max_train_steps", str(STEPS), "--logging_steps", "1",
            "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2",
            "--learning_rate", "1e-3", "--seed", "5", "--torch_dtype", "float32", "--max_seq_length", "2048",
            *extra]


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory) -> dict:
    data = _long_tailed_data(tmp_path_factory.mktemp("data") / "long_tailed.jsonl")
    variants = {"balanced": (), "shuffled": ("--balance_micro_batches", "false"),
                "packed_balanced": ("--packing", "--max_tokens_per_batch", "2048"),
                "packed_shuffled": ("--packing", "--max_tokens_per_batch", "2048", "--balance_micro_batches", "false")}

    def launch(name: str, extra: tuple[str, ...]) -> dict:
        output_dir = tmp_path_factory.mktemp(name)
        run_finetune(_args(tiny_model_dir, data, output_dir, *extra), processes=2, deepspeed_config="zero2.json")
        return {"dir": output_dir, "metrics": read_metrics(output_dir)}

    return side_by_side({name: lambda n=name, e=extra: launch(n, e) for name, extra in variants.items()}, processes=2)


def _imbalance(run: dict) -> float:
    return sum(m["rank_tokens_max_over_mean"] for m in run["metrics"]) / len(run["metrics"])


# Padded, shuffled ranks wait on this data (measured 1.34 busiest/mean over 6 steps; balanced 1.11: the layout
# is chosen for the shortest wait at every micro-step, which DeepSpeed's per-micro-step reductions impose, and
# then for the step's busiest rank). Packed, best fit already fills most micro-batches, so shuffled ranks are
# close (1.03) but for the light last bins and the epoch's tail step (1.11 there); balanced 1.02.
@pytest.mark.parametrize("mode, shuffled_above, balanced_below", [("", 1.2, 1.15), ("packed_", 1.0, 1.03)])
def test_balancing_evens_ranks_and_keeps_the_math(runs, mode, shuffled_above, balanced_below) -> None:
    balanced, shuffled = runs[mode + "balanced"], runs[mode + "shuffled"]
    assert [m["step"] for m in balanced["metrics"]] == list(range(1, STEPS + 1))
    before, after = _imbalance(shuffled), _imbalance(balanced)
    print(f"{mode or 'padded_'}imbalance: shuffled {before:.3f}, balanced {after:.3f}")
    assert before > shuffled_above, before
    assert after < balanced_below and after < before, (before, after)
    assert [m["loss"] for m in balanced["metrics"]] == pytest.approx([m["loss"] for m in shuffled["metrics"]],
                                                                     rel=1e-5)
    assert [m["train_tokens"] for m in balanced["metrics"]] == [m["train_tokens"] for m in shuffled["metrics"]]
    run_json = json.loads((balanced["dir"] / "run.json").read_text())
    assert run_json["schedule"]["balanced"] is True
    assert json.loads((shuffled["dir"] / "run.json").read_text())["schedule"]["balanced"] is False


def test_balanced_ranks_train_disjoint_examples_of_the_same_steps(runs) -> None:
    orders = {}
    for name in ("balanced", "shuffled"):
        ranks = [json.loads((runs[name]["dir"] / f"data_order.rank{r}.json").read_text())["example_indices"]
                 for r in (0, 1)]
        assert not set(ranks[0]) & set(ranks[1])
        orders[name] = set(ranks[0]) | set(ranks[1])
    assert orders["balanced"] == orders["shuffled"] and len(orders["balanced"]) == STEPS * 16
