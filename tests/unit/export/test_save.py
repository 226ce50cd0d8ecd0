"""The one staging helper both exports (full model, LoRA) write through."""

from __future__ import annotations

import pytest

from open_sft.export.save import EXPORT_FILES, MERGED_DIR, STAGING, save_model, staged_export


def _files(directory) -> dict[str, str]:
    return {str(p.relative_to(directory)): p.read_text() for p in sorted(directory.rglob("*"))
            if p.is_file() and p.name != EXPORT_FILES}


def _earlier_full_export(out) -> None:
    out.mkdir()
    (out / "metrics.jsonl").write_text("old metrics.jsonl")  # the run's, not the export's
    with staged_export(out) as staging:
        for name in ("config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                     "model.safetensors.index.json", "tokenizer.json"):
            (staging / name).write_text(f"old {name}")


def test_lora_export_over_a_full_export_leaves_no_full_model_beside_the_adapter(tmp_path) -> None:
    """Loaders given a directory with config.json and adapter_config.json would apply the adapter to the stale
    model; shards of another sharding would be mixed into the new model."""
    out = tmp_path / "out"
    _earlier_full_export(out)
    with staged_export(out) as staging:
        (staging / "adapter_config.json").write_text("new adapter config")
        (staging / "adapter_model.safetensors").write_text("new adapter")
        (staging / "tokenizer.json").write_text("new tokenizer")
    assert _files(out) == {"adapter_config.json": "new adapter config", "adapter_model.safetensors": "new adapter",
                           "tokenizer.json": "new tokenizer", "metrics.jsonl": "old metrics.jsonl"}


def test_full_export_over_a_lora_export_removes_the_adapter_and_its_merge(tmp_path) -> None:
    out = tmp_path / "out"
    with staged_export(out) as staging:
        (staging / "adapter_config.json").write_text("old")
        (staging / "adapter_model.safetensors").write_text("old")
        (staging / MERGED_DIR).mkdir()
        (staging / MERGED_DIR / "model.safetensors").write_text("old merge")
    with staged_export(out) as staging:
        (staging / "config.json").write_text("new config")
        (staging / "model.safetensors").write_text("new weights")
    assert _files(out) == {"config.json": "new config", "model.safetensors": "new weights"}


def test_a_new_merge_replaces_the_old_one_whole(tmp_path) -> None:
    out = tmp_path / "out"
    (out / MERGED_DIR).mkdir(parents=True)
    (out / MERGED_DIR / "model-00001-of-00002.safetensors").write_text("old shard")
    with staged_export(out) as staging:
        (staging / MERGED_DIR).mkdir()
        (staging / MERGED_DIR / "model.safetensors").write_text("new merge")
    assert _files(out) == {f"{MERGED_DIR}/model.safetensors": "new merge"}


def test_files_no_export_wrote_are_never_removed(tmp_path, caplog) -> None:
    """A user's model files in the directory (--overwrite_output_dir into theirs) are not an earlier export's: the
    export writes its own names over theirs, and removes nothing else."""
    out = tmp_path / "out"
    (out / MERGED_DIR).mkdir(parents=True)
    mine = {"config.json": "my config", "model.safetensors": "my weights", "notes.txt": "mine",
            f"{MERGED_DIR}/model.safetensors": "my merge"}
    for name, text in mine.items():
        (out / name).write_text(text)
    with staged_export(out) as staging:
        (staging / "adapter_config.json").write_text("new adapter config")
        (staging / "adapter_model.safetensors").write_text("new adapter")
    assert _files(out) == {**mine, "adapter_config.json": "new adapter config",
                           "adapter_model.safetensors": "new adapter"}
    assert "kept config.json, merged, model.safetensors beside the export: no open_sft export wrote them" in caplog.text
    # the next export removes what this one wrote and still nothing of the user's
    with staged_export(out) as staging:
        (staging / "config.json").write_text("new config")
    assert _files(out) == {**mine, "config.json": "new config"}


def test_a_failed_export_leaves_the_earlier_one_untouched(tmp_path) -> None:
    out = tmp_path / "out"
    _earlier_full_export(out)
    before = _files(out)
    with pytest.raises(RuntimeError, match="disk full"):
        with staged_export(out) as staging:
            (staging / "config.json").write_text("half")
            raise RuntimeError("disk full")
    assert _files(out) == before and not (out / STAGING).exists()


@pytest.mark.parametrize("tied", [True, False])
def test_the_export_of_a_tied_model_stores_its_head_once(tmp_path, tied) -> None:
    """fp32 masters exported in bf16: the cast copies the tied head apart from the embedding; the export stores
    save_pretrained's tensors of the model (the tied head left out) and loads back tied."""
    import torch
    import transformers
    from safetensors.torch import load_file

    from open_sft.export.save import save_model

    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    model = transformers.AutoModelForCausalLM.from_config(config)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=_word_level(), eos_token="</s>")
    save_model(model, model.state_dict(), tokenizer, tmp_path / "out", dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "plain")
    saved = load_file(tmp_path / "out" / "model.safetensors")
    assert saved.keys() == load_file(tmp_path / "plain" / "model.safetensors").keys()
    assert ("lm_head.weight" in saved) != tied
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight.to(torch.bfloat16).float())


