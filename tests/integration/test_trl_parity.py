"""open_sft against TRL's SFTTrainer on the same tokens (README, "Batching, schedules and the loss"): per-step loss,
grad norm and learning rate equal, and the final weights close.

One finetune.py run (the tiny model, fp32, 12 chat rows, 4 per micro-batch × 3 accumulated = the whole data each
step, 3 epochs, linear decay without warmup: the warmups differ on purpose, README says so), then TRL (the real
one, from the test extra; tests/trl_sft.py in its own process) on that run's own tokenized cache with the same
settings. A step is every example once, so its loss does not depend on either side's order; its micro-batches have
unequal trained tokens, so the accumulation's normalisation is what is compared (token: TRL's num_items_in_batch).

Measured (x86 CPU, torch 2.13, TRL 1.16, 1 or 2 threads alike): loss within 1.2e-8 relative, grad norm 9e-8, lr
2e-16; weights: the largest element's difference 1.2e-5 (Adam's sign noise on near-zero gradients: an element moves
by up to the 2e-3 the three learning rates add to), all differences together 4.1e-7 of all updates. Run with
--loss_normalization mean instead, the grad norm is 7e-3 off from step 1, the loss 2e-4 from step 2, and the weights
8e-2 of the updates (the largest element 4e-3): the test fails.

LoRA (r 8, alpha 16, dropout 0, every linear layer but the LM head) the same way against TRL + PEFT (the same
LoraConfig as its peft_config; TRL trains both in one process). Measured (AMD EPYC): loss within 6.5e-8 relative,
grad norm 1.3e-7; the adapters' largest element difference 2e-7, all of B's differences 1.6e-7 of its updates. TRL +
PEFT with use_rslora (scale alpha / sqrt(r)) instead: the grad norm 2.8× ours from step 1, and the test fails."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
from safetensors.torch import load_file

from conftest import ROOT, SAMPLE, TESTS, child_env, read_metrics, run_finetune

SETTINGS = {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 3, "num_train_epochs": 3,
            "learning_rate": 1e-3, "lr_scheduler_type": "linear", "weight_decay": 0.01, "seed": 42}
RELATIVE = 1e-5  # per-step loss, grad norm, lr (measured: 9e-8 at most)
WEIGHTS_MAX = 1e-4  # any element's |difference| (measured 1.2e-5; an element's update is up to 2e-3)
WEIGHTS_TOTAL = 1e-5  # sum |difference| / sum |update| (measured 4.1e-7; --loss_normalization mean: 8e-2)
LORA = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": "all-linear"}
LORA_FLAGS = ["--use_lora", "--lora_rank", "8", "--lora_alpha", "16", "--lora_dropout", "0"]


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """open_sft's runs on the same 12 chat rows, full and LoRA, and TRL's (TRL + PEFT with LORA) on each run's
    tokenized cache, in one process: name → (the run's directory, TRL's output directory)."""
    if importlib.util.find_spec("trl") is None:
        pytest.fail("TRL is not installed: it is in the test extra (./scripts/test.sh installs it, or "
                    "pip install -e '.[test]')")
    tmp_path = tmp_path_factory.mktemp("trl_parity")
    data = tmp_path / "chat12.jsonl"
    rows = [json.loads(line) for line in SAMPLE.read_text().splitlines()[:12]]
    data.write_text("".join(json.dumps({"messages": row["messages"]}) + "\n" for row in rows))
    settings = [f"--{name}={value}" for name, value in SETTINGS.items()]
    runs, trainings = {}, []
    for name, flags, lora in (("full", [], None), ("lora", LORA_FLAGS, LORA)):
        ours, theirs = tmp_path / f"open_sft_{name}", tmp_path / f"trl_{name}"
        run_finetune(["--model_name_or_path", str(tiny_model_dir), "--dataset_mixer_list", str(data), "1.0",
                      "--torch_dtype", "float32", "--warmup_ratio", "0", "--clip_grad_norm", "1.0",
                      "--logging_steps", "1", *settings, *flags, "--output_dir", str(ours)])
        cache = json.loads((ours / "run.json").read_text())["dataset_cache_path"]
        trainings.append({"model": str(tiny_model_dir), "cache": cache, "out": str(theirs), "warmup_steps": 0,
                          "max_grad_norm": 1.0, **({"lora": lora} if lora else {}), **SETTINGS})
        runs[name] = (ours, theirs)
    result = subprocess.run([sys.executable, str(TESTS / "trl_sft.py"), json.dumps(trainings)], cwd=ROOT,
                            env=child_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return runs


def _assert_same_steps(ours, theirs) -> None:
    steps = read_metrics(ours)
    logged = [entry for entry in json.loads((theirs / "log.json").read_text()) if "loss" in entry]
    assert [m["step"] for m in steps] == [entry["step"] for entry in logged] == [1, 2, 3]
    for m, entry in zip(steps, logged):
        for name in ("loss", "grad_norm", "learning_rate"):
            assert m[name] == pytest.approx(entry[name], rel=RELATIVE, abs=0), (m["step"], name, m[name], entry)
        assert m["total_tokens"] == entry["num_tokens"]


def test_open_sft_trains_as_trl_sft_trainer(trained, tiny_model_dir) -> None:
    ours, theirs = trained["full"]
    cache = json.loads((ours / "run.json").read_text())["dataset_cache_path"]

    # the premise: each step's three micro-batches train unequal numbers of tokens
    labels = datasets.load_from_disk(cache)["labels"]
    order = json.loads((ours / "data_order.rank0.json").read_text())["example_indices"][:12]
    per_micro_batch = {sum(sum(label != -100 for label in labels[i]) for i in order[k:k + 4]) for k in (0, 4, 8)}
    assert len(per_micro_batch) > 1, per_micro_batch
    _assert_same_steps(ours, theirs)

    base, a, b = (load_file(path) for path in (tiny_model_dir / "model.safetensors", ours / "model.safetensors",
                                               theirs / "final.safetensors"))
    assert a.keys() == b.keys()
    largest = max(float((a[key] - b[key]).abs().max()) for key in a)
    total = sum(float((a[key] - b[key]).abs().sum()) for key in a) / sum(float((a[key] - base[key]).abs().sum())
                                                                         for key in a)
    assert largest <= WEIGHTS_MAX and total <= WEIGHTS_TOTAL, (largest, total)


def test_lora_trains_as_trl_with_peft(trained) -> None:
    """LoRA r 8, alpha 16 on every linear layer but the LM head, fp32: TRL + PEFT with the same peft_config. Both
    sides draw the A matrices right after seeding torch with --seed, so the adapters start equal; the steps after
    the first (B is 0 before it) hold the adapter's init, scale (alpha / r) and weight decay to TRL's."""
    ours, theirs = trained["lora"]
    _assert_same_steps(ours, theirs)
    a, b = load_file(ours / "adapter_model.safetensors"), load_file(theirs / "final.safetensors")
    assert a.keys() == b.keys() and len(a) == 28  # A and B of q, k, v, o, gate, up, down in 2 layers: no lm_head
    largest = max(float((a[key] - b[key]).abs().max()) for key in a)
    # B starts at 0: its values are its updates
    total = sum(float((a[key] - b[key]).abs().sum()) for key in a if "lora_B" in key) / sum(
        float(a[key].abs().sum()) for key in a if "lora_B" in key)
    assert largest <= WEIGHTS_MAX and total <= WEIGHTS_TOTAL, (largest, total)
