"""LoRA and QLoRA: only adapters train, the saved adapter and the merged model agree, ZeRO-3 matches
one process, and QLoRA (bitsandbytes' CPU backend, NF4 + double quantization, bf16 compute) trains.

The tests of this subject that launch real processes are in tests/integration/test_lora.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from open_sft.config.parse import parse_config
from open_sft.config.args import LoraArguments
from open_sft.errors import ConfigError, UserError
from open_sft.model.loss import TokenLossModel
from open_sft.model.load import load_model
from open_sft.training.optim import build_optimizer
from unit.model.test_model_options import make_batch, model_args


def test_lora_flags_defaults_and_validation() -> None:
    base = ["--model_name_or_path", "org/model", "--dataset_mixer_list", "a.jsonl", "1.0"]
    lora = parse_config(base + ["--use_lora"]).lora
    assert (lora.lora_rank, lora.lora_alpha, lora.lora_dropout) == (64, 16, 0.1)
    assert lora.lora_target_modules == ["all-linear"]
    targets = parse_config(base + ["--use_lora", "--lora_target_modules", "q_proj", "v_proj"]).lora.lora_target_modules
    assert targets == ["q_proj", "v_proj"]
    with pytest.raises(ConfigError) as info:
        parse_config(base + ["--merge_lora_on_save", "--lora_rank", "0", "--lora_dropout", "1.5"])
    assert len(info.value.problems) == 3
    assert "--merge_lora_on_save needs --use_lora or --use_qlora" in str(info.value)


def test_only_adapter_weights_train(tiny_model_dir) -> None:
    """In process: after three AdamW steps every adapter tensor changed everywhere, nothing else moved."""
    lora = LoraArguments(use_lora=True, lora_rank=4, lora_dropout=0.0)
    model = load_model(model_args(tiny_model_dir), lora=lora)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * 7 * 2  # A and B of 7 linear layers in each of 2 blocks; not lm_head
    wrapped = TokenLossModel(model).train()
    optimizer = build_optimizer(wrapped, 1e-2, 0.0)
    batch = make_batch()
    for _ in range(3):
        wrapped(**batch).backward()
        optimizer.step()
        optimizer.zero_grad()
    for name, param in model.named_parameters():
        if name in trainable:
            assert float((param != before[name]).float().mean()) > 0.99, name
        else:
            assert torch.equal(param, before[name]), name


def test_the_adapter_config_lists_its_target_modules_sorted(tiny_model_dir, tmp_path) -> None:
    """peft resolves all-linear to a set of module names and writes it in the set's (hash) order: two identical runs'
    adapter_config.json differed byte for byte (and a Hub push saw a change). Sorted, as a list, it is one file."""
    model = load_model(model_args(tiny_model_dir), lora=LoraArguments(use_lora=True, lora_rank=4))
    model.peft_config["default"].save_pretrained(tmp_path)
    written = json.loads((tmp_path / "adapter_config.json").read_text())["target_modules"]
    assert len(written) >= 7 and written == sorted(written)
    assert "model.layers.0.mlp.gate_proj" in written and not any("lm_head" in name for name in written)


def test_qlora_trains_through_its_4bit_layers_after_an_evaluation(tiny_model_dir, monkeypatch) -> None:
    """On a CPU with AVX512-BF16, bitsandbytes repacked a 4-bit weight for its inference kernel (no backward) at
    the first forward in eval mode without grad, for good: after a run's first evaluation, training lost the
    gradient through every frozen 4-bit layer. Here bitsandbytes is told this CPU has AVX512-BF16: the gradients
    after an evaluation are those before it."""
    import bitsandbytes.nn.modules as bnb_modules

    monkeypatch.setattr(bnb_modules, "has_avx512bf16", lambda: True)
    model = load_model(model_args(tiny_model_dir), lora=LoraArguments(use_qlora=True, lora_rank=4, lora_dropout=0.0))
    wrapped, batch = TokenLossModel(model), make_batch()

    def gradients() -> dict[str, torch.Tensor]:
        wrapped.train()
        wrapped(**batch).backward()
        grads = {name: param.grad.clone() for name, param in model.named_parameters() if param.requires_grad}
        model.zero_grad()
        return grads

    before = gradients()
    wrapped.eval()
    with torch.no_grad():
        wrapped(**batch)
    after = gradients()
    assert before.keys() == after.keys() and len(before) == 2 * 7 * 2
    for name in before:
        assert torch.equal(before[name], after[name]), name


@pytest.mark.parametrize("local_rank, gpus, device", [("3", 1, "cuda:0"), ("3", 8, "cuda:3"), ("5", 4, "cuda:1"),
                                                      (None, 2, "cuda:0")])
def test_qlora_loads_on_the_gpu_accelerate_gives_the_rank(tiny_model_dir, monkeypatch, local_rank, gpus,
                                                          device) -> None:
    """The 4-bit model is placed where accelerate puts the rank (its local index modulo the visible GPUs): under
    SLURM's --gpus-per-task=1 each rank sees one GPU, and cuda:{LOCAL_RANK} (cuda:3) was an invalid device."""
    from open_sft.model import load

    captured = {}

    def from_pretrained(*_args, **kwargs):
        captured.update(kwargs)
        raise KeyboardInterrupt  # stop before anything is built

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(load.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    with pytest.raises(KeyboardInterrupt):
        load._from_pretrained(model_args(tiny_model_dir, attn_implementation="sdpa"), LoraArguments(use_qlora=True),
                              torch.bfloat16)
    assert captured["device_map"] == {"": device}


def test_qlora_with_gradient_checkpointing_says_nothing_and_computes_what_it_computes_without(tiny_model_dir) -> None:
    """peft 0.22 warned on every QLoRA run with --gradient_checkpointing ("`gradient_checkpointing_kwargs` is
    deprecated ... Use `activation_checkpointing_kwargs`"), peft 0.21 through transformers' deprecated
    `gradient_checkpointing_enable`: open_sft's call enabled checkpointing a second time. load_model enables it
    (non-reentrant) and peft leaves it be: no warning, every layer checkpointed without reentrance, and the loss and
    every adapter's gradient are those of the run without checkpointing."""
    import warnings

    from transformers.modeling_layers import GradientCheckpointingLayer

    def run(checkpointing: bool) -> tuple[float, dict[str, torch.Tensor], list[str], list]:
        torch.manual_seed(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = load_model(model_args(tiny_model_dir, gradient_checkpointing=checkpointing),
                               lora=LoraArguments(use_qlora=True, lora_rank=4, lora_dropout=0.0))
        said = [str(w.message) for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))
                and ("checkpointing_kwargs" in str(w.message) or "checkpointing_enable" in str(w.message))]
        layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
        loss = TokenLossModel(model).train()(**make_batch())
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        return float(loss.detach()), grads, said, layers

    loss, grads, said, layers = run(True)
    plain_loss, plain_grads, _, plain_layers = run(False)
    assert said == []
    assert len(layers) == 2 and all(layer.gradient_checkpointing for layer in layers)
    assert all(layer._gradient_checkpointing_func.keywords == {"use_reentrant": False} for layer in layers)
    assert not any(layer.gradient_checkpointing for layer in plain_layers)
    assert loss == plain_loss and grads.keys() == plain_grads.keys() and len(grads) == 2 * 7 * 2
    for name in grads:
        torch.testing.assert_close(grads[name], plain_grads[name], rtol=0, atol=0)


