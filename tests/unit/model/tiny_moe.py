"""Tiny configs of the mixture-of-experts families verified this far (DeepSeek-style routing, multi-head latent
attention), shared by the loss tests (test_logits.py) and the packing tests (test_packed_families.py)."""

# DeepSeek-style routed experts (one dense layer first), and multi-head latent attention (DeepSeek-V2/V3's, GLM-4.7-
# Flash's): values narrower than queries and keys, as many key/value heads as query heads
ROUTED = {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_group": 1, "topk_group": 1,
          "first_k_dense_replace": 1}
LATENT = {"kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
          "num_key_value_heads": 4}
# each routed family's own knobs
ROUTED_FAMILIES = {
    "deepseek_v2": {**ROUTED, **LATENT, "n_shared_experts": 1},
    "deepseek_v3": {**ROUTED, **LATENT, "n_shared_experts": 1},
    "glm4_moe": {**ROUTED, "n_shared_experts": 1},
    "glm4_moe_lite": {**ROUTED, **LATENT, "n_shared_experts": 1},
    "dots1": {**ROUTED, "n_shared_experts": 1},
    "hunyuan_v1_moe": {"num_experts": 4, "moe_topk": 2},
    "minimax_m2": {"num_local_experts": 4, "num_experts_per_tok": 2},
}
