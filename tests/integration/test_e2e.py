"""End to end through finetune.py in subprocesses: one process, and 2 real ranks under ZeRO-2 / ZeRO-3.

All three runs use the same global batch (8 = 4 × 2 accumulation × 1 rank = 2 × 2 × 2 ranks), so
with token-normalised loss their per-step losses and final weights must agree; each run must also
learn, log the contract's metrics, and save a model that reloads in a fresh process.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, SAMPLE, child_env, read_metrics, run_finetune, side_by_side

STEPS = 24
METRIC_FIELDS = {"step", "epoch", "loss", "learning_rate", "grad_norm", "train_tokens", "total_tokens",
                 "tokens_per_second", "mfu", "mfu_palm", "peak_memory_gib", "elapsed_s"}
LAYOUTS = {  # name: (processes, deepspeed config, micro-batch, accumulation)
    "single": (1, None, 4, 2),
    "bs8": (1, None, 8, 1),
    "bs2_ga4": (1, None, 2, 4),
    "zero2": (2, "zero2.json", 2, 2),
    "zero3": (2, "zero3.json", 2, 2),
}


def common_args(model_dir, output_dir, micro_batch: int, accumulation: int) -> list[str]:
    return ["--model_name_or_path", str(model_dir), "--dataset_mixer_list", str(SAMPLE), "1.0",
            "--output_dir", str(output_dir), "--max_train_steps", str(STEPS),
            "--per_device_train_batch_size", str(micro_batch), "--gradient_accumulation_steps", str(accumulation),
            "--learning_rate", "3e-3", "--warmup_ratio", "0.1", "--logging_steps", "1", "--seed", "1",
            "--torch_dtype", "float32", "--max_seq_length", "256"]


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory) -> dict:
    def launch(name: str) -> dict:
        processes, ds_config, micro_batch, accumulation = LAYOUTS[name]
        output_dir = tmp_path_factory.mktemp(name)
        result = run_finetune(common_args(tiny_model_dir, output_dir, micro_batch, accumulation),
                              processes=processes, deepspeed_config=ds_config)
        return {"dir": output_dir, "stdout": result.stdout, "metrics": read_metrics(output_dir)}

    out = {name: launch(name) for name, layout in LAYOUTS.items() if layout[0] == 1}
    return {**out, **side_by_side({name: lambda n=name: launch(n) for name, layout in LAYOUTS.items()
                                   if layout[0] == 2}, processes=2)}


@pytest.mark.parametrize("name", LAYOUTS)
def test_learns_and_logs_contract_metrics(runs, name) -> None:
    metrics = runs[name]["metrics"]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    for record in metrics:
        assert METRIC_FIELDS <= set(record), METRIC_FIELDS - set(record)
        assert all(isinstance(record[k], (int, float)) for k in METRIC_FIELDS)
    first = sum(m["loss"] for m in metrics[:3]) / 3
    last = sum(m["loss"] for m in metrics[-3:]) / 3
    assert first - last > 1.5, (first, last)
    tokens = [m["train_tokens"] for m in metrics]
    assert tokens == sorted(tokens) and tokens[0] > 0
    assert all(m["total_tokens"] > m["train_tokens"] for m in metrics)
    assert metrics[-1]["epoch"] == pytest.approx(STEPS * 8 / 2000, abs=1e-3)
    assert all(0 < m["mfu"] < 1 for m in metrics)  # a fraction of the measured peak, never above it
    # PaLM's count adds the LM head on untrained tokens and the masked half of attention: always the larger
    assert all(m["mfu_palm"] > m["mfu"] for m in metrics)


@pytest.mark.parametrize("name", ["bs8", "bs2_ga4", "zero2", "zero3"])
def test_batch_layout_does_not_change_the_math(runs, tiny_model_dir, name) -> None:
    """Same global batch, token-normalised loss: the layout must not change the math."""
    single = [m["loss"] for m in runs["single"]["metrics"]]
    multi = [m["loss"] for m in runs[name]["metrics"]]
    assert multi == pytest.approx(single, rel=1e-5)
    a = load_file(runs["single"]["dir"] / "model.safetensors")
    b = load_file(runs[name]["dir"] / "model.safetensors")
    assert a.keys() == b.keys()
    base = load_file(tiny_model_dir / "model.safetensors")
    for key in a:
        assert a[key].shape == b[key].shape, key  # ZeRO-3 saves the full gathered weights
        assert float((a[key] - base[key]).abs().max()) > 1e-2, key  # the weights really moved
        # Per tensor ||b - a|| / ||a|| <= 1e-5 (elementwise relative is meaningless for weights near 0), over
        # all but the tensor's 2 largest elementwise differences: where an accumulated gradient is ~0, Adam's
        # m / (sqrt(v) + eps) turns float-summation-order noise into updates of order lr·1e-2 on single
        # elements, and one or two such elements make up >95 % of a tensor's difference. Observed worst
        # tensor, single vs bs8 / bs2_ga4 / zero2 / zero3: 4.3e-7 / 5.8e-7 / 1.4e-6 / 1.4e-6 (with those
        # elements: 2.1e-6 / 1.8e-6 / 6.6e-6 / 4.8e-6). The elementwise atol guards the excluded elements.
        differences = (b[key] - a[key]).flatten().abs().sort().values
        relative = float(differences[:-2].norm() / a[key].norm())
        assert relative <= 1e-5, (key, relative)
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=1e-4, msg=key)


@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_ranks_saw_disjoint_data(runs, name) -> None:
    out = runs[name]["dir"]
    rank0 = json.loads((out / "data_order.rank0.json").read_text())["example_indices"]
    rank1 = json.loads((out / "data_order.rank1.json").read_text())["example_indices"]
    # Token-balanced ranks (the default) give a rank fewer, longer examples or more, shorter ones; every step
    # still trains its 8 examples once.
    assert len(rank0) + len(rank1) == STEPS * 8 and len(rank0) != len(rank1)
    assert not set(rank0) & set(rank1)
    single = json.loads((runs["single"]["dir"] / "data_order.rank0.json").read_text())["example_indices"]
    assert set(rank0) | set(rank1) == set(single)


@pytest.mark.parametrize("name", LAYOUTS)
def test_run_json(runs, name) -> None:
    info = json.loads((runs[name]["dir"] / "run.json").read_text())
    processes = LAYOUTS[name][0]
    assert info["world_size"] == processes
    assert info["distributed_type"] == ("DEEPSPEED" if name.startswith("zero") else "NO")
    assert info["loss_normalization"] == "token"
    assert info["schedule"]["global_batch_size"] == 8
    assert info["versions"]["torch"] and info["versions"]["transformers"]
    # The fused AdamW kernel steps the weights, under DeepSpeed too (ZeRO steps our optimizer on its partitions).
    assert info["optimizer"]["class"] == "torch.optim.adamw.AdamW"
    assert info["optimizer"]["implementation"] == "fused"
    assert info["optimizer"]["wrapped_by"][-1] == {"single": "AcceleratedOptimizer", "zero2": "DeepSpeedZeroOptimizer",
                                                   "zero3": "DeepSpeedZeroOptimizer_Stage3"}.get(name, "AcceleratedOptimizer")
    if name.startswith("zero"):
        assert info["deepspeed_config"]["zero_optimization"]["stage"] == int(name[-1])
        assert info["deepspeed_config"]["train_batch_size"] == 8
        assert "auto" not in json.dumps(info["deepspeed_config"])


RELOAD = """
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
trained, base = sys.argv[1], sys.argv[2]
tok = AutoTokenizer.from_pretrained(trained)
assert tok.chat_template, "chat template missing from the saved tokenizer"
enc = tok.apply_chat_template([{"role": "user", "content": "What is 2 plus 3?"}], add_generation_prompt=True,
                              return_tensors="pt", return_dict=True)