def test_a_bf16_checkpoints_frozen_base_stays_bf16_with_the_same_numbers(tiny_model_dir, tmp_path) -> None:
    """LoRA in bf16 on a checkpoint stored in bf16: the decoder layers' frozen linear weights stay bf16 (half the
    bytes, no cast per forward), the LM head, norms and embeddings as before; the loss and every adapter's gradient
    are bitwise those of the fp32-held base, over two optimizer steps. Nothing changes for an fp32 checkpoint, an
    fp32 run, or FSDP2."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from open_sft.distributed.parallelism import Parallelism

    bf16_dir = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(tiny_model_dir).to(torch.bfloat16).save_pretrained(bf16_dir)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(bf16_dir)
    lora = LoraArguments(use_lora=True, lora_rank=4, lora_dropout=0.0)

    def trained(spread) -> tuple:
        torch.manual_seed(0)
        model = load_model(model_args(bf16_dir), lora=lora, compute_dtype=torch.bfloat16, parallelism=spread)
        wrapped = TokenLossModel(model).train()
        optimizer = build_optimizer(wrapped, 1e-2, 0.0)
        losses, grads = [], {}
        for step in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = wrapped(**make_batch(seed=step))
            loss.backward()
            losses.append(float(loss.detach()))
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
            optimizer.step()
            optimizer.zero_grad()
        dtypes = {n: p.dtype for n, p in model.named_parameters()}
        return losses, grads, dtypes

    losses, grads, dtypes = trained(Parallelism("single"))
    held_losses, held_grads, held_dtypes = trained(None)  # no parallelism given: the fp32-held base, as before
    assert losses == held_losses and grads.keys() == held_grads.keys() and len(grads) == 2 * 7 * 2
    assert all(torch.equal(grads[n], held_grads[n]) for n in grads)
    frozen_linear = [n for n in dtypes if ".layers." in n and "base_layer.weight" in n]
    assert len(frozen_linear) == 2 * 7 and all(dtypes[n] == torch.bfloat16 for n in frozen_linear)
    assert all(held_dtypes[n] == torch.float32 for n in frozen_linear)
    others = [n for n in dtypes if n not in frozen_linear]  # adapters, LM head, norms, embeddings
    assert others and all(dtypes[n] == torch.float32 for n in others)
    for spread, model_dir, dtype in ((Parallelism("fsdp2", 2), bf16_dir, torch.bfloat16),
                                     (Parallelism("single"), tiny_model_dir, torch.bfloat16),
                                     (Parallelism("single"), bf16_dir, torch.float32)):
        model = load_model(model_args(model_dir), lora=lora, compute_dtype=dtype, parallelism=spread)
        assert {p.dtype for p in model.parameters()} == {torch.float32}, (spread, model_dir, dtype)


@pytest.mark.parametrize("tied", [False, True])
def test_added_tokens_are_trainable_rows_under_lora(tied) -> None:
    """The rows of tokens the run added train under LoRA: the embedding's and an untied head's by name, a tied
    head through the embedding (peft wraps both); nothing is added without new tokens."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from open_sft.config.args import LoraArguments
    from open_sft.model.lora import apply_lora, trainable_token_rows

    config = AutoConfig.for_model("llama", vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    model = AutoModelForCausalLM.from_config(config)
    expected = {"embed_tokens": [90, 91]} if tied else {"embed_tokens": [90, 91], "lm_head": [90, 91]}
    assert trainable_token_rows(model, [90, 91]) == expected
    assert trainable_token_rows(model, []) == {}
    model.name_or_path = "Org/name"  # what from_pretrained was given: a Hub id is recorded as given
    peft_model = apply_lora(model, LoraArguments(use_lora=True, lora_rank=4), [90, 91])
    assert peft_model.peft_config["default"].base_model_name_or_path == "Org/name"
    trained = [n for n, p in peft_model.named_parameters() if p.requires_grad and "lora_" not in n]
    assert len(trained) == (1 if tied else 2) and all("trainable_tokens_delta" in n for n in trained)
    x = torch.tensor([[1, 90, 91, 5]])
    peft_model(input_ids=x, labels=x).loss.backward()
    assert all(float(p.grad.norm()) > 0 for n, p in peft_model.named_parameters() if n in trained)


MOE = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
       "intermediate_size": 64, "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
       "moe_intermediate_size": 16, "mlp_only_layers": [], "decoder_sparse_step": 1}


