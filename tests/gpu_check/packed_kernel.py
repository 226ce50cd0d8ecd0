"""The packed probe's measurements of torch's variable-length kernel itself (on CPU, its stand-in: stand_in.py), in
bf16, the dtype it runs in:

- latent: multi-head latent attention (DeepSeek-V3 and Kimi-K2's shape: queries and keys 128 + 64 = 192 wide,
  values 128, zero-padded for the kernel; DeepSeek-V2-Lite's, with no query compression, through its own modeling
  code; GLM-4.7-Flash's, 256 wide throughout), packed rows through the kernel against the examples padded one per
  row, loss and gradients, and the kernel's calls counted (not the per-example fallback);
- first_layer: the first attention layer's output (before any router) for one packed row through the kernel
  against each example attended alone on the same queries, keys and values, for a dense model and MoEs (Qwen3-MoE,
  Mixtral, Phi-3.5-MoE; one kind of attention layer each): the comparison open_sft.model.packing_check makes at
  start, at the first layer of each kind, where it measures a model again in fp32; then a
  planted acausal kernel, which it must find, and the packing check's verdict on a Phi-3.5-MoE with each kernel.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from tests.gpu_check.measure import DEVICE, smoke
from tests.gpu_check.packed import _count_varlen_calls, _examples, _grad_error, _model_loss
from tests.gpu_check.stand_in import acausal, varlen_stand_in

HEADS = {"num_attention_heads": 2 if smoke() else 4}
# the packed probe's example lengths and row (on CPU shorter: the smoke run's bf16 attention is slow there)
LENGTHS, ROW = ([37, 50, 5, 30, 12], 64) if smoke() else ([37, 300, 5, 180, 64, 511, 90, 12], 640)
# each family's attention at its real head widths (the rest tiny); dense MLPs, so no router flips the loss compared
LATENT = {
    "deepseek_v3": {**HEADS, "num_key_value_heads": HEADS["num_attention_heads"], "q_lora_rank": 96, "kv_lora_rank": 64,
                    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "first_k_dense_replace": 2,
                    "max_position_embeddings": 163840,  # V3's and Kimi-K2's YaRN, whose mscale enters the scale
                    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32.0,
                                        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                        "original_max_position_embeddings": 4096}},
    "deepseek_v2": {**HEADS, "num_key_value_heads": HEADS["num_attention_heads"], "q_lora_rank": None,
                    "kv_lora_rank": 64, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                    "first_k_dense_replace": 2},
    "glm4_moe_lite": {**HEADS, "num_key_value_heads": HEADS["num_attention_heads"], "q_lora_rank": 96,
                      "kv_lora_rank": 64, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256,
                      "mlp_layer_types": ["dense", "dense"]},
}
KV = {"num_attention_heads": 4, "num_key_value_heads": 2}
FIRST_LAYER = {"llama": KV, "qwen3_moe": {**KV, "num_experts": 4, "num_experts_per_tok": 2,
                                          "moe_intermediate_size": 64},
               "mixtral": {**KV, "num_local_experts": 4, "num_experts_per_tok": 2},
               "phimoe": {**KV, "num_local_experts": 4, "num_experts_per_tok": 2}}


def kernel() -> tuple[object, str]:
    """The kernel packed rows take here, and its name: torch's on CUDA, the stand-in on CPU."""
    from open_sft.model import packed_attention

    if DEVICE == "cuda":
        return packed_attention.varlen_kernel(), "varlen_flash"
    return varlen_stand_in, "cpu_stand_in (per-example sdpa in the kernel's contract)"


def _tiny(family: str, vocab: int, knobs: dict) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    hidden = 64 if smoke() else 256
    sizes = {"vocab_size": vocab, "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": 2,
             "pad_token_id": 0}
    if "qk_nope_head_dim" not in knobs:  # latent attention's head_dim is a name for its rotary width
        sizes["head_dim"] = hidden // knobs["num_attention_heads"]
    config = AutoConfig.for_model(family, **sizes, **knobs)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(DEVICE)


