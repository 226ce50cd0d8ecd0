"""A LoRA adapter of a run that added tokens: the run grows the embeddings to exactly len(tokenizer), every row it
sets is a trainable token, and the adapter holds no copy of the frozen embedding or LM head, so the adapter loads
as peft and transformers load one (onto the base resized to len(tokenizer)) and as open_sft generate loads it, each
giving the merged model's logits; open_sft merge-lora writes merged/'s tensors."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from open_sft.config.args import LoraArguments
from open_sft.data.chat.templates import remember_new_tokens
from open_sft.model.load import load_model
from unit.model.test_model_options import model_args

ADDED = ["<|a|>", "<|b|>"]


def _base(tiny_model_dir, tmp_path, tied: bool):
    """An untied base whose rows fit its tokenizer (the embedded default), or a tied one with 4 rows fewer than
    its tokenizer has tokens (the run grows rows for tokens it did not add)."""
    if not tied:
        return tiny_model_dir
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.vocab_size, config.tie_word_embeddings = config.vocab_size - 4, True
    torch.manual_seed(0)
    directory = tmp_path / "tied_base"
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(directory)
    return directory


def _trained_run(base, directory):
    """A LoRA run's export (merge_lora_on_save) after adding two special tokens, every trainable tensor moved."""
    from transformers import AutoTokenizer

    from open_sft.export.save import save_lora

    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.add_special_tokens({"additional_special_tokens": ADDED})
    remember_new_tokens(tokenizer, tokenizer.convert_tokens_to_ids(ADDED))
    model = load_model(model_args(base), tokenizer, LoraArguments(use_lora=True, lora_rank=4, lora_dropout=0.0))
    assert model.get_input_embeddings().weight.shape[0] == len(tokenizer)  # no spare rows under LoRA
    torch.manual_seed(0)
    with torch.no_grad():
        for param in (p for p in model.parameters() if p.requires_grad):
            param.add_(torch.randn_like(param) * 0.1)
    save_lora(model, model.state_dict(), tokenizer, directory, merge=True)
    return tokenizer, model


