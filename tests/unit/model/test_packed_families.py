"""Every verified family keeps packed examples apart: a packed row through open_sft's per-example attention
gives each example the loss and gradients the model's own forward gives it alone, with the family's sliding
window where it has one (a window shorter than the examples, on some layers or all: Mistral, Mixtral, Qwen2/3,
Gemma-3, Cohere-2, Phi-3, Starcoder-2). Without the window in the per-example calls the windowed families'
losses were those of full attention (found by a family sweep; the test holds the window to matter)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from open_sft.model import packed_attention
from open_sft.model.loss_parity import VERIFIED
from open_sft.model.loss import TokenLossModel
from tests.unit.model.test_logits import GEMMA4
from tests.unit.model.tiny_moe import ROUTED_FAMILIES

WINDOW = 5
LENGTHS = [13, 9, 4]  # two examples longer than the window, one inside it
SMALL = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 64,
         "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "attention_dropout": 0.0}
EXPERTS = {
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 1,
                  "mlp_only_layers": []},
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2},
    "granitemoe": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "phimoe": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 32, "decoder_sparse_step": 1, "mlp_only_layers": []},
    **ROUTED_FAMILIES,
    "gemma4_text": GEMMA4,  # a head size per layer, per-layer input embeddings
}


def config_of(family: str, window: bool):
    config = AutoConfig.for_model(family, **{**SMALL, **EXPERTS.get(family, {})})
    if window and hasattr(config, "sliding_window"):
        config.sliding_window = WINDOW
        if hasattr(config, "use_sliding_window"):
            config.use_sliding_window = True
        if getattr(config, "layer_types", None) is not None:  # one sliding layer and one full one
            config.layer_types = ["sliding_attention", "full_attention"]
    elif hasattr(config, "sliding_window"):  # a window longer than any example: full attention
        config.sliding_window = 4096
    return config


MULTIMODAL = {"gemma4"}  # Gemma 4's checkpoints' class, trained on text: test_gemma4_checkpoints_keep_packed_...


def sdpa_families() -> list[str]:
    return sorted(f for f in VERIFIED - MULTIMODAL
                  if AutoModelForCausalLM._model_mapping[type(config_of(f, False))]._supports_sdpa)


def build(family: str, window: bool, state: dict | None = None, attn_implementation: str = "sdpa") -> TokenLossModel:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config_of(family, window), dtype=torch.float32,
                                             attn_implementation=attn_implementation).eval()
    with torch.no_grad():  # attention that matters at these sizes
        for p in model.parameters():
            p.mul_(4.0) if p.dim() == 2 else None
    if state is not None:
        model.load_state_dict(state)
    return TokenLossModel(model)


def examples(vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (1, n), generator=g) for n in LENGTHS]


def alone(model: TokenLossModel, ids: list[torch.Tensor]):
    """Each example through the model's own attention (its mask, with the window), losses summed."""
    model.zero_grad(set_to_none=True)
    loss = sum(model(input_ids=x, labels=x) for x in ids)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def packed(model: TokenLossModel, ids: list[torch.Tensor]):
    row = torch.cat(ids, dim=1)
    labels = row.clone()
    position_ids = torch.cat([torch.arange(x.shape[1]) for x in ids])[None]
    starts = torch.tensor([0] + LENGTHS[:-1]).cumsum(0)
    labels[0, starts] = -100  # an example's first token is not predicted from the example before it
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=row, labels=labels, position_ids=position_ids)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture
def sdpa_entry():
    before = ALL_ATTENTION_FUNCTIONS["sdpa"]
    yield
    ALL_ATTENTION_FUNCTIONS["sdpa"] = before


@pytest.mark.parametrize("family", sdpa_families())
def test_packed_examples_train_as_they_would_alone(family, sdpa_entry) -> None:
    windowed = hasattr(config_of(family, True), "sliding_window")
    model = build(family, window=True)
    ids = examples(SMALL["vocab_size"])
    reference, reference_grads = alone(model, ids)
    assert packed_attention.install(model.model)
    loss, grads = packed(model, ids)
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=0)
    assert grads.keys() == reference_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], reference_grads[name], rtol=1e-4, atol=1e-5)
    if windowed:  # the window matters here: full attention over each example gives another loss
        full = build(family, window=False, state=model.model.state_dict())
        full_loss, _ = alone(full, ids)
        assert abs(float(full_loss - reference)) > 1e-4 * float(reference), family


