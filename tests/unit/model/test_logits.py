"""Every family trains its own loss: TokenLossModel's loss and gradients (fused, chunked, and plain) equal the
model's own `model(input_ids, labels=...)` for tiny random configs of each verified family, with weights large
enough that a skipped logit cap or scale changes the loss; an unknown transform is caught at load."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from open_sft.errors import UserError
from open_sft.model.fused_ce import gpu_layout  # noqa: F401  (the GPU layout is patched in below)
from open_sft.model.logits import LogitTransform, logit_transform
from open_sft.model.loss import TokenLossModel
from open_sft.model.loss_parity import LOSS_VERIFIED, VERIFIED, check_loss_parity
from tests.unit.model.tiny_moe import ROUTED_FAMILIES

SMALL = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 64,
         "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
# Gemma 4's text model: a head size per layer (its full-attention layer's twice its sliding one's, transformers 5's
# per_layer_config), per-layer input embeddings
GEMMA4 = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8, "global_head_dim": 16,
          "vocab_size_per_layer_input": 96, "hidden_size_per_layer_input": 4}
# each family's own knobs, and a transform strong enough to matter at these weights
FAMILY = {
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 1,
                  "mlp_only_layers": []},
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 32, "decoder_sparse_step": 1, "mlp_only_layers": []},
    "phimoe": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8},
    "olmo3": {"sliding_window": 8},
    "granitemoe": {"num_local_experts": 4, "num_experts_per_tok": 2, "logits_scaling": 4.0},
    "gemma2": {"final_logit_softcapping": 0.5},
    "gemma3_text": {"final_logit_softcapping": 0.5},
    "gemma4_text": {"final_logit_softcapping": 0.1, **GEMMA4},
    "granite": {"logits_scaling": 4.0},
    "cohere": {"logit_scale": 0.25},
    "cohere2": {"logit_scale": 0.25},
    "gpt_neox": {"rotary_pct": 0.5},
    "phi": {"partial_rotary_factor": 0.5},
    **ROUTED_FAMILIES,
    "recurrent_gemma": {"logits_soft_cap": 0.5, "lru_width": 32, "attention_window_size": 8,
                        "block_types": ["recurrent", "attention"]},
    "xlstm": {"output_logit_soft_cap": 0.5, "embedding_dim": 32, "num_heads": 4, "num_blocks": 2, "qk_dim_factor": 0.5,
              "v_dim_factor": 1.0, "chunk_size": 4},
}
TRANSFORMED = {"gemma2", "gemma3_text", "gemma4", "gemma4_text", "granite", "granitemoe", "cohere", "cohere2", "recurrent_gemma", "xlstm"}


def gemma3_multimodal_config(**text):
    """Gemma-3 4B-27B's layout (model_type gemma3: Gemma3ForConditionalGeneration, its sizes and final_logit_softcapping
    in text_config), with a tiny vision tower."""
    from transformers import Gemma3Config

    tokens = {k: SMALL[k] for k in ("pad_token_id", "bos_token_id", "eos_token_id")}
    return Gemma3Config(text_config={**SMALL, "final_logit_softcapping": 0.5, **text},
                        vision_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                                       "num_attention_heads": 2, "image_size": 28, "patch_size": 14},
                        mm_tokens_per_image=4, image_token_index=95, boi_token_index=93, eoi_token_index=94, **tokens)


def gemma4_multimodal_config():
    """Gemma 4's checkpoints' layout (model_type gemma4: Gemma4ForConditionalGeneration, which applies its
    text_config's final_logit_softcapping), with a tiny vision tower."""
    from transformers import Gemma4Config

    tokens = {k: SMALL[k] for k in ("pad_token_id", "bos_token_id", "eos_token_id")}
    text = AutoConfig.for_model("gemma4_text", **{**SMALL, **FAMILY["gemma4_text"]})
    return Gemma4Config(text_config=text.to_dict(), audio_config=None,
                        vision_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                                       "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8,
                                       "patch_size": 4, "position_embedding_size": 64},
                        image_token_id=89, video_token_id=90, audio_token_id=91, boi_token_id=92, eoi_token_id=93,
                        boa_token_id=94, eoa_token_index=95, **tokens)


