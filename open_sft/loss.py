"""The training forward pass: sum of token cross-entropies over trained positions only.

Why not `model(..., labels=...)`: HF computes logits for every position (a [tokens, vocab] matrix,
the largest tensor of a small model's step) and returns a mean whose weighting depends on the
micro-batch. We run the backbone, keep the hidden states of positions that have a label, apply the
LM head to those alone, and return the *sum* of their losses in fp32 plus their count; the trainer
normalises over the global batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from open_sft.data.tokenize import IGNORE_INDEX


class TokenLossModel(nn.Module):
    """Wraps a causal LM so that DeepSpeed/DDP see one module whose forward returns the loss sum."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        backbone = getattr(self.model, self.model.base_model_prefix)
        hidden = backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        targets = labels[:, 1:]
        trained = targets != IGNORE_INDEX
        selected = hidden[:, :-1][trained]
        logits = self.model.get_output_embeddings()(selected)
        return F.cross_entropy(logits.float(), targets[trained], reduction="sum")