def test_gemma4_checkpoints_keep_packed_examples_apart(sdpa_entry) -> None:
    """Gemma 4's checkpoints (model_type gemma4: Gemma4ForConditionalGeneration, trained on text through its language
    model): a packed row gives each example the loss and gradients it has alone, its sliding layer's window (8)
    shorter than two of them. The start-up check it had instead refused --packing under bf16 once the model was a few
    layers deep (half precision's rounding alone moved a 12-layer one's hidden states by 4.3e-2, over 2e-2)."""
    from tests.unit.model.test_logits import gemma4_multimodal_config

    assert "gemma4" in VERIFIED
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(gemma4_multimodal_config(), dtype=torch.float32,
                                             attn_implementation="sdpa").eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0) if p.dim() == 2 else None
    wrapped = TokenLossModel(model)
    ids = examples(SMALL["vocab_size"])
    reference, reference_grads = alone(wrapped, ids)
    assert packed_attention.install(model)
    loss, grads = packed(wrapped, ids)
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=0)
    assert grads.keys() == reference_grads.keys()
    for name, grad in grads.items():  # (the embedding's rows sum their positions' gradients in another order)
        assert float((grad - reference_grads[name]).norm() / reference_grads[name].norm()) < 1e-5, name


def test_the_window_mask_is_transformers_sliding_window() -> None:
    mask = packed_attention.window_mask(6, 3, torch.device("cpu"))[0, 0]
    assert mask.tolist()[5] == [False, False, False, True, True, True]  # i - 3 < j <= i
    assert mask.tolist()[1] == [True, True, False, False, False, False]