def tiny(family: str) -> torch.nn.Module:
    multimodal = {"gemma3": gemma3_multimodal_config, "gemma4": gemma4_multimodal_config}
    config = multimodal[family]() if family in multimodal else \
        AutoConfig.for_model(family, **{**SMALL, **FAMILY.get(family, {})})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():  # logits of a few units, so a cap at 0.5 or a scale of 4 changes the loss
        for p in model.parameters():
            p.mul_(4.0) if p.dim() == 2 else None
    return model


def their_loss_and_grads(model, ids, labels):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=labels, use_cache=False).loss
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def our_loss_and_grads(model, ids, labels, fused: bool, transform=None):
    wrapped = TokenLossModel(model, fused_loss=fused)
    if transform is not None:
        wrapped.transform = transform
    model.zero_grad(set_to_none=True)
    trained = int((labels[:, 1:] != -100).sum())
    loss = wrapped(input_ids=ids, labels=labels) / trained
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, SMALL["vocab_size"], (2, 20), generator=g)
    labels = ids.clone()
    labels[:, :5] = -100
    return ids, labels


@pytest.mark.parametrize("family", sorted(LOSS_VERIFIED))
@pytest.mark.parametrize("layout", ["cpu", "gpu"])
def test_our_loss_is_the_models_own(family, layout, monkeypatch) -> None:
    if layout == "gpu":  # the GPU's chunk layout (log-sum-exp, whole chunks), run here
        monkeypatch.setattr("open_sft.model.fused_ce.gpu_layout", lambda t: True)
    model = tiny(family)
    ids, labels = batch()
    theirs, their_grads = their_loss_and_grads(model, ids, labels)
    for fused in (True, False):
        ours, our_grads = our_loss_and_grads(model, ids, labels, fused)
        assert ours == pytest.approx(theirs, rel=1e-5), (family, fused)
        assert our_grads.keys() == their_grads.keys()
        for name, grad in their_grads.items():
            assert float((our_grads[name] - grad).norm() / grad.norm().clamp_min(1e-12)) < 1e-5, (family, name)
    if family in TRANSFORMED:  # the transform matters here: skipping it would train another loss (by 100 times the
        skipped, _ = our_loss_and_grads(model, ids, labels, True, transform=LogitTransform())  # tolerance at least;
        assert abs(skipped - theirs) > 1e-3 * theirs, family  # Gemma 4's final norm keeps its tiny logits small)
    else:
        assert logit_transform(model.config).identity, family


def test_transforms_read_from_configs() -> None:
    assert logit_transform(tiny("gemma2").config) == LogitTransform(1.0, 0.5)
    assert logit_transform(tiny("granite").config) == LogitTransform(0.25, None)
    assert logit_transform(tiny("cohere").config) == LogitTransform(0.25, None)
    assert logit_transform(tiny("recurrent_gemma").config) == LogitTransform(1.0, 0.5)
    assert logit_transform(tiny("xlstm").config) == LogitTransform(1.0, 0.5)
    assert LogitTransform(2.0, 3.0).describe() == "scaled by 2, capped at 3 (tanh)"


def test_a_planted_unknown_transform_is_caught_at_load(monkeypatch) -> None:
    """A family outside VERIFIED whose forward changes the logits (here Llama's forward, patched to halve them,
    under an unverified model_type) stops the run with the family named; an honest one passes the check."""
    model = tiny("llama")
    model.config.model_type = "mystery_lm"
    assert "equals the model's own" in check_loss_parity(model)
    original = type(model.lm_head).forward

    def halved(self, x):
        return original(self, x) * 0.5

    monkeypatch.setattr(type(model.lm_head), "forward", halved)
    # the fused loss calls lm_head's matmul itself: our loss keeps the unhalved logits, the model's own halves them
    with pytest.raises(UserError, match="model type 'mystery_lm'.*differs from the model's own"):
        check_loss_parity(model)
    model.config.model_type = "llama"
    assert check_loss_parity(model) is None  # verified families are not re-checked
    model.config.model_type = "gpt_oss"  # nor those whose loss alone is verified (packing is checked on its own)
    assert check_loss_parity(model) is None and "gpt_oss" not in VERIFIED


