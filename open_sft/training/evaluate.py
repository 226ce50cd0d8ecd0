"""Token-weighted evaluation loss over a held-out set, sharded across ranks, in total and per source."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from open_sft.data.batching import collate, count_trained_batch, pop_counts, to_device, trained_sources
from open_sft.monitor.metrics import per_source


@torch.no_grad()
def evaluate(accelerator, model, data, batch_size: int, pad_token_id: int,
             reduce_sum: Callable[[torch.Tensor], torch.Tensor],
             autocast: Optional[Callable[[], Any]] = None, tp_ranks: Sequence[int] = ()) -> dict[str, float]:
    """Sum of token losses over every eval example / their trained tokens (the same weighting as
    training), and `eval_loss/<source>`, `eval_tokens/<source>` per source of the eval data. Rank r takes
    examples r, r + world, ...; every rank runs the same number of forward passes (ZeRO-3 gathers parameters
    collectively), padding its last batches with loss-free copies. One all-reduce at the end.

    Under tensor parallelism (`tp_ranks`: this rank's TP group) the ranks of a group compute the same batches:
    the data-parallel groups share the examples, and each group's first rank counts them."""
    loss_model = accelerator.unwrap_model(model)  # the TokenLossModel: each trained position's loss
    kept_before, loss_model.keep_token_losses = loss_model.keep_token_losses, True
    world, rank = accelerator.num_processes, accelerator.process_index
    counted = not tp_ranks or rank == tp_ranks[0]
    if tp_ranks:  # ranks are (data parallel, tp) row-major in accelerate's mesh: a group is T consecutive ranks
        world, rank = world // len(tp_ranks), rank // len(tp_ranks)
    mine = list(range(rank, len(data), world))
    batches = -(-len(range(0, len(data), world)) // batch_size)  # batches of the largest shard
    n_sources = len(data.source_names)
    model.eval()
    totals = torch.zeros(2 + 2 * n_sources, dtype=torch.float64)  # loss, tokens, per-source losses, tokens
    for b in range(batches):
        indices = mine[b * batch_size : (b + 1) * batch_size]
        loss_free, indices = not indices, indices or [0]
        batch = collate([data.example(i) for i in indices], pad_token_id, loss_free=loss_free,
                        sources=[data.source(i) for i in indices])
        pop_counts(batch)
        sources = trained_sources(batch)
        batch.pop("sources")
        with (autocast or accelerator.autocast)():
            loss_sum = model(**to_device(batch, accelerator.device))
        tally(totals, float(loss_sum), batch["labels"], sources, loss_model.token_losses)
    model.train()
    loss_model.keep_token_losses = kept_before
    return summarize(reduce_sum(totals if counted else torch.zeros_like(totals)).tolist(), data.source_names)


def tally(totals: torch.Tensor, loss_sum: float, labels: torch.Tensor, sources: torch.Tensor,
          token_losses: torch.Tensor) -> None:
    """Add one evaluated batch to a rank's sums: [loss, trained tokens, each source's loss, each source's
    tokens] (`sources`: each trained position's source; `token_losses`: each trained position's loss)."""
    n_sources = (len(totals) - 2) // 2
    totals[0] += loss_sum
    totals[1] += count_trained_batch(labels)
    totals[2 : 2 + n_sources].index_add_(0, sources, token_losses.double().cpu())
    totals[2 + n_sources :] += torch.bincount(sources, minlength=n_sources).double()


def summarize(summed: list[float], source_names: Sequence[str]) -> dict[str, float]:
    """The sums of every rank (`tally`'s, all-reduced) as the eval record's fields."""
    n_sources = len(source_names)
    loss_sum, tokens = summed[:2]
    return {"eval_loss": loss_sum / max(tokens, 1.0), "eval_tokens": int(tokens),
            **per_source(source_names, summed[2 : 2 + n_sources], summed[2 + n_sources :], prefix="eval_")}
