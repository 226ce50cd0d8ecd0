"""The start-up check that open_sft's loss is the model's own, for a family not verified ahead.

A family not in LOSS_VERIFIED (the families tests/unit/model/test_logits.py holds to the model's own loss) is
checked when it is loaded: our loss against `model(input_ids, labels=...)` on a short sequence; a difference
stops the run with the family named, instead of training a loss the model was not trained with.
"""

from __future__ import annotations

from typing import Optional

import torch

from open_sft.errors import UserError
from open_sft.model.anatomy import text_config
from open_sft.model.loss import TokenLossModel

# model_type of each family whose loss, with its logit transform, equals the model's own loss and gradients
# (tests/unit/model/test_logits.py, tiny random configs of each) and whose packed examples stay apart
# (tests/unit/model/test_packed_families.py): neither is checked at load. gemma4 is Gemma 4's checkpoints'
# Gemma4ForConditionalGeneration, trained on text (its forward applies its text model's logit cap).
VERIFIED = frozenset({
    "llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3_text", "phi", "phi3",
    "olmo", "olmo2", "olmoe", "granite", "granitemoe", "cohere", "cohere2", "gpt_neox", "starcoder2", "smollm3",
    "deepseek_v2", "deepseek_v3", "glm4_moe", "glm4_moe_lite", "dots1", "hunyuan_v1_moe", "minimax_m2", "gemma4_text",
    "gemma4",
})
# ... and those whose loss alone is held to the model's own by the same test: a --packing run still checks them at
# load (open_sft.model.packing_check; gpt-oss's eager mask ignores position_ids and is refused there). gemma3 is
# Gemma-3 4B-27B's multimodal Gemma3ForConditionalGeneration, trained on text (its forward applies no logit cap).
LOSS_VERIFIED = VERIFIED | frozenset({
    "gemma3", "olmo3", "gpt_oss", "qwen2_moe", "phimoe", "glm", "glm4", "ministral", "exaone4", "seed_oss", "helium",
    "apertus", "arcee", "ernie4_5", "ernie4_5_moe", "hunyuan_v1_dense", "recurrent_gemma", "xlstm",
})
PARITY_TOKENS = 24
PARITY_RTOL = 1e-4


def _probe_ids(vocab: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (1, PARITY_TOKENS), generator=generator)


@torch.no_grad()
def check_loss_parity(model: torch.nn.Module) -> Optional[str]:
    """For a family outside LOSS_VERIFIED: our loss against the model's own on a short sequence (a no-op for verified
    families). Returns a log line, or raises UserError when the two differ."""
    config = model.config
    family = getattr(config, "model_type", type(model).__name__)
    if family in LOSS_VERIFIED:
        return None
    if any(getattr(p, "ds_numel", None) is not None for p in model.parameters()):
        raise UserError(
            f"model type {family!r} is not among the families open_sft has verified its loss for "
            f"({', '.join(sorted(LOSS_VERIFIED))}), and its start-up check needs the whole model on each rank, but "
            "ZeRO-3 loaded it partitioned: launch with `accelerate launch --zero3_init_flag false ...` (or set "
            "`zero3_init_flag: false` under deepspeed_config in an accelerate config YAML); the model is then "
            "loaded whole on each rank and partitioned when training starts")
    device = next(model.parameters()).device
    ids = _probe_ids(text_config(config).vocab_size).to(device)
    was_training = model.training
    model.eval()
    try:
        router = {"output_router_logits": False} if hasattr(config, "output_router_logits") else {}  # no aux loss
        theirs = float(model(input_ids=ids, labels=ids, use_cache=False, **router).loss)
        ours = float(TokenLossModel(model)(input_ids=ids, labels=ids)) / (PARITY_TOKENS - 1)
    finally:
        model.train(was_training)
    if not abs(ours - theirs) <= PARITY_RTOL * abs(theirs):
        raise UserError(
            f"model type {family!r}: open_sft's loss ({ours:.6f}) differs from the model's own ({theirs:.6f}) on a "
            f"{PARITY_TOKENS}-token check: its causal-LM forward changes the logits in a way open_sft does not "
            "know (verified families: " + ", ".join(sorted(LOSS_VERIFIED)) + "); training would optimise another loss "
            "than the model's. Please report the model type.")
    return f"model type {family!r}: open_sft's loss equals the model's own on a {PARITY_TOKENS}-token check"