@pytest.mark.parametrize("tied", [False, True])
def test_an_adapter_with_added_tokens_loads_everywhere_as_its_merged_model(tiny_model_dir, tmp_path, tied) -> None:
    from peft import AutoPeftModelForCausalLM, PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    from open_sft.export.merge_adapter import main as merge_main
    from open_sft.export.run_dir import load_run_model

    base, run = _base(tiny_model_dir, tmp_path, tied), tmp_path / "run"
    tokenizer, model = _trained_run(base, run)
    base_rows = AutoConfig.from_pretrained(base).vocab_size
    grown = list(range(base_rows, len(tokenizer)))  # 2 added tokens; tied: 4 more the tokenizer had
    assert len(grown) == (6 if tied else 2)
    indices = model.peft_config["default"].trainable_token_indices
    assert indices == ({"embed_tokens": grown} if tied else {"embed_tokens": grown, "lm_head": grown})
    with safe_open(str(run / "adapter_model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert keys and not [k for k in keys if ".base_layer." in k]  # no copy of the frozen embedding or LM head
    assert sum(".trainable_tokens_delta" in k for k in keys) == (1 if tied else 2)

    ids = torch.tensor([[1, 7, *grown, 9, 11]])
    merged = AutoModelForCausalLM.from_pretrained(run / "merged", dtype=torch.float32)
    assert merged.get_input_embeddings().weight.shape[0] == len(tokenizer)
    with torch.no_grad():
        expected = merged(ids).logits
        assert torch.allclose(model.eval()(ids).logits, expected, atol=2e-5)  # the trained model itself

    def resized_base():
        plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        plain.resize_token_embeddings(len(tokenizer))  # transformers' own initialisation of the new rows
        return plain

    with_transformers = resized_base()
    with_transformers.load_adapter(str(run))
    loaded = {"AutoPeftModelForCausalLM": AutoPeftModelForCausalLM.from_pretrained(run, dtype=torch.float32),
              "PeftModel": PeftModel.from_pretrained(resized_base(), str(run)),
              "transformers load_adapter": with_transformers,
              "open_sft generate": load_run_model(run).model}
    for name, loaded_model in loaded.items():
        with torch.no_grad():
            logits = loaded_model.eval()(ids).logits
        assert logits.shape == expected.shape, name
        assert torch.allclose(logits, expected, atol=2e-5), (name, float((logits - expected).abs().max()))

    assert merge_main([str(run), str(tmp_path / "offline")]) == 0
    ours, theirs = (load_file(d / "model.safetensors") for d in (tmp_path / "offline", run / "merged"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_an_adapter_that_holds_its_resized_embedding_still_loads(tiny_model_dir, tmp_path) -> None:
    """An adapter written before open_sft left the embedding out (peft saved it whole, at the run's multiple of
    64 rows) still loads for open_sft generate and merges: the base is resized to the rows it holds."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from open_sft.export.merge_adapter import main as merge_main
    from open_sft.export.run_dir import load_run_model
    from open_sft.model.lora import apply_lora

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ADDED})
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=64, mean_resizing=False)
    added = [len(tokenizer) - 2, len(tokenizer) - 1]
    model = apply_lora(model, LoraArguments(use_lora=True, lora_rank=4), added)
    run = tmp_path / "old"
    model.save_pretrained(run, save_embedding_layers=True)
    tokenizer.save_pretrained(run)
    ids = torch.tensor([[1, 7, *added, 9]])
    with torch.no_grad():
        expected = model.eval()(ids).logits
        assert torch.equal(load_run_model(run).model(ids).logits, expected)
    assert merge_main([str(run), str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    with torch.no_grad():
        assert torch.allclose(merged(ids).logits, expected, atol=2e-5)


def test_an_added_tokens_adapter_on_a_biased_lm_head_is_refused_where_peft_drops_the_bias(tiny_model_dir, tmp_path,
                                                                                           monkeypatch) -> None:
    """open_sft generate/chat/compare of such an adapter (a Phi-2 run that added tokens, trained under peft 0.22)
    under a peft before 0.22 gave logits without the LM head's bias (3.4 off on a tiny Phi): refused, naming the
    merged model and merge-lora, which keep the bias (merge-lora's logits are the adapted model's). An adapter on a
    head without a bias loads as before."""
    import peft
    from packaging.version import Version
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from open_sft.errors import UserError
    from open_sft.export.merge_adapter import merge_adapter_dir
    from open_sft.export.run_dir import load_run_model

    if Version(peft.__version__) < Version("0.22"):
        pytest.skip("the run itself is refused under this peft (test_lora.py)")
    config = AutoConfig.for_model("phi", vocab_size=1024, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, tie_word_embeddings=False)
    torch.manual_seed(0)
    phi = tmp_path / "phi"
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.lm_head.bias.normal_(0, 1.0, generator=torch.Generator().manual_seed(1))
    model.save_pretrained(phi)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(phi)
    _, adapted = _trained_run(phi, tmp_path / "run")
    _trained_run(tiny_model_dir, tmp_path / "llama_run")
    ids = torch.randint(0, 1024, (1, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = adapted.eval()(input_ids=ids).logits
    monkeypatch.setattr(peft, "__version__", "0.21.2")
    with pytest.raises(UserError, match=r"leaves out of the logits .* `open_sft merge-lora .*/run OUT`"):
        load_run_model(tmp_path / "run")
    merge_adapter_dir(tmp_path / "run", tmp_path / "merged")
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()(input_ids=ids).logits
    torch.testing.assert_close(merged, want, rtol=1e-5, atol=1e-5)
    assert load_run_model(tmp_path / "llama_run").kind == "LoRA adapter"
