"""Model options, in process on the tiny model (fp32): gradient checkpointing, attention kernels,
NEFTune, Liger / flash-attention errors on CPU, and vocabulary expansion."""

from __future__ import annotations

import math

import pytest
import torch

from open_sft.config.args import ModelArguments
from open_sft.model.loss import TokenLossModel
from open_sft.model.load import load_model
from open_sft.model.tokenizer import load_tokenizer


def model_args(model_dir, **overrides) -> ModelArguments:
    return ModelArguments(model_name_or_path=str(model_dir), torch_dtype="float32", **overrides)


def make_batch(vocab: int = 1000, rows: int = 3, length: int = 24, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tokens, right padding on all but the first row, the first 5 positions untrained."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(6, vocab, (rows, length), generator=generator)
    attention_mask = torch.ones(rows, length, dtype=torch.long)
    for row in range(1, rows):
        attention_mask[row, length - 4 * row:] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, :5] = -100
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def loss_and_grads(model, batch) -> tuple[float, dict[str, torch.Tensor]]:
    wrapped = TokenLossModel(model).train()
    torch.manual_seed(0)
    loss = wrapped(**batch)
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_gradient_checkpointing_same_loss_and_gradients(tiny_model_dir) -> None:
    batch = make_batch()
    loss_plain, grads_plain = loss_and_grads(load_model(model_args(tiny_model_dir)), batch)
    checkpointed = load_model(model_args(tiny_model_dir, gradient_checkpointing=True))
    assert checkpointed.is_activation_checkpointing
    loss_ckpt, grads_ckpt = loss_and_grads(checkpointed, batch)
    assert loss_ckpt == pytest.approx(loss_plain, rel=1e-6)
    assert grads_ckpt.keys() == grads_plain.keys() and len(grads_plain) == 21
    for name, grad in grads_plain.items():
        torch.testing.assert_close(grads_ckpt[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_eager_and_sdpa_attention_give_the_same_loss(tiny_model_dir) -> None:
    batch = make_batch()
    losses = {}
    for kind in ("eager", "sdpa"):
        model = load_model(model_args(tiny_model_dir, attn_implementation=kind))
        assert model.config._attn_implementation == kind
        losses[kind], _ = loss_and_grads(model, batch)
    assert losses["eager"] == pytest.approx(losses["sdpa"], rel=1e-5)
    assert load_model(model_args(tiny_model_dir)).config._attn_implementation == "sdpa"  # auto on CPU


@pytest.mark.parametrize("family", ["gemma2", "bloom", "xglm"])
def test_auto_attention_is_eager_for_a_class_without_sdpa(family, tmp_path) -> None:
    """transformers refuses sdpa for these classes: `auto` loads them with eager attention, as transformers' own
    default would, rather than failing at load (a default Gemma-2 fine-tune on CPU used to)."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    from open_sft.model.load import attn_implementation

    config = AutoConfig.for_model(family, vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    model = load_model(model_args(tmp_path))
    assert model.config._attn_implementation == "eager"
    assert attn_implementation(ModelArguments(model_name_or_path="m"), LlamaConfig()) == "sdpa"
    assert attn_implementation(ModelArguments(model_name_or_path="m"), None) == "sdpa"  # class unknown: auto's kernel


@pytest.mark.parametrize("family", ["gpt_oss", "mimo_v2_flash", "granite_swa"])
def test_flash_attention_2_is_not_taken_where_it_would_drop_attention_sinks(family, monkeypatch) -> None:
    """gpt-oss-style attention adds learned sinks (s_aux), which flash-attn 2 does not compute: on a GPU with
    flash-attn, `auto` gives such a class what transformers' own default gives it (eager for gpt-oss), not
    flash_attention_2; an explicit flash_attention_2 is refused up front (config.json read, no weights) with the
    reason and the fix. Llama still gets flash_attention_2."""
    import importlib.util

    from transformers import AutoConfig, LlamaConfig

    from open_sft.config.launch import LaunchPlan
    from open_sft.config.launch_check import launch_problems
    from open_sft.distributed.parallelism import Parallelism
    from open_sft.errors import UserError
    from open_sft.model import load

    run = _run_config()  # parsed before the machine below is made up
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "flash_attn"
                        else find_spec(name, *a))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))  # an H100
    config = AutoConfig.for_model(family)
    auto = ModelArguments(model_name_or_path="m")
    kind = "eager"  # transformers' own default for these classes (no sdpa: it cannot add the sinks either)
    assert load.attn_implementation(auto, config) == kind
    assert load.attn_implementation(auto, LlamaConfig()) == "flash_attention_2"
    flash = ModelArguments(model_name_or_path="m", attn_implementation="flash_attention_2")
    assert load.flash_attention_problem(LlamaConfig()) is None
    problem = load.flash_attention_problem(config)
    name = load._model_class(config).__name__
    assert problem.startswith(f"--attn_implementation flash_attention_2: {name}'s attention adds learned attention "
                              "sinks, which flash-attn 2 does not compute; transformers would swap in one of ")
    assert problem.endswith(f"use --attn_implementation auto (here: {kind}, which computes it as the model defines "
                            f"it) or {kind}")
    with pytest.raises(UserError, match="adds learned attention sinks"):
        load.attn_implementation(flash, config)
    run.model.attn_implementation = "flash_attention_2"
    launch = LaunchPlan(run.train, torch.bfloat16, None, Parallelism("single", 1))
    assert launch_problems(run, launch, config) == [problem]
    assert launch_problems(run, launch, LlamaConfig()) == []


@pytest.mark.parametrize("flags, given, fix", [
    (["--use_flash_attn"], "--use_flash_attn", "drop --use_flash_attn: attention is then auto (here: eager, which "
     "computes it as the model defines it)"),
    (["--use_flash_attn", "--attn_implementation", "flash_attention_2"],
     "--use_flash_attn (and --attn_implementation flash_attention_2)",
     "drop --use_flash_attn and --attn_implementation flash_attention_2: attention is then auto (here: eager, which "
     "computes it as the model defines it)")])
def test_a_sink_model_under_open_instructs_use_flash_attn_is_refused_by_the_flag_given(flags, given, fix,
                                                                                        monkeypatch) -> None:
    """open-instruct's --use_flash_attn on gpt-oss was refused naming --attn_implementation flash_attention_2, a flag
    the user never typed, with a fix (--attn_implementation eager) that contradicts --use_flash_attn."""
    import importlib.util

    from transformers import AutoConfig

    from open_sft.config.launch import LaunchPlan
    from open_sft.config.launch_check import launch_problems
    from open_sft.distributed.parallelism import Parallelism
    from open_sft.model import load

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "flash_attn"
                        else find_spec(name, *a))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))  # an H100
    run = _run_config(*flags)
    config = AutoConfig.for_model("gpt_oss")
    [problem] = launch_problems(run, LaunchPlan(run.train, torch.bfloat16, None, Parallelism("single", 1)), config)
    name = load._model_class(config).__name__
    assert problem.startswith(f"{given}: {name}'s attention adds learned attention sinks, which flash-attn 2 does not "
                              "compute; transformers would swap in one of ")
    assert problem.endswith(fix)


def _run_config(*flags: str):
    from open_sft.config.parse import parse_config

    return parse_config(["--model_name_or_path", "m", "--dataset_mixer_list", "d.jsonl", "1.0", "--output_dir",
                         "unused", *flags])


def test_cuda_only_kernels_on_cpu_are_refused_up_front_together(tiny_model_dir, tmp_path) -> None:
    """flash-attn and Liger need CUDA: refused with the flags, both at once, before any model loads."""
    from open_sft.config.parse import parse_config
    from open_sft.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        parse_config(["--model_name_or_path", str(tiny_model_dir), "--dataset_mixer_list", "d.jsonl", "1.0",
                      "--output_dir", str(tmp_path), "--attn_implementation", "flash_attention_2",
                      "--use_liger_kernel"])
    text = str(info.value)
    assert "flash_attention_2 needs a CUDA GPU and the flash-attn package" in text
    assert "use --attn_implementation sdpa" in text
    assert "--use_liger_kernel needs a CUDA GPU (Liger's kernels are written in Triton)" in text
    assert "Drop --use_liger_kernel" in text and len(info.value.problems) == 2


def test_neftune_noise_in_training_only(tiny_model_dir) -> None:
    alpha = 5.0
    plain = load_model(model_args(tiny_model_dir))
    noisy = load_model(model_args(tiny_model_dir, neftune_noise_alpha=alpha))
    batch = make_batch()
    ids = batch["input_ids"]
    # Training: the embeddings move by at most alpha / sqrt(L * d), and nearly that much somewhere.
    bound = alpha / math.sqrt(ids.shape[1] * plain.config.hidden_size)
    noisy.train()
    delta = noisy.get_input_embeddings()(ids) - plain.get_input_embeddings()(ids)
    assert 0.9 * bound < float(delta.abs().max()) <= bound * (1 + 1e-6)
    assert abs(float(delta.mean())) < 0.05 * bound  # zero-mean uniform noise
    loss_plain, _ = loss_and_grads(plain, batch)
    loss_noisy, _ = loss_and_grads(noisy, batch)
    assert abs(loss_noisy - loss_plain) > 1e-4 * loss_plain
    # Eval and generation: identical to the model without NEFTune.
    plain.eval(), noisy.eval()
    with torch.no_grad():
        torch.testing.assert_close(noisy(input_ids=ids).logits, plain(input_ids=ids).logits, rtol=0, atol=0)
        prompt = ids[:1, :8]
        kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 2}
        assert torch.equal(noisy.generate(prompt, **kwargs), plain.generate(prompt, **kwargs))


@pytest.mark.parametrize("flag", ["add_tokens", "add_special_tokens"])
def test_vocabulary_expansion(tiny_model_dir, tmp_path, flag) -> None:
    base_tokenizer = load_tokenizer(model_args(tiny_model_dir))
    base = load_model(model_args(tiny_model_dir))
    old_rows = base.get_input_embeddings().weight.shape[0]
    new_tokens = [f"<|tool_{i}|>" for i in range(70)]  # enough to need a bigger matrix
    token_file = tmp_path / "tokens.txt"
    token_file.write_text("\n".join(new_tokens[:3] + ["", "<|user|>"] + new_tokens[3:] + [new_tokens[0]]) + "\n")

    tokenizer = load_tokenizer(model_args(tiny_model_dir, **{flag: str(token_file)}))
    assert len(tokenizer) == len(base_tokenizer) + 70  # blank line, known token and repeat skipped
    ids = tokenizer.convert_tokens_to_ids(new_tokens)
    assert ids == list(range(len(base_tokenizer), len(base_tokenizer) + 70))
    assert tokenizer.encode("a <|tool_5|> b", add_special_tokens=False).count(ids[5]) == 1

    model = load_model(model_args(tiny_model_dir, **{flag: str(token_file)}), tokenizer)
    rows = model.get_input_embeddings().weight.shape[0]
    assert rows % 64 == 0 and rows >= len(tokenizer) > old_rows and rows - len(tokenizer) < 64
    assert model.config.vocab_size == rows
    for new, old in ((model.get_input_embeddings().weight, base.get_input_embeddings().weight),
                     (model.get_output_embeddings().weight, base.get_output_embeddings().weight)):
        assert new.shape == (rows, old.shape[1])
        torch.testing.assert_close(new[:old_rows], old, rtol=0, atol=0)  # old rows untouched
        mean = old.mean(dim=0)
        torch.testing.assert_close(new[old_rows:], mean.expand(rows - old_rows, -1), rtol=1e-6, atol=1e-7)
        assert float(mean.abs().max()) > 0

    saved = tmp_path / "saved_tokenizer"
    tokenizer.save_pretrained(saved)
    from transformers import AutoTokenizer

    reloaded = AutoTokenizer.from_pretrained(saved)
    assert reloaded.convert_tokens_to_ids(new_tokens) == ids
    text = reloaded.decode([ids[0], ids[1]], skip_special_tokens=True)
    assert (text == "") == (flag == "add_special_tokens")


def test_examples_longer_than_the_models_positions_warn() -> None:
    from types import SimpleNamespace

    from open_sft.model.load import context_warning

    config = SimpleNamespace(max_position_embeddings=2048)
    assert context_warning(config, 2048) is None and context_warning(SimpleNamespace(), 10**6) is None
    assert context_warning(config, 4000) == (
        "examples up to 4000 tokens are longer than the model's 2048 positions (max_position_embeddings): lower "
        "--max_seq_length to 2048, or extend the context (e.g. rope_scaling through --additional_model_arguments)")


def with_spare_rows(tiny_model_dir, out, tied: bool):
    """The tiny model with 64 spare embedding rows past its 1,024 tokens, as GPT-NeoX/OLMo/Qwen pad theirs
    (50,304 rows for 50,280 tokens): the spare rows hold values far from the trained rows' (N(0, 1) against
    the model's 0.02 init), as untrained padding does."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, tie_word_embeddings=tied)
    tokens = len(AutoTokenizer.from_pretrained(tiny_model_dir))
    model.resize_token_embeddings(tokens + 64, mean_resizing=False)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for weight in {id(w): w for w in (model.get_input_embeddings().weight,
                                          model.get_output_embeddings().weight)}.values():
            weight[tokens:] = torch.randn(64, weight.shape[1], generator=generator)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return out


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("how", ["chatml", "add_special_tokens"])
def test_added_tokens_on_spare_rows_start_at_the_mean_of_the_trained_rows(tiny_model_dir, tmp_path, caplog,
                                                                          tied, how) -> None:
    """Tokens the run adds land on spare rows (the matrix need not grow): their rows, in the input embeddings and
    the LM head, are the mean of the 1,024 trained rows, not the padding that was there nor a mean polluted by
    it; every other row is untouched; one log line names the tokens and their ids."""
    from transformers import AutoModelForCausalLM

    from open_sft.data.chat.templates import apply_chat_template_choice

    model_dir = with_spare_rows(tiny_model_dir, tmp_path / "spare", tied)
    token_file = tmp_path / "tokens.txt"
    token_file.write_text("<|im_start|>\n<|im_end|>\n")
    args = model_args(model_dir, **({"add_special_tokens": str(token_file)} if how != "chatml" else {}))
    tokenizer = load_tokenizer(args)
    if how == "chatml":
        assert apply_chat_template_choice(tokenizer, "chatml", None) == ["<|im_start|>", "<|im_end|>"]
    with caplog.at_level("INFO", logger="open_sft"):
        model = load_model(args, tokenizer)
    ids = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert ids == [1024, 1025]
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    pairs = [(model.get_input_embeddings().weight, base.get_input_embeddings().weight),
             (model.get_output_embeddings().weight, base.get_output_embeddings().weight)]
    assert (pairs[0][0] is pairs[1][0]) == tied
    others = [i for i in range(1088) if i not in ids]
    for new, old in pairs:
        assert new.shape == old.shape == (1088, 64)  # not resized: the spare rows took the tokens
        mean = old[:1024].mean(dim=0)
        torch.testing.assert_close(new[ids], mean.expand(2, -1), rtol=1e-6, atol=1e-7)
        assert float((old[others].mean(0) - mean).abs().max()) > 1e-3  # the padding would have shifted it
        torch.testing.assert_close(new[others], old[others], rtol=0, atol=0)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("added tokens ")]
    rows = "embedding" if tied else "input-embedding and LM-head"
    assert lines == [f"added tokens <|im_start|> (1024), <|im_end|> (1025): their {rows} rows start at the mean of "
                     "the 1024 trained rows"]
    assert tokenizer.open_sft_new_ids == ids  # what LoRA makes trainable (open_sft.model.lora)


def test_a_bare_tokenizer_json_gets_its_eos_and_pad_tokens(tiny_model_dir, tmp_path) -> None:
    """A directory holding only a tokenizer.json (no tokenizer_config.json naming its special tokens) loads with no
    eos and no pad token; the run's first collate failed on a None pad id. The tokens it has are taken."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers

    from open_sft.errors import UserError
    from open_sft.model.tokenizer import load_tokenizer

    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(tiny_model_dir / "tokenizer.json", bare / "tokenizer.json")
    tokenizer = load_tokenizer(model_args(tiny_model_dir, tokenizer_name_or_path=str(bare)))
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|endoftext|>", "<|pad|>")
    assert isinstance(tokenizer.pad_token_id, int) and isinstance(tokenizer.eos_token_id, int)
    plain = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    plain.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "plain").mkdir()
    plain.save(str(tmp_path / "plain" / "tokenizer.json"))
    with pytest.raises(UserError, match="names no eos token and has none of <|endoftext|>".replace("|", r"\|")):
        load_tokenizer(model_args(tiny_model_dir, tokenizer_name_or_path=str(tmp_path / "plain")))


def test_add_bos_stands_eos_in_only_for_a_gpt_neox_tokenizer_without_bos(tiny_model_dir, caplog) -> None:
    """open-instruct's --add_bos: a GPT-NeoX tokenizer without bos (OLMo 1) opens every example with its eos token; any
    other tokenizer without one (Qwen's) gets nothing, as open-instruct's `{{ bos_token }}` renders empty there."""
    from transformers import AutoTokenizer, GPTNeoXTokenizer

    from open_sft.model.tokenizer import add_bos_to_template

    chat = [{"role": "user", "content": "hi"}]
    plain = AutoTokenizer.from_pretrained(tiny_model_dir)
    neox = GPTNeoXTokenizer(tokenizer_object=plain.backend_tokenizer, eos_token=plain.eos_token)
    for tokenizer in (plain, neox):
        tokenizer.bos_token, tokenizer.chat_template = None, plain.chat_template or "{{ messages[0]['content'] }}"
    before = plain.apply_chat_template(chat, tokenize=False)
    add_bos_to_template(plain)
    assert plain.bos_token is None and plain.apply_chat_template(chat, tokenize=False) == before
    assert "--add_bos: the tokenizer has no bos token; nothing to add" in caplog.text
    add_bos_to_template(neox)
    assert neox.bos_token == neox.eos_token and neox.apply_chat_template(chat, tokenize=False) == neox.eos_token + before


def test_models_load_without_the_hubs_kernels(tiny_model_dir) -> None:
    """transformers 5.25 kernelizes every model it loads (and again at each model.train()) with kernels from the Hub
    unless USE_HUB_KERNELS says no: open_sft's processes say no (the package sets the default), so the layers are the
    torch ones its numbers are proven on, and a pipeline stage's meta layers are not kernelized (it raised)."""
    import os

    assert os.environ.get("USE_HUB_KERNELS") == "NO"
    model = load_model(model_args(tiny_model_dir))
    model.train()
    assert not getattr(model, "use_kernels", False) and getattr(model, "kernels_mode", None) is None


@pytest.mark.parametrize("template", [
    "{%- set loop_messages = messages %}\n{{- bos_token }}{% for m in loop_messages %}[{{ m['content'] }}]{% endfor %}",
    "{% for m in messages %}{% if loop.first %}{{ bos_token + '[INST] ' }}{% endif %}{{ m['content'] }}{% endfor %}",
    "{{- bos_token }}\n{% for m in messages %}{{ m['content'] }}{% endfor %}"], ids=["after_set", "per_turn", "dash"])
def test_add_bos_adds_nothing_where_the_template_already_renders_bos_first(tiny_model_dir, template, caplog) -> None:
    """--add_bos on a template that writes bos itself in a way its text does not begin with (Llama-3.1's
    `{{- bos_token }}`, Mistral v0.3's after a set block, Llama-2's `bos_token + '[INST]'`) doubled it: every example
    opened with two. Decided by rendering: one bos, and a log line says so; a template without one gets it."""
    from transformers import AutoTokenizer

    from open_sft.model.tokenizer import add_bos_to_template

    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.bos_token = tokenizer.bos_token or "<|endoftext|>"
    tokenizer.chat_template = template
    before = tokenizer.apply_chat_template(chat, tokenize=False)
    with caplog.at_level("INFO", logger="open_sft.model.tokenizer"):
        add_bos_to_template(tokenizer)
    assert tokenizer.apply_chat_template(chat, tokenize=False) == before
    assert before.startswith(tokenizer.bos_token) and not before[len(tokenizer.bos_token):].lstrip().startswith(
        tokenizer.bos_token)
    assert "already writes the bos token" in caplog.text
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    add_bos_to_template(tokenizer)
    assert tokenizer.apply_chat_template(chat, tokenize=False) == tokenizer.bos_token + "hiyo"


def test_an_override_that_changes_the_weights_shapes_is_named(tiny_model_dir) -> None:
    """--additional_model_arguments '{"hidden_size": 48}': transformers' 'ignore_mismatched_sizes' RuntimeError
    becomes an error naming the key, its value and the checkpoint's."""
    from open_sft.errors import UserError

    with pytest.raises(UserError) as info:
        load_model(model_args(tiny_model_dir, additional_model_arguments='{"hidden_size": 48, "attention_dropout": 0.1}'))
    message = str(info.value)
    assert message.startswith("--additional_model_arguments hidden_size: 48 (the checkpoint's: 64): changes the "
                              f"shapes of the checkpoint's weights ({tiny_model_dir}; ")
    assert "attention_dropout" not in message and "drop it" in message
    assert load_model(model_args(tiny_model_dir, additional_model_arguments='{"attention_dropout": 0.1}')) \
        .config.attention_dropout == 0.1


def test_flash_attention_2_is_not_taken_where_heads_are_wider_than_flash_attn_computes(monkeypatch) -> None:
    """Gemma 4's full-attention layers are 512 wide (global_head_dim), over the 256 flash-attn 2 has kernels for: its
    first forward there would stop. `auto` gives sdpa on a GPU with flash-attn; an explicit flash_attention_2 is
    refused with the width and the fix; Gemma 3 (256) and Llama (128) still take flash-attn."""
    import importlib.util

    from transformers import AutoConfig

    from open_sft.errors import UserError
    from open_sft.model import load

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "flash_attn"
                        else find_spec(name, *a))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))  # an H100
    auto = ModelArguments(model_name_or_path="m")
    flash = ModelArguments(model_name_or_path="m", attn_implementation="flash_attention_2")
    for family, name in [("gemma4_text", "Gemma4ForCausalLM"), ("gemma4", "Gemma4ForConditionalGeneration")]:
        config = AutoConfig.for_model(family)
        assert load.attn_implementation(auto, config) == "sdpa"
        assert load.flash_attention_problem(config) == (
            f"--attn_implementation flash_attention_2: {name}'s attention heads are up to 512 wide, over the 256 "
            "flash-attn 2 computes; use --attn_implementation auto (here: sdpa) or sdpa")
        with pytest.raises(UserError, match="up to 512 wide"):
            load.attn_implementation(flash, config)
    for family in ["gemma3_text", "llama"]:
        assert load.attn_implementation(auto, AutoConfig.for_model(family)) == "flash_attention_2"