def tiny_moe(vocab: int = 96):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", vocab_size=vocab, **MOE))


def test_added_tokens_on_an_lm_head_with_a_bias_train_with_the_bias_or_are_refused(monkeypatch) -> None:
    """A LoRA run that adds tokens makes an untied LM head's rows trainable tokens; peft 0.21 computed that head
    without its bias (Phi-2's, GPT-J's): every logit the run trained on was off by it (2.4 here), and the export,
    with the bias, was another model. peft 0.22 keeps it: the adapted model at initialisation is the base, to the
    bit; under a peft before 0.22 the run is refused, saying the fix, and a head without a bias is not."""
    import peft
    from packaging.version import Version
    from transformers import AutoConfig, AutoModelForCausalLM

    from open_sft.model.lora import apply_lora

    def phi(bias: bool = True) -> torch.nn.Module:
        config = AutoConfig.for_model("phi", vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, tie_word_embeddings=False)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():
            model.lm_head.bias.normal_(0, 1.0, generator=torch.Generator().manual_seed(1))
        if not bias:
            model.lm_head.bias = None
        return model

    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(0))
    lora = LoraArguments(use_lora=True, lora_rank=2, lora_dropout=0.0)
    if Version(peft.__version__) >= Version("0.22"):
        with torch.no_grad():
            base_logits = phi()(input_ids=ids).logits
            peft_model = apply_lora(phi(), lora, [94, 95]).eval()
            assert type(peft_model.get_base_model().lm_head).__name__ == "TrainableTokensWrapper"
            assert torch.equal(peft_model(input_ids=ids).logits, base_logits)
        monkeypatch.setattr(peft, "__version__", "0.21.2")  # the refusal below, as under peft 0.21
    with pytest.raises(UserError, match=r"LoRA with tokens this run adds \(2; .* needs peft >= 0\.22"):
        apply_lora(phi(), lora, [94, 95])
    apply_lora(phi(bias=False), lora, [94, 95])
    apply_lora(phi(), lora)  # no added tokens: the head is no trainable token


