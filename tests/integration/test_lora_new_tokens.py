"""LoRA trains what the template added: chatml on a tokenizer without <|im_start|>/<|im_end|> adds them, and
under --use_lora their embedding and LM-head rows train (peft's trainable tokens), are saved in the adapter,
are in the merged export, and the adapter (no copy of the frozen embedding or LM head in it) loads with plain
peft onto the base resized to the tokenizer, and with AutoPeftModelForCausalLM, and gives the merged model's
logits."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import SAMPLE, read_metrics, run_finetune

CHATML = ["<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def chatml_lora(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_chatml")
    run_finetune(["--model_name_or_path", str(tiny_model_dir), "--dataset_mixer_list", str(SAMPLE), "200",
                  "--output_dir", str(out), "--max_train_steps", "8", "--learning_rate", "5e-2",
                  "--logging_steps", "1", "--seed", "1", "--max_seq_length", "128", "--torch_dtype", "float32",
                  "--per_device_train_batch_size", "4", "--use_lora", "--lora_rank", "4", "--lora_alpha", "8",
                  "--lora_dropout", "0.0", "--chat_template_name", "chatml", "--merge_lora_on_save"])
    return out


def test_added_token_rows_train_and_are_exported(chatml_lora, tiny_model_dir) -> None:
    tokenizer = AutoTokenizer.from_pretrained(chatml_lora)
    ids = tokenizer.convert_tokens_to_ids(CHATML)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    base_rows = base.get_input_embeddings().weight.shape[0]
    assert all(i >= len(AutoTokenizer.from_pretrained(tiny_model_dir)) for i in ids)  # really new tokens
    adapter = load_file(chatml_lora / "adapter_model.safetensors")
    deltas = {k: v for k, v in adapter.items() if "trainable_tokens_delta" in k}
    assert sorted(k.split(".")[-3] for k in deltas) == ["embed_tokens", "lm_head"], sorted(deltas)
    assert all(v.shape == (len(ids), base.config.hidden_size) for v in deltas.values())
    merged = AutoModelForCausalLM.from_pretrained(chatml_lora / "merged", dtype=torch.float32)
    embed, head = merged.get_input_embeddings().weight.detach(), merged.get_output_embeddings().weight.detach()
    assert embed.shape[0] == len(tokenizer) > base_rows  # resized for the new tokens, no spare rows under LoRA
    assert not [k for k in adapter if ".base_layer." in k]  # the frozen embedding and LM head stay out
    # the mean row they started from (fit_embeddings_to_tokenizer), and where training took them
    start = base.get_input_embeddings().weight.detach().mean(0)
    for i in ids:
        assert float((embed[i] - start).norm()) > 1e-3 * float(start.norm()), i
    start_head = base.get_output_embeddings().weight.detach().mean(0)
    assert any(float((head[i] - start_head).norm()) > 1e-3 * float(start_head.norm()) for i in ids)
    # the trained rows in the merged export are the adapter's
    embed_delta = next(v for k, v in deltas.items() if "embed_tokens" in k)
    torch.testing.assert_close(embed[ids], embed_delta.float())
    # training moved the loss down: the last half of the 8 steps against the first (one step's loss against
    # another's was noise at this learning rate: a fresh-clone suite saw 7.95 after 6.99)
    losses = [r["loss"] for r in read_metrics(chatml_lora)]
    assert sum(losses[4:]) < sum(losses[:4]), losses


def test_adapter_loads_with_plain_peft_and_equals_the_merged_model(chatml_lora, tiny_model_dir) -> None:
    from peft import AutoPeftModelForCausalLM, PeftModel

    tokenizer = AutoTokenizer.from_pretrained(chatml_lora)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    base.resize_token_embeddings(len(tokenizer))
    model = PeftModel.from_pretrained(base, str(chatml_lora)).eval()
    auto = AutoPeftModelForCausalLM.from_pretrained(chatml_lora, dtype=torch.float32).eval()  # resizes it so itself
    merged = AutoModelForCausalLM.from_pretrained(chatml_lora / "merged", dtype=torch.float32).eval()
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 plus 3?"},
                                          {"role": "assistant", "content": "5"}], tokenize=False)
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert set(tokenizer.convert_tokens_to_ids(CHATML)) <= set(ids[0].tolist())
    with torch.no_grad():
        expected = merged(input_ids=ids).logits
        torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(auto(input_ids=ids).logits, expected, rtol=1e-4, atol=1e-4)
    config = json.loads((chatml_lora / "adapter_config.json").read_text())
    assert config["trainable_token_indices"]


def test_chatml_tokens_on_spare_rows_start_at_the_mean_in_a_run(tiny_model_dir, tmp_path) -> None:
    """A real run (full fine-tune, and LoRA) of a model whose embedding has spare rows: chatml's tokens take spare
    rows, start at the mean of the trained rows in both matrices (one step at lr 1e-9 keeps them there), the log
    names them with their ids, and LoRA trains those rows."""
    from unit.model.test_model_options import with_spare_rows

    model_dir = with_spare_rows(tiny_model_dir, tmp_path / "spare", tied=False)
    common = ["--model_name_or_path", str(model_dir), "--dataset_mixer_list", str(SAMPLE), "40",
              "--max_train_steps", "1", "--seed", "1", "--max_seq_length", "128", "--torch_dtype", "float32",
              "--per_device_train_batch_size", "4", "--chat_template_name", "chatml"]
    full = run_finetune(common + ["--output_dir", str(tmp_path / "full"), "--learning_rate", "1e-9"])
    line = ("added tokens <|im_start|> (1024), <|im_end|> (1025): their input-embedding and LM-head rows start at "
            "the mean of the 1024 trained rows")
    assert line in full.stdout
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "full", dtype=torch.float32)
    assert AutoTokenizer.from_pretrained(tmp_path / "full").convert_tokens_to_ids(CHATML) == [1024, 1025]
    for new, old in ((trained.get_input_embeddings().weight, base.get_input_embeddings().weight),
                     (trained.get_output_embeddings().weight, base.get_output_embeddings().weight)):
        assert new.shape == old.shape == (1088, 64)
        mean = old.detach()[:1024].mean(0)
        torch.testing.assert_close(new.detach()[1024:1026], mean.expand(2, -1), rtol=0, atol=1e-6)
        assert float((old.detach()[1024:1026] - mean).abs().max()) > 0.5  # the padding rows it replaced
    lora = run_finetune(common + ["--output_dir", str(tmp_path / "lora"), "--learning_rate", "1e-3", "--use_lora",
                                  "--lora_rank", "4"])
    assert line in lora.stdout and "LoRA also trains the embedding rows of the 2 added tokens" in lora.stdout
    config = json.loads((tmp_path / "lora" / "adapter_config.json").read_text())
    assert {k: sorted(v) for k, v in config["trainable_token_indices"].items()} == {
        "embed_tokens": [1024, 1025], "lm_head": [1024, 1025]}


def test_the_same_run_on_2_ranks_under_zero3_trains_the_same(chatml_lora, tiny_model_dir, tmp_path) -> None:
    """LoRA + ZeRO-3 + tokens the template adds: peft sets up the added rows on the partitioned embedding (on CPU it
    placed a buffer on CUDA and stopped), and the 2-rank run (2 per rank) trains the 1-process run's losses, the
    same adapter rows and merged export."""
    out = tmp_path / "zero3"
    run_finetune(["--model_name_or_path", str(tiny_model_dir), "--dataset_mixer_list", str(SAMPLE), "200",
                  "--output_dir", str(out), "--max_train_steps", "8", "--learning_rate", "5e-2",
                  "--logging_steps", "1", "--seed", "1", "--max_seq_length", "128", "--torch_dtype", "float32",
                  "--per_device_train_batch_size", "2", "--use_lora", "--lora_rank", "4", "--lora_alpha", "8",
                  "--lora_dropout", "0.0", "--chat_template_name", "chatml", "--merge_lora_on_save"],
                 processes=2, deepspeed_config="zero3.json")
    one, two = read_metrics(chatml_lora), read_metrics(out)
    assert [r["step"] for r in two] == [r["step"] for r in one]
    # step 1 is one forward of the same weights: equal up to the reduction order. Later steps follow 1-7 Adam
    # steps at lr 5e-2, where the order's ulps grow (a clean-clone CI saw 3.5e-4 at step 6): 2e-3 there, still
    # far below what a wrong gradient (a 2x scale, a row left out) moves at this rate
    assert two[0]["loss"] == pytest.approx(one[0]["loss"], rel=1e-5), (one[0]["loss"], two[0]["loss"])
    for a, b in zip(one[1:], two[1:]):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-3), (a["step"], a["loss"], b["loss"])
    deltas = {k: v for k, v in load_file(out / "adapter_model.safetensors").items() if "trainable_tokens_delta" in k}
    reference = load_file(chatml_lora / "adapter_model.safetensors")
    assert deltas.keys() and all(torch.allclose(v, reference[k], rtol=1e-3, atol=1e-4) for k, v in deltas.items())
    merged = AutoModelForCausalLM.from_pretrained(out / "merged", dtype=torch.float32).state_dict()
    expected = AutoModelForCausalLM.from_pretrained(chatml_lora / "merged", dtype=torch.float32).state_dict()
    assert merged.keys() == expected.keys()
    for name in merged:  # 8 Adam steps at lr 5e-2 on another reduction order: near-sign steps amplify ulps
        torch.testing.assert_close(merged[name], expected[name], rtol=1e-2, atol=5e-4)