logits = {}
for name, path in (("trained", trained), ("base", base)):
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        logits[name] = model(**enc).logits
out = AutoModelForCausalLM.from_pretrained(trained).generate(**enc, max_new_tokens=8, do_sample=False)
print(json.dumps({"finite": bool(torch.isfinite(logits["trained"]).all()),
                  "max_diff": float((logits["trained"] - logits["base"]).abs().max()),
                  "new_tokens": out.shape[1] - enc["input_ids"].shape[1]}))
"""


@pytest.mark.parametrize("name", ["single", "zero3"])
def test_saved_model_reloads_in_fresh_process(runs, tiny_model_dir, name) -> None:
    out = runs[name]["dir"]
    for required in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (out / required).exists(), required
    result = subprocess.run([sys.executable, "-c", RELOAD, str(out), str(tiny_model_dir)], cwd=ROOT,
                            env=child_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["finite"]
    assert summary["max_diff"] > 0.1
    assert summary["new_tokens"] >= 1


def test_mean_of_means_differs_from_token_normalisation(runs, tiny_model_dir, tmp_path) -> None:
    """open-instruct's old weighting (mean of micro-batch means) is not layout-invariant: with the same
    data and layout as bs2_ga4 its losses must differ from the token-normalised run's."""
    output_dir = tmp_path / "mean"
    run_finetune(common_args(tiny_model_dir, output_dir, 2, 4) + ["--loss_normalization", "mean"])
    mean = [m["loss"] for m in read_metrics(output_dir)]
    token = [m["loss"] for m in runs["bs2_ga4"]["metrics"]]
    assert mean[0] == pytest.approx(token[0], rel=1e-5)  # same weights before the first update
    assert max(abs(a - b) / b for a, b in zip(mean[1:], token[1:])) > 1e-3
    assert json.loads((output_dir / "run.json").read_text())["loss_normalization"] == "mean"