def test_all_linear_on_moe_experts_takes_dropout_0_unless_the_user_set_one() -> None:
    """peft adapts MoE experts' fused 3-D weights (ParamWrapper) only without dropout: the flag's default yields to
    0 there (a warning says so); a dropout the user gave is refused with the two ways out."""
    from open_sft.model.lora import apply_lora

    lora = LoraArguments(use_lora=True, lora_rank=2)  # lora_dropout: its default, 0.1
    peft_model = apply_lora(tiny_moe(), lora, dropout_given=False)
    assert peft_model.peft_config["default"].lora_dropout == 0.0
    assert {"gate_up_proj", "down_proj"} <= set(peft_model.peft_config["default"].target_parameters)
    assert not [n for n, _ in peft_model.named_modules() if "base_layer.base_layer" in n and "self_attn" in n]
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)  # the base stays frozen
    with pytest.raises(UserError, match="pass --lora_dropout 0, or name the modules to adapt"):
        apply_lora(tiny_moe(), lora, dropout_given=True)


def merge_is_the_adapted_model(peft_model, fresh_base) -> tuple[torch.Tensor, torch.Tensor]:
    """Adapters given trained values (B no longer 0; A and B both set here, seeded by name, so that the numbers do not
    hang on peft's draw of A, which peft 0.22 changed for MoE models): the merged state dict, in a model built from
    the config, gives the adapted model's logits, which differ from the base's (`fresh_base()`). Returns (ids, the
    base's logits), the models left in float64.

    In float64: with adapters this large the activations reach ~100, and in float32 the merged weights' rounding
    (~1e-7 relative) moved a router's scores by ~1e-5, enough to flip a near-tied top-k choice of expert on one token
    (gpt-oss under peft 0.22's draw of the A matrices: 8e-5 on 72 logits). float64 keeps the comparison about the
    merge, not about rounding; the experts run eagerly there (torch's grouped_mm takes no float64)."""
    from transformers import AutoModelForCausalLM

    from open_sft.export.lora_merge import merged_state_dict

    def float64(model: torch.nn.Module) -> torch.nn.Module:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        if getattr(base.config, "_experts_implementation", None) not in (None, "eager"):
            base.set_experts_implementation("eager")
        return model.double().eval()

    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
            elif "lora_A" in name:  # the spread of peft's own draw (kaiming-uniform over the input width)
                p.normal_(0, p.shape[-1] ** -0.5, generator=torch.Generator().manual_seed(len(name)))
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    float64(peft_model)
    merged = float64(AutoModelForCausalLM.from_config(peft_model.get_base_model().config))
    merged.load_state_dict(merged_state_dict(peft_model, dict(peft_model.state_dict())))
    with torch.no_grad():
        adapted, plain = peft_model(input_ids=ids).logits, float64(fresh_base())(input_ids=ids).logits
        out = merged(input_ids=ids).logits
    assert out.dtype == torch.float64 and float((plain - adapted).abs().max()) > 1e-2  # the adapters change the model
    torch.testing.assert_close(out, adapted, rtol=1e-10, atol=1e-10)
    return ids, plain


def test_a_merge_of_adapters_on_moe_experts_is_the_adapted_model() -> None:
    """--merge_lora_on_save with LoRA on fused expert weights (two wrappers nested on one experts module) and on the
    router's weight: the merged model's logits are the adapted model's."""
    from open_sft.model.lora import apply_lora

    merge_is_the_adapted_model(apply_lora(tiny_moe(), LoraArguments(use_lora=True, lora_rank=2, lora_dropout=0.0)),
                               tiny_moe)


