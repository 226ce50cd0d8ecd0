"""The training forward pass: sum of token cross-entropies over trained positions only.

Why not `model(..., labels=...)`: HF computes logits for every position (a [tokens, vocab] matrix,
the largest tensor of a small model's step) and returns a mean whose weighting depends on the
micro-batch. We run the backbone, keep the hidden states of positions that have a label, apply the
LM head to those alone, and return the *sum* of their losses in fp32 plus their count; the trainer
normalises over the global batch. With a plain nn.Linear head the head and the loss are fused over chunks
of those positions (`open_sft.model.fused_ce`), so their [tokens, vocab] logits never exist at once.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from open_sft.data.labels import IGNORE_INDEX
from open_sft.model import liger_loss
from open_sft.model.anatomy import backbone_of, causal_lm_of
from open_sft.model.flash_packing import backbone_kwargs
from open_sft.model.fused_ce import lm_head_loss_sum
from open_sft.model.liger_loss import liger_loss_sum
from open_sft.model.lm_head import supports_fused
from open_sft.model.logits import logit_transform
from open_sft.model.router_loss import router_loss, router_loss_choice


class TokenLossModel(nn.Module):
    """Wraps a causal LM so that DeepSpeed/DDP see one module whose forward returns the loss sum."""

    def __init__(self, model: nn.Module, fused_loss: bool = True, load_balancing: Optional[bool] = False,
                 liger: bool = False):
        super().__init__()
        self.model = model
        self.fused_loss = fused_loss  # False: the plain lm_head + F.cross_entropy path (tests, benchmarks)
        self.liger = liger  # --use_liger_kernel: Liger's fused linear cross-entropy where it applies (on CUDA)
        # The trainer sets keep_token_losses to read each trained position's loss after a forward (per-source
        # losses); they come out of the same pass, detached.
        self.keep_token_losses = False
        self.token_losses: Optional[torch.Tensor] = None
        # what the model's own forward does to its logits before the loss (Gemma's cap, Granite's and Cohere's scale)
        self.transform = logit_transform(self.causal_lm().config)
        # the MoE router's auxiliary loss, as the model's own forward computes it, where --load_balancing_loss
        # (`load_balancing`) says so or, the flag not given (None), the model's config asks for it
        config = self.causal_lm().config
        on, self.router_choice = router_loss_choice(load_balancing, config)  # router_choice: the log line
        self.router = router_loss(self.causal_lm(), from_config=load_balancing is None) if on else None
        # a config asking for router logits makes the forward compute them unless told not to: told where unused
        self.router_switch = hasattr(config, "output_router_logits")
        self.aux_sum: Optional[torch.Tensor] = None  # the last training pass's aux loss × its trained tokens

    def causal_lm(self) -> nn.Module:
        """The transformers model; a peft model injects its adapters into it in place."""
        return causal_lm_of(self.model)

    def forward(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None,
                shift_labels: Optional[torch.Tensor] = None,
                trained_index: Optional[torch.Tensor] = None, cu_seq_lens: Optional[torch.Tensor] = None,
                max_length: Optional[int] = None, router_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Packed micro-batches pass position_ids (restarting per example) and no attention_mask (training an MoE's
        router loss, `router_mask`: the rows' real positions, which the router loss counts in place of it); under
        flash_attention_2 also where each example starts (`cu_seq_lens`, `max_length`: open_sft.model.flash_packing,
        found on the host). A sequence-parallel slice passes `shift_labels` (each position's target, shifted before
        the sequence was cut). The trainer passes `trained_index` (open_sft.data.batching.trained_index: the trained
        positions, found on the host) with `labels`."""
        causal_lm = self.causal_lm()
        backbone = backbone_of(causal_lm)
        # use_cache=False also matters for packing: transformers derives the block-diagonal mask from
        # position_ids only when no KV cache is passed.
        routed = self.router is not None and self.training
        out = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       use_cache=False, **({"output_router_logits": routed} if self.router_switch or routed else {}),
                       **backbone_kwargs(cu_seq_lens, max_length))
        loss, trained_count = self.head_loss(out.last_hidden_state, labels, shift_labels, trained_index)
        if routed:
            router = self.router
            counted = router_mask if router_mask is not None else attention_mask  # None: every position
            aux = router.function(out.router_logits, router.experts, router.top_k, counted).float()
            # token-weighted like the language-model loss: after the trainer divides the step's sum by its trained
            # tokens, a single micro-batch's loss is the model's own, mean cross-entropy + coefficient × aux
            self.aux_sum = (aux * trained_count).detach()
            loss = loss + router.coefficient * aux * trained_count
        return loss

    def head_loss(self, hidden: torch.Tensor, labels: Optional[torch.Tensor],
                  shift_labels: Optional[torch.Tensor] = None,
                  trained_index: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, int]:
        """The LM head and the loss on the backbone's last hidden states: (sum of the trained positions' token
        losses, their count). A pipeline's last stage calls it on the hidden states the stages computed.
        `trained_index` (with `labels`): the trained positions as the host found them, selected by index (the
        same rows in the same order as the mask selects, without the device's count the mask waits for)."""
        causal_lm = self.causal_lm()
        if trained_index is not None and shift_labels is None:
            selected = hidden.reshape(-1, hidden.shape[-1]).index_select(0, trained_index)
            targets = labels.reshape(-1).index_select(0, trained_index + 1)  # each position's next label
        else:
            shifted, inputs = (shift_labels, hidden) if shift_labels is not None else (labels[:, 1:], hidden[:, :-1])
            trained = shifted != IGNORE_INDEX
            selected, targets = inputs[trained], shifted[trained]
        lm_head = causal_lm.get_output_embeddings()
        kept = torch.empty(selected.shape[0], dtype=torch.float32, device=selected.device) \
            if self.keep_token_losses else None
        liger = self.fused_loss and self.liger and self._liger_applies(lm_head, selected, kept is not None)
        if liger:
            loss = liger_loss_sum(lm_head, selected, targets, self.transform)
        elif self.fused_loss and supports_fused(lm_head):
            loss = lm_head_loss_sum(lm_head, selected, targets, token_losses=kept, transform=self.transform,
                                    all_trained=True)
        else:
            logits = lm_head(selected).float()
            logits = logits if self.transform.identity else self.transform.apply(logits)
            loss = F.cross_entropy(logits, targets, reduction="sum")
            if kept is not None:
                kept.copy_(F.cross_entropy(logits.detach(), targets, reduction="none"))
        self.token_losses = kept
        return loss, selected.shape[0]

    def _liger_applies(self, lm_head: nn.Module, hidden: torch.Tensor, per_position: bool) -> bool:
        reason = liger_loss.why_not(lm_head, hidden, per_position, self.training)
        if reason is not None:
            liger_loss.say_once(reason)
        return reason is None