def test_bf16_tracks_fp32(runs, tiny_model_dir, tmp_path) -> None:
    """bf16 autocast with fp32 master weights and optimizer states must still train like fp32 (pure-bf16
    AdamW rounds small updates away): per-step losses within 2 %, and the final loss as low."""
    output_dir = tmp_path / "bf16"
    run_finetune(common_args(tiny_model_dir, output_dir, 4, 2) + ["--torch_dtype", "bfloat16"])
    info = json.loads((output_dir / "run.json").read_text())
    assert info["compute_dtype"] == "torch.bfloat16"
    bf16 = [m["loss"] for m in read_metrics(output_dir)]
    # MFU against the bf16 peak measured with a linear layer (torch.mm's bf16 path is 10x slower on some CPUs)
    assert all(0 < m["mfu"] < 1 for m in read_metrics(output_dir))
    fp32 = [m["loss"] for m in runs["single"]["metrics"]]
    assert bf16 != fp32  # really a different precision
    assert max(abs(a - b) / b for a, b in zip(bf16, fp32)) < 0.02
    saved = load_file(output_dir / "model.safetensors")
    assert all(t.dtype == torch.float32 for t in saved.values())  # master weights stay fp32


def test_continual_pretraining_with_a_base_tokenizer(tiny_model_dir, tmp_path, capsys) -> None:
    """A base model's tokenizer has no chat template: text documents train with it (every token, the
    loss falls); chat rows are refused with the flags that fix it, and nothing is written."""
    import shutil

    from open_sft.run import main

    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir, base)
    (base / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((base / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    rows = [json.loads(line) for line in SAMPLE.read_text().splitlines()[:400]]
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": "\n".join(m["content"] for m in r["messages"])}) + "\n" for r in rows))

    output_dir = tmp_path / "cpt"
    run_finetune(["--model_name_or_path", str(base), "--dataset_mixer_list", str(docs), "1.0",
                  "--output_dir", str(output_dir), "--max_train_steps", "12", "--per_device_train_batch_size", "4",
                  "--learning_rate", "3e-3", "--logging_steps", "1", "--max_seq_length", "64",
                  "--torch_dtype", "float32"])
    report = json.loads((output_dir / "data_report.json").read_text())
    assert report["sources"][0]["format"] == "text"
    assert report["trained_tokens"] == report["tokens"] - report["examples"]  # all but each block's first
    losses = [m["loss"] for m in read_metrics(output_dir)]
    assert len(losses) == 12 and losses[-1] < 0.9 * losses[0]

    code = main(["--model_name_or_path", str(base), "--dataset_mixer_list", str(SAMPLE), "1.0",
                 "--output_dir", str(tmp_path / "chat"), "--max_train_steps", "1"])
    assert code == 2
    err = capsys.readouterr().err
    assert "has no chat template, and chat rows need one; choose one with --chat_template_name" in err
    assert not (tmp_path / "chat").exists()


TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "vocab.json", "merges.txt", "added_tokens.json"}  # "the tokenizer with its chat template"


def test_readme_lists_what_a_run_writes(runs) -> None:
    """README "What a run writes": every metrics.jsonl field and every file of a finished run is named there."""
    import re

    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("### What a run writes"):readme.index("### Checkpoints, resume, preemption")]
    per_step = section[section.index("one line per logging step:"):]
    per_step = per_step[:per_step.index(";")]
    fields = {re.sub(r"/.*", "/<source>", key) for key in runs["single"]["metrics"][0]}  # loss/alpaca: loss/<source>
    assert set(re.findall(r"`(\w+(?:/<source>)?)`", per_step)) == fields
    named = set(re.findall(r"`([^`]+)`", section))
    out = runs["single"]["dir"]
    written = {p.name + ("/" if p.is_dir() else "") for p in out.iterdir()}
    unnamed = {name for name in written - TOKENIZER_FILES if not name.startswith("data_order.")} - named
    assert not unnamed, f"README.md does not say what these are: {sorted(unnamed)}"