def test_a_default_lora_run_of_an_moe_model_trains_and_merges(tiny_model_dir, tmp_path) -> None:
    """`--use_lora --merge_lora_on_save` with the default flags on a Qwen3-MoE model: it trains (dropout 0, the
    experts adapted), and the merged export's logits are the adapter export's."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from conftest import SAMPLE
    from open_sft.run import main

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model_dir, out = tmp_path / "moe", tmp_path / "out"
    tiny_moe(len(tokenizer)).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    assert main(["--model_name_or_path", str(model_dir), "--dataset_mixer_list", str(SAMPLE), "16",
                 "--max_train_steps", "2", "--per_device_train_batch_size", "4", "--max_seq_length", "128",
                 "--torch_dtype", "float32", "--learning_rate", "1e-2", "--report_to", "none", "--use_lora",
                 "--lora_rank", "2", "--merge_lora_on_save", "--output_dir", str(out),
                 "--dataset_local_cache_dir", str(tmp_path / "cache")]) == 0
    ids = torch.randint(0, len(tokenizer), (1, 16), generator=torch.Generator().manual_seed(0))
    base = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    adapted = PeftModel.from_pretrained(base, str(out)).eval()
    merged = AutoModelForCausalLM.from_pretrained(out / "merged").eval()
    with torch.no_grad():
        expected, got = adapted(input_ids=ids).logits, merged(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_a_short_conv_models_3d_weights_are_not_taken_for_experts() -> None:
    """LFM2's short-conv layers hold 3-D conv1d weights: not MoE experts, so the default dropout stays (a re-sweep
    found every such model warned about experts and trained without dropout)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from open_sft.model.lora import apply_lora

    config = AutoConfig.for_model("lfm2", vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, layer_types=["conv", "full_attention"])
    model = AutoModelForCausalLM.from_config(config)
    assert any(p.dim() == 3 for p in model.parameters())
    peft_model = apply_lora(model, LoraArguments(use_lora=True, lora_rank=2), dropout_given=False)
    assert peft_model.peft_config["default"].lora_dropout == 0.1


def test_merge_lora_cli_writes_what_merge_lora_on_save_writes(tiny_model_dir, tmp_path, monkeypatch) -> None:
    """`open_sft merge-lora` of an adapter whose run added a token (embeddings resized past the base's rows, to the
    tokenizer's length as a LoRA run resizes them) writes merged/'s files: the same tensors bitwise, config, generation config (the run's stop
    tokens, not the base's), tokenizer and model card, in the base's dtype by default."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from open_sft.config.args import LoraArguments
    from open_sft.export.merge_adapter import main as merge_main
    from open_sft.export.model_card import write_model_card
    from open_sft.export.save import EXPORT_FILES, save_dtype, save_lora
    from open_sft.model.lora import apply_lora

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|turn_end|>"]})
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}<|turn_end|>{% endfor %}"
    monkeypatch.chdir(tiny_model_dir.parent)  # the base by a relative path: recorded by its absolute one
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir.name)
    rows = model.get_input_embeddings().weight.shape[0]
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    assert model.get_input_embeddings().weight.shape[0] > rows
    peft_model = apply_lora(model, LoraArguments(use_lora=True, lora_rank=4), [len(tokenizer) - 1])
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if param.requires_grad:
                param.add_(torch.randn_like(param) * 0.1)
    run = tmp_path / "run"
    save_lora(peft_model, peft_model.state_dict(), tokenizer, run, merge=True,
              dtype=save_dtype("auto", peft_model.get_base_model().config))
    write_model_card(run)
    assert json.loads((run / "adapter_config.json").read_text())["base_model_name_or_path"] == str(
        tiny_model_dir.resolve())
    monkeypatch.chdir(tmp_path)
    assert merge_main([str(run), str(tmp_path / "offline")]) == 0
    on_save, offline = run / "merged", tmp_path / "offline"
    assert sorted(p.name for p in offline.iterdir()) == sorted([EXPORT_FILES, *(p.name for p in on_save.iterdir())])
    for name in ("config.json", "generation_config.json", "README.md", "tokenizer_config.json", "tokenizer.json"):
        assert (offline / name).read_text() == (on_save / name).read_text(), name
    ours, theirs = load_file(offline / "model.safetensors"), load_file(on_save / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert json.loads((offline / "generation_config.json").read_text())["eos_token_id"][-1] == len(tokenizer) - 1
