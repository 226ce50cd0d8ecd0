"""Token-weighted evaluation loss over a held-out set, sharded across ranks."""

from __future__ import annotations

from typing import Callable

import torch

from open_sft.data.batching import collate, count_trained_batch


@torch.no_grad()
def evaluate(accelerator, model, data, batch_size: int, pad_token_id: int,
             reduce_sum: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
    """Sum of token losses over every eval example / their trained tokens (the same weighting as
    training). Rank r takes examples r, r + world, ...; every rank runs the same number of forward
    passes (ZeRO-3 gathers parameters collectively), padding its last batches with loss-free copies."""
    world, rank = accelerator.num_processes, accelerator.process_index
    mine = list(range(rank, len(data), world))
    batches = -(-len(range(0, len(data), world)) // batch_size)  # batches of the largest shard
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64)
    for b in range(batches):
        indices = mine[b * batch_size : (b + 1) * batch_size]
        if indices:
            batch = collate([data.example(i) for i in indices], pad_token_id)
        else:
            batch = collate([data.example(0)], pad_token_id, loss_free=True)
        batch.pop("lengths")
        with accelerator.autocast():
            loss_sum = model(**batch)
        totals[0] += float(loss_sum)
        totals[1] += count_trained_batch(batch["labels"])
    model.train()
    loss_sum, tokens = reduce_sum(totals).tolist()
    return {"eval_loss": loss_sum / max(tokens, 1.0), "eval_tokens": int(tokens)}