def test_an_unverified_family_partitioned_by_zero3_is_refused_with_both_forms_of_the_fix() -> None:
    """Under ZeRO-3's partitioned loading the check cannot run: the refusal gives the fix as accelerate's command-
    line flag (the README's ZeRO-3 command has no YAML to edit) and as the YAML key."""
    model = tiny("llama")
    model.config.model_type = "mystery_lm"
    for param in model.parameters():  # what deepspeed.zero.Init leaves on each parameter
        param.ds_numel = param.numel()
    with pytest.raises(UserError) as refused:
        check_loss_parity(model)
    message = str(refused.value)
    assert "model type 'mystery_lm'" in message and "olmo3" in message
    assert "accelerate launch --zero3_init_flag false" in message and "zero3_init_flag: false" in message


def test_load_model_refuses_a_family_whose_transform_it_does_not_know(tmp_path, monkeypatch) -> None:
    """Through load_model, as a run loads it: a Granite checkpoint whose logits_scaling open_sft did not know (its
    reading of the config patched out, Granite taken off the verified list) is refused before training; known, it
    loads with the transform logged."""
    from open_sft.config.args import ModelArguments
    from open_sft.model.load import load_model

    tiny("granite").save_pretrained(tmp_path)
    assert load_model(ModelArguments(model_name_or_path=str(tmp_path))).config.model_type == "granite"
    monkeypatch.setattr("open_sft.model.loss_parity.LOSS_VERIFIED", LOSS_VERIFIED - {"granite"})
    monkeypatch.setattr("open_sft.model.loss.logit_transform", lambda config: LogitTransform())
    with pytest.raises(UserError, match="model type 'granite'.*differs"):
        load_model(ModelArguments(model_name_or_path=str(tmp_path)))


MOE = ["granitemoe", "minimax_m2", "mixtral", "olmoe", "qwen3_moe"]


@pytest.mark.parametrize("family", MOE)
def test_router_loss_is_the_models_own(family) -> None:
    """--load_balancing_loss: on one micro-batch our loss (÷ its trained tokens, as the trainer normalises) is the
    model's own with output_router_logits=True, mean cross-entropy + router_aux_loss_coef × aux, gradients
    included; the aux kept for the metric is the model's aux_loss; evaluation leaves it out."""
    model = tiny(family).train()
    model.config.router_aux_loss_coef = model.router_aux_loss_coef = 0.5  # large enough to matter here
    ids, labels = batch()
    model.zero_grad(set_to_none=True)
    own = model(input_ids=ids, labels=labels, use_cache=False, output_router_logits=True)
    own.loss.backward()
    their_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    wrapped = TokenLossModel(model, load_balancing=True).train()
    model.zero_grad(set_to_none=True)
    trained = int((labels[:, 1:] != -100).sum())
    ours = wrapped(input_ids=ids, labels=labels) / trained
    ours.backward()
    assert float(ours.detach()) == pytest.approx(float(own.loss.detach()), rel=1e-5)
    assert float(wrapped.aux_sum) / trained == pytest.approx(float(own.aux_loss), rel=1e-5)
    assert float(own.aux_loss) * 0.5 > 1e-3 * float(own.loss)  # the router term is really in there
    for name, grad in their_grads.items():
        got = dict(model.named_parameters())[name].grad
        assert float((got - grad).norm() / grad.norm().clamp_min(1e-12)) < 1e-5, (family, name)
    routers = [n for n in their_grads if "router" in n or (".gate." in n and "proj" not in n)]
    assert routers, sorted(their_grads)
    model.zero_grad(set_to_none=True)
    (TokenLossModel(model)(input_ids=ids, labels=labels) / trained).backward()
    for name in routers:  # the router weights get the aux loss's gradient on top of the language model's
        assert not torch.allclose(dict(model.named_parameters())[name].grad, their_grads[name]), name
    wrapped.eval()
    with torch.no_grad():
        plain = TokenLossModel(model).eval()(input_ids=ids, labels=labels)
        assert float(wrapped(input_ids=ids, labels=labels)) == pytest.approx(float(plain), rel=1e-6)


def test_load_balancing_on_a_dense_model_is_refused() -> None:
    with pytest.raises(UserError, match="--load_balancing_loss: model type 'llama' is not a mixture-of-experts model, so there is no router"):
        TokenLossModel(tiny("llama"), load_balancing=True)