@pytest.mark.parametrize("family", sorted(set(VERIFIED) - MULTIMODAL - set(sdpa_families())))
def test_eager_families_keep_packed_examples_apart(family) -> None:
    """The verified families without sdpa (Gemma-2) load with eager attention, whose mask transformers builds from
    the position ids: packed = alone there too."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config_of(family, True), dtype=torch.float32,
                                             attn_implementation="eager").eval()
    wrapped = TokenLossModel(model)
    ids = examples(SMALL["vocab_size"])
    reference, _ = alone(wrapped, ids)
    loss, _ = packed(wrapped, ids)
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=0)


def tiny_model(family: str, attn: str = "eager"):
    kwargs = {k: v for k, v in SMALL.items() if k not in ("pad_token_id", "bos_token_id", "eos_token_id")}
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **kwargs), attn_implementation=attn)


@pytest.mark.parametrize("family", ["bloom", "mpt", "xglm", "opt"])
def test_a_family_whose_mask_ignores_position_ids_is_refused_for_packing(family) -> None:
    """Unverified families whose eager mask is one causal mask over the whole row (their examples would attend to
    the ones packed before them): the start-up check names the family and stops the run."""
    from open_sft.errors import UserError
    from open_sft.model.packing_check import check_packing, packing_leak

    model = tiny_model(family)
    assert family not in VERIFIED and packing_leak(model) > 1e-3
    with pytest.raises(UserError, match=rf"--packing: model type '{family}' lets packed examples see each other"):
        check_packing(model)


def test_a_family_known_to_leak_is_refused_also_when_partitioned() -> None:
    """gpt-oss's loss is verified (no start-up loss check, so ZeRO-3 loads it partitioned), but its eager mask ignores
    position_ids: LEAKS names it, held here to its leak, and --packing is refused also where its parameters are
    partitioned and the check cannot run (it would otherwise only warn)."""
    from open_sft.errors import UserError
    from open_sft.model.loss_parity import LOSS_VERIFIED
    from open_sft.model.packing_check import LEAKS, check_packing, packing_leak

    model = tiny_model("gpt_oss")
    assert "gpt_oss" in LEAKS and "gpt_oss" in LOSS_VERIFIED and packing_leak(model) > 1e-3
    assert not LEAKS.keys() & VERIFIED
    for param in model.parameters():  # what deepspeed.zero.Init leaves on each parameter
        param.ds_numel = param.numel()
    with pytest.raises(UserError, match="--packing: model type 'gpt_oss' lets packed examples see each other"):
        check_packing(model)


@pytest.mark.parametrize("family, attn", [("olmo3", "sdpa"), ("exaone4", "sdpa"), ("ernie4_5", "eager"),
                                          ("opt", "sdpa")])
def test_an_unverified_family_that_keeps_examples_apart_passes_the_check(family, attn, sdpa_entry) -> None:
    from open_sft.model.packing_check import check_packing

    model = tiny_model(family, attn)
    packed_attention.install(model)
    assert family not in VERIFIED
    assert "keeps packed examples apart" in check_packing(model)
    assert check_packing(build("llama", window=False).model) is None  # verified: no check at start


def test_a_packing_run_of_such_a_family_stops_before_any_step(tiny_model_dir, tmp_path, capsys, sdpa_entry) -> None:
    """The check runs where a --packing run routes its attention: exit 2, the family named, no step, no export;
    the same model trains without --packing."""
    from transformers import AutoTokenizer

    from conftest import SAMPLE
    from open_sft.run import main

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model_dir = tmp_path / "bloom"
    config = AutoConfig.for_model("bloom", vocab_size=len(tokenizer), hidden_size=32, n_layer=2, n_head=4)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    common = ["--model_name_or_path", str(model_dir), "--dataset_mixer_list", str(SAMPLE), "16", "--max_train_steps",
              "1", "--per_device_train_batch_size", "4", "--max_seq_length", "128", "--torch_dtype", "float32",
              "--report_to", "none", "--dataset_local_cache_dir", str(tmp_path / "cache")]
    assert main(common + ["--output_dir", str(tmp_path / "packed"), "--packing"]) == 2
    err = capsys.readouterr().err
    assert "--packing: model type 'bloom' lets packed examples see each other" in err
    assert not (tmp_path / "packed" / "metrics.jsonl").exists() and not (tmp_path / "packed" / "config.json").exists()
    assert main(common + ["--output_dir", str(tmp_path / "padded")]) == 0


@pytest.mark.parametrize("family", ["phimoe", "qwen2_moe"])
def test_a_window_only_the_mask_holds_is_kept(family, sdpa_entry) -> None:
    """Phi-MoE and Qwen2-MoE put their sliding window only in the mask transformers builds (their attention gets
    no sliding_window argument): the per-example calls take each example's block of that mask, so packed rows
    still train each example alone with the window (a re-sweep found them trained without it)."""
    assert family not in VERIFIED
    model = build(family, window=True)
    ids = examples(SMALL["vocab_size"])
    reference, reference_grads = alone(model, ids)
    full = build(family, window=False, state=model.model.state_dict())
    assert abs(float(alone(full, ids)[0] - reference)) > 5e-6 * float(reference)  # the window matters (fp32: 1e-7)
    assert packed_attention.install(model.model)
    loss, grads = packed(model, ids)
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=0)
    for name in grads:
        torch.testing.assert_close(grads[name], reference_grads[name], rtol=1e-4, atol=1e-5)


def test_a_family_with_non_finite_gradients_on_packed_rows_is_refused() -> None:
    """Gemma-3n's text model: packed examples stay apart, but a row's block of pad tokens gives NaN gradients
    (every packed step would be skipped); the start-up check back-propagates such a row and refuses --packing."""
    from open_sft.errors import UserError
    from open_sft.model.packing_check import check_packing, packed_gradients_finite, packing_leak

    config = AutoConfig.for_model(
        "gemma3n_text", vocab_size=512, vocab_size_per_layer_input=512, hidden_size=64, hidden_size_per_layer_input=16,
        intermediate_size=[128, 128], num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        laurel_rank=8, activation_sparsity_pattern=[0.95, 0.0], layer_types=["sliding_attention", "full_attention"],
        sliding_window=16, num_kv_shared_layers=0, pad_token_id=2, max_position_embeddings=512)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    assert packing_leak(model) < 1e-5 and not packed_gradients_finite(model)
    with pytest.raises(UserError, match="--packing: model type 'gemma3n_text' gives non-finite gradients on a packed"):
        check_packing(model)
    assert packed_gradients_finite(tiny_model("olmo3", "sdpa"))


def test_a_causal_lm_whose_prefix_is_not_its_decoder_trains(sdpa_entry) -> None:
    """Llama4ForCausalLM's base_model_prefix is language_model, its decoder `model`: open_sft's loss (it runs the
    decoder itself) is the model's own, and the packing check runs (every Llama-4 text run stopped with an
    AttributeError; found by a re-sweep)."""
    from open_sft.model.anatomy import backbone_of
    from open_sft.model.packing_check import check_packing

    config = AutoConfig.for_model("llama4_text", vocab_size=96, hidden_size=32, intermediate_size=64,
                                  intermediate_size_mlp=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=8, num_local_experts=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    assert model.base_model_prefix == "language_model" and backbone_of(model) is model.model
    ids = examples(96)[0]
    theirs = model(input_ids=ids, labels=ids).loss
    ours = TokenLossModel(model)(input_ids=ids, labels=ids) / (ids.shape[1] - 1)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=0)
    packed_attention.install(model)
    assert "keeps packed examples apart" in check_packing(model)


def test_values_narrower_than_queries_are_packed(sdpa_entry) -> None:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2, GLM-4.7-Flash) gives values narrower than queries and keys
    (DeepSeek-V3: 128 against 192): the per-example calls' output was viewed at the queries' width, and every --packing
    run of such a model stopped with "shape '[1, 16, 4, 24]' is invalid" (found by a family sweep)."""
    model = build("deepseek_v3", window=False)
    attention = model.model.model.layers[0].self_attn
    assert attention.qk_head_dim == 16 and attention.v_head_dim == 8
    ids = examples(SMALL["vocab_size"])
    reference, reference_grads = alone(model, ids)
    assert packed_attention.install(model.model)
    loss, grads = packed(model, ids)
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=0)
    for name in grads:
        torch.testing.assert_close(grads[name], reference_grads[name], rtol=1e-4, atol=1e-5)
