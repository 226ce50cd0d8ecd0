"""Gemma-3 4B-27B checkpoints (model_type gemma3: Gemma3ForConditionalGeneration, a vision tower and projector beside
the language model, every size in text_config) train on text, as HF Trainer and TRL train them: open_sft reads the
text model's config, runs the language model, leaves the vision tower as loaded (frozen, no LoRA adapters), and
exports a checkpoint AutoModelForCausalLM loads back with the trained logits. Every such run stopped at load with
"'Gemma3Config' object has no attribute 'vocab_size'" (found by a family hunt)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from open_sft.model.anatomy import decoder_layers, matmul_params, outside_text_path, text_config, text_decoder_of
from open_sft.model.logits import logit_transform
from open_sft.model.loss_parity import check_loss_parity
from tests.unit.model.test_logits import gemma3_multimodal_config, tiny

TOWERS = {"vision_tower", "multi_modal_projector"}


def test_open_sft_reads_the_text_model() -> None:
    from open_sft.model.load import context_warning
    from open_sft.monitor.metrics import FlopCounter
    from open_sft.preflight.memory import ModelShape

    model = tiny("gemma3")
    config, language_model = model.config, model.model.language_model
    assert type(model).__name__ == "Gemma3ForConditionalGeneration" and not hasattr(config, "vocab_size")
    assert text_config(config) is config.text_config and text_config(tiny("llama").config).model_type == "llama"
    assert text_decoder_of(model) is language_model and decoder_layers(model) is language_model.layers
    assert set(outside_text_path(model)) == TOWERS and outside_text_path(tiny("llama")) == {}
    # the cap is in text_config, but this class's forward applies none; nor does open_sft's loss (test_logits holds
    # the loss and gradients equal to the model's own)
    assert config.text_config.final_logit_softcapping == 0.5 and logit_transform(config).identity
    backbone, head = matmul_params(model)  # the language model's matmuls: the vision tower computes nothing on text
    assert backbone == sum(p.numel() for name, p in language_model.named_parameters()
                           if p.dim() >= 2 and "embed_tokens" not in name)
    counter = FlopCounter(config, backbone, head)
    shape = ModelShape.of(model)
    assert (counter.hidden, counter.layers, counter.vocab) == (shape.hidden, shape.layers, shape.vocab) == (32, 2, 96)
    assert "max_position_embeddings" in context_warning(config, 10_000)
    assert check_loss_parity(model) is None  # verified
    config.model_type = "gemma3_unverified"  # the start-up check runs on this layout too, and passes
    assert "equals the model's own" in check_loss_parity(model)


def test_load_model_leaves_the_vision_tower_as_loaded(tmp_path) -> None:
    """Full fine-tuning freezes it (no gradient reaches it; no optimizer state, no weight decay); LoRA puts no
    adapters in it, whether all-linear or named modules (its q_proj, fc1 would match)."""
    from open_sft.config.args import LoraArguments, ModelArguments
    from open_sft.model.load import load_model

    tiny("gemma3").save_pretrained(tmp_path)
    model = load_model(ModelArguments(model_name_or_path=str(tmp_path)))
    for name, part in outside_text_path(model).items():
        assert not any(p.requires_grad for p in part.parameters()), name
    assert all(p.requires_grad for p in model.model.language_model.parameters())
    for targets in (["all-linear"], ["q_proj", "fc1", "down_proj"]):
        adapted = load_model(ModelArguments(model_name_or_path=str(tmp_path)),
                             lora=LoraArguments(use_lora=True, lora_target_modules=targets))
        names = [name for name, p in adapted.named_parameters() if "lora_" in name]
        assert names and not [name for name in names if "vision_tower" in name or "projector" in name], targets
        assert any("language_model.layers.0.self_attn.q_proj" in name for name in names)


def test_pipeline_stages_are_refused_with_the_fix() -> None:
    """Pipeline stages split a causal LM's backbone.layers; this layout's are in its language model: a UserError
    naming the flag (an AttributeError before)."""
    from types import SimpleNamespace

    from open_sft.distributed.pipeline_plan import plan_stages
    from open_sft.errors import UserError

    train = SimpleNamespace(pipeline_parallel_size=2, pipeline_virtual_stages=1, pipeline_layers=None)
    with pytest.raises(UserError, match="--pipeline_parallel_size: model type 'gemma3'.*without --pipeline"):
        plan_stages(tiny("gemma3"), train)


def _reference_eval(run: Path, caches: Path) -> tuple[float, int]:
    """The exported model's own logits (AutoModelForCausalLM) on each example of the run's evaluation cache:
    (token-weighted cross-entropy, tokens), for the cache whose trained tokens the run's eval_tokens are."""
    import datasets
    import json

    last = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "eval_loss" in line][-1]
    model = AutoModelForCausalLM.from_pretrained(run, dtype=torch.float32).eval()
    assert type(model).__name__ == "Gemma3ForConditionalGeneration"
    for cache in sorted({p.parent for p in caches.rglob("dataset_info.json")}):
        rows = datasets.load_from_disk(str(cache))
        if sum(sum(1 for t in row["labels"][1:] if t != -100) for row in rows) != last["eval_tokens"]:
            continue
        total, tokens = 0.0, 0
        with torch.no_grad():
            for row in rows:
                ids, labels = torch.tensor(row["input_ids"])[None], torch.tensor(row["labels"])[None, 1:]
                logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
                trained = labels != -100
                total += float(torch.nn.functional.cross_entropy(logits[trained], labels[trained], reduction="sum"))
                tokens += int(trained.sum())
        return total / tokens, last["eval_loss"]
    raise AssertionError(f"no evaluation cache of {last['eval_tokens']} tokens under {caches}")


@pytest.mark.parametrize("lora", [False, True])
def test_a_gemma3_multimodal_checkpoint_trains_on_text_and_exports_it(lora, tiny_model_dir, tmp_path,
                                                                      monkeypatch) -> None:
    from transformers import AutoTokenizer

    from conftest import SAMPLE
    from open_sft.run import main

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    base = tmp_path / "gemma3"
    torch.manual_seed(0)
    config = gemma3_multimodal_config(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                      max_position_embeddings=256)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(base)
    tokenizer.save_pretrained(base)
    out = tmp_path / "run"
    monkeypatch.setenv("OPEN_SFT_CACHE", str(tmp_path / "cache"))  # this run's caches: the evaluation set's read back
    assert main(["--model_name_or_path", str(base), "--dataset_mixer_list", str(SAMPLE), "16",
                 "--eval_dataset_mixer_list", str(SAMPLE), "4", "--max_train_steps", "2", "--learning_rate", "1e-2",
                 "--per_device_train_batch_size", "4", "--max_seq_length", "128", "--torch_dtype", "float32",
                 "--report_to", "none", "--output_dir", str(out)]
                + (["--use_lora"] if lora else [])) == 0
    reference, eval_loss = _reference_eval(out, tmp_path / "cache")
    assert reference == pytest.approx(eval_loss, rel=1e-5)
    if lora:
        return
    before = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).state_dict()
    after = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    assert before.keys() == after.keys()
    moved = {name for name in before if not torch.equal(before[name], after[name])}
    assert moved and all("language_model" in name or name == "lm_head.weight" for name in moved)
    assert not [name for name in moved if "vision_tower" in name or "projector" in name]