def _word_level():
    from tokenizers import Tokenizer, models

    return Tokenizer(models.WordLevel({"</s>": 0, "a": 1}, unk_token="</s>"))


def test_the_exported_eos_ids_keep_the_models_own_and_add_the_templates(tiny_model_dir, tmp_path) -> None:
    """A Llama-3.1 base stops at [<|end_of_text|>, <|eom_id|>, <|eot_id|>]; the export wrote the template's
    <|eot_id|> alone, so a model calling a built-in tool (<|eom_id|>) ran on. The model's ids still in the
    vocabulary come first, then the template's it lacks; every export writes this (the run's, a checkpoint's
    model files for `open_sft export`, merge-lora: tests/unit/model/test_lora.py compares the last)."""
    import json

    from transformers import AutoTokenizer, GenerationConfig

    from open_sft.export.save import write_generation_config

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|eom|>", "<|eot|>"]})
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '<|eot|>' }}{% endfor %}"
                               "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    eos, eom, eot = tokenizer.convert_tokens_to_ids([tokenizer.eos_token, "<|eom|>", "<|eot|>"])
    for own, expected in (([eos, eom, len(tokenizer) + 5], [eos, eom, eot]), ([eot, eom], [eot, eom, eos]),
                          (eom, [eom, eos, eot]), (None, [eos, eot])):
        write_generation_config(GenerationConfig(eos_token_id=own), tokenizer, tmp_path)
        assert json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"] == expected, own


@pytest.mark.parametrize("reserved", ["<|finetune_right_pad_id|>", None])
def test_a_tokenizer_without_pad_is_exported_without_eos_as_its_pad(tmp_path, reserved) -> None:
    """Llama-3.1's tokenizer names no pad; open_sft padded with <|eot_id|> and exported it as the pad token, so
    collators that mask labels equal to the pad id never trained the end of a turn on the exported model. Its
    reserved <|finetune_right_pad_id|> is the pad now (exported: never trained); with no reserved one eos pads
    the batches but the export names no pad, as the tokenizer had none."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    from open_sft.config.args import ModelArguments
    from open_sft.export.save import save_tokenizer, write_generation_config
    from open_sft.model.tokenizer import load_tokenizer

    vocab = ["<|begin_of_text|>", "<|eot_id|>", "hi"] + ([reserved] if reserved else [])
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="hi"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                            additional_special_tokens=vocab[3:]).save_pretrained(tmp_path / "base")
    tokenizer = load_tokenizer(ModelArguments(model_name_or_path=str(tmp_path / "base")))
    assert tokenizer.pad_token == (reserved or "<|eot_id|>")  # what the batches are padded with
    save_tokenizer(tokenizer, tmp_path / "out")
    write_generation_config(GenerationConfig(eos_token_id=1), tokenizer, tmp_path / "out")
    exported = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text()).get("pad_token")
    generation = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert (exported, generation.get("pad_token_id")) == ((reserved, 3) if reserved else (None, None))
    assert tokenizer.pad_token == (reserved or "<|eot_id|>")  # the run's tokenizer is left as it was


def test_config_json_names_the_tokenizers_pad_and_bos_as_the_generation_config_does(tmp_path) -> None:
    """A tokenizer that is not the base's own (or a pad the run chose) left config.json with the model's pad and bos
    ids while generation_config.json named the tokenizer's: the export's two files disagreed (the hunter's OLMo
    tokenizer on a tiny base: config pad 2, the tokenizer's pad 1)."""
    import json

    import transformers
    from tokenizers import Tokenizer, models

    config = transformers.LlamaConfig(vocab_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, bos_token_id=5, pad_token_id=6,
                                      eos_token_id=0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    vocab = {"</s>": 0, "<s>": 1, "<pad>": 2, "a": 3}
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="a")),
                                                     eos_token="</s>", bos_token="<s>", pad_token="<pad>")
    save_model(model, model.state_dict(), tokenizer, tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    generation = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert (written["pad_token_id"], written["bos_token_id"]) == (2, 1)
    assert (generation["pad_token_id"], generation["bos_token_id"]) == (2, 1)
    loaded = transformers.AutoConfig.from_pretrained(tmp_path / "out")
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (2, 1, 0)