@contextlib.contextmanager
def _through(model: torch.nn.Module, use) -> Iterator[list[int]]:
    """`use` (a kernel) as the packed attention's kernel for `model`, its calls counted; transformers' "sdpa" entry
    and packed_attention.varlen_kernel as they were after."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from open_sft.model import packed_attention

    sdpa, varlen_kernel = ALL_ATTENTION_FUNCTIONS["sdpa"], packed_attention.varlen_kernel
    kernel_device = packed_attention.KERNEL_DEVICE
    try:
        # from transformers' own entry: install keeps a packed attention installed before (another test's, in the
        # unit run), which would not take `use`
        ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa_attention_forward
        packed_attention.varlen_kernel = lambda: use
        packed_attention.KERNEL_DEVICE = DEVICE  # the stand-in takes the CPU's tensors as the kernel the GPU's
        calls = _count_varlen_calls(packed_attention)
        packed_attention.install(model, varlen=True)
        yield calls
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"], packed_attention.varlen_kernel = sdpa, varlen_kernel
        packed_attention.KERNEL_DEVICE = kernel_device


def measure(vocab: int) -> dict:
    """The figures of both checks (`vocab`: the check's model's, so its ids fit)."""
    use, name = kernel()
    return {"kernel": name, "latent": {f: _latent(f, vocab, use) for f in LATENT},
            "first_layer": _first_layer(vocab, use)}


def _latent(family: str, vocab: int, use) -> dict:
    """Packed rows of a latent-attention model through the kernel against the examples padded one per row, as
    _packed_against_padded measures the check's own model."""
    from open_sft.data.batching import collate, collate_packed
    from open_sft.model.loss import TokenLossModel

    causal_lm = _tiny(family, vocab, LATENT[family])
    model = TokenLossModel(causal_lm).train()
    examples = _examples(vocab, LENGTHS)
    padded = collate(examples, pad_token_id=0)
    packed = collate_packed(examples, pad_token_id=0, row_capacity=ROW)
    fp32_loss, fp32_grads = _model_loss(model, padded, bf16=False)
    pad_loss, pad_grads = _model_loss(model, padded, bf16=True)
    attention = causal_lm.model.layers[0].self_attn
    result: dict = {"qk_head_dim": attention.qk_head_dim, "v_head_dim": attention.v_head_dim,
                    "layers": len(causal_lm.model.layers), "rows": list(packed["input_ids"].shape),
                    "bf16_padded": {"loss_rel_error": abs(pad_loss - fp32_loss) / fp32_loss,
                                    "grad_rel_error": _grad_error(pad_grads, fp32_grads)}}
    with _through(causal_lm, use) as calls:
        for dtype, bf16 in (("fp32", False), ("bf16", True)):
            before = calls[0]
            loss, grads = _model_loss(model, packed, bf16)
            result[dtype] = {"loss_rel_error": abs(loss - fp32_loss) / fp32_loss,
                             "grad_rel_error": _grad_error(grads, fp32_grads), "varlen_kernel_calls": calls[0] - before}
    return result


def _first_layer(vocab: int, use) -> dict:
    """The first attention layer, packed through the kernel against each example alone (bf16 autocast, as a run
    computes), per family; the same with the kernel made acausal; the packing check's verdict on Phi-3.5-MoE with
    the kernel and with the acausal one."""
    from open_sft.model.packing_precision import attention_moves

    lengths = LENGTHS[:4]
    ids = torch.randint(10, vocab, (1, sum(lengths)), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    result: dict = {"lengths": lengths}
    for label, family, kernel_used in [(f, f, use) for f in FIRST_LAYER] + [("llama_acausal", "llama", acausal(use))]:
        model = _tiny(family, vocab, FIRST_LAYER[family]).eval()
        with _through(model, kernel_used) as calls, torch.autocast(DEVICE, dtype=torch.bfloat16):
            moves = attention_moves(model, ids, lengths)
        result[label] = {"move": max(moves.values()) if moves else None, "varlen_kernel_calls": calls[0]}
    result["packing_check_phimoe"] = {label: _packing_check(vocab, k) for label, k in (("kernel", use),
                                                                                      ("acausal", acausal(use)))}
    return result


def _packing_check(vocab: int, use) -> str:
    """open_sft's start-up check of a --packing run (bf16) on a tiny Phi-3.5-MoE with packed rows through `use`: its
    log line, or its refusal."""
    from open_sft.errors import UserError
    from open_sft.model.packing_check import check_packing

    model = _tiny("phimoe", vocab, FIRST_LAYER["phimoe"])
    with _through(model, use):
        try:
            return check_packing(model, torch.bfloat16) or ""
        except UserError as exc:
            return f"refused: {exc}"
