"""Packed rows under flash_attention_2: where each example starts, handed to flash-attn by the trainer.

A packed micro-batch holds several rows (a token budget of rows of --max_seq_length), each with several examples
told apart by their position ids restarting, and no attention mask. transformers' flash-attention path finds the
examples from the position ids only for a batch of one row; for more rows it runs plain causal attention over each
whole row, and every example attends to the ones packed before it in its row. transformers also takes the examples'
cumulative lengths as keyword arguments (its FlashAttentionKwargs: cu_seq_lens_q/k, max_length_q/k), flattens the
rows into one sequence and calls flash-attn's variable-length kernel on them: those are found here, on the host,
from the collated batch's position ids (the padding at the end of a row is a block of its own, as its positions
restart), and copied to the device with the batch, so no layer asks the device where examples start (transformers'
one-row detection reads the position ids off the device in every layer). Every family open_sft verifies hands them
from the model's forward to its attention (tests/unit/model/test_flash_packing.py).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from open_sft.data.batching import host_to_device
from open_sft.model.anatomy import causal_lm_of
from open_sft.model.packed_attention import segment_lengths

FLASH = "flash_attention_2"


def uses_flash(model: torch.nn.Module) -> bool:
    """Whether the model's attention (a transformers model, or a peft model around one) is transformers'
    flash_attention_2 (Ulysses sequence parallelism registers an attention of its own: a micro-batch of one row)."""
    config = getattr(causal_lm_of(model), "config", None)
    return getattr(config, "_attn_implementation", None) == FLASH


def packed_rows(position_ids: torch.Tensor, device: torch.device) -> dict[str, Any]:
    """The examples of a collated packed batch ([rows, length] position ids, on the host) as TokenLossModel takes
    them: their cumulative lengths over the flattened rows (int32, on `device`) and the longest; empty where every
    row holds one example (flash-attn's causal attention over each row is then right)."""
    lengths = segment_lengths(position_ids)
    if lengths is None:
        return {}
    bounds = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return {"cu_seq_lens": host_to_device(bounds, device), "max_length": max(lengths)}


def backbone_kwargs(cu_seq_lens: Optional[torch.Tensor], max_length: Optional[int]) -> dict[str, Any]:
    """transformers' FlashAttentionKwargs for packed rows' self-attention (queries and keys are the same tokens)."""
    if cu_seq_lens is None:
        return {}
    return {"cu_seq_lens_q": cu_seq_lens, "cu_seq_lens_k": cu_seq_lens, "max_length_q": max_length,
            "max_length_k": max_length}
