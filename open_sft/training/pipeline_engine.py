"""The trainer's engine under pipeline parallelism (open_sft.distributed.pipeline_plan has the layout, open_sft.distributed.pipeline the stages).

A replica of N stage ranks computes its members' micro-batches of the step plan together (as a TP group does), slot
by slot: N × accumulation micro-batches go through torch's schedule per step, each padded to the step's largest
(rows, width) (FSDP2-sharded stages: the largest over the replicas) — a schedule exchanges one activation shape; it
is kept while the shape stays and replaced when it changes, so shapes may differ between steps. Micro-batch m's
loss is its token-loss sum × scale[m] (the target passed to the schedule is each row's micro-batch index, so the
scale is applied as the same Python float as in the other engines). After the schedule: gradients summed over the
replicas, and between the first and the last stage for tied embeddings; unscaled (fp16: every rank agrees on an
overflow); the global gradient norm is summed over the stages; one optimizer step. With --load_balancing_loss the
router logits travel with the hidden states, so the last stage adds the router loss of every layer, as the unsplit
model does.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Optional

import torch

from open_sft.data.batching import count_trained_batch, to_device, trained_sources
from open_sft.data.token_rows import IGNORE_INDEX
from open_sft.distributed.collectives import all_reduce_max
from open_sft.distributed.pipeline import Pipeline, make_schedule, owned_parameters
from open_sft.training.engine import AccelerateEngine, StepLosses, StepWork

MODEL_KEYS = ("attention_mask", "position_ids", "labels")
WIDTH_MULTIPLE = 64  # a step's micro-batches are padded to a multiple of this: fewer distinct shapes
logger = logging.getLogger("open_sft.training.trainer")


def fit_shape(batch: dict[str, torch.Tensor], rows: int, width: int, pad_token_id: int) -> dict[str, torch.Tensor]:
    """A collated micro-batch grown to (rows, width): padding with no loss. A padded row attends its own first
    position (an all-masked row of attention is NaN, and NaN × 0 is NaN in the weight gradients); a packed row's
    added columns are a block of their own."""
    have_rows, have_width = batch["input_ids"].shape
    if (have_rows, have_width) == (rows, width):
        return batch
    grown = {}
    fills = {"input_ids": pad_token_id, "labels": IGNORE_INDEX, "attention_mask": 0, "sources": 0}
    for key, value in batch.items():
        if key == "position_ids":
            out = torch.arange(width, dtype=value.dtype).repeat(rows, 1)
            out[:have_rows, have_width:] = torch.arange(width - have_width, dtype=value.dtype)
        else:
            out = torch.full((rows, width), fills[key], dtype=value.dtype)
            if key == "attention_mask":
                out[have_rows:, 0] = 1
        out[:have_rows, :have_width] = value
        grown[key] = out
    return grown


def schedule_shape(batches: list[dict[str, torch.Tensor]], agree: Optional[Any] = None) -> tuple[int, int]:
    """The (rows, width) a schedule's micro-batches are padded to: the largest of them, the width rounded up to
    WIDTH_MULTIPLE; with `agree` (FSDP2-sharded stages: the max over the stage's replicas, which run as many
    schedules, in training and in evaluation), the same on every replica. A new shape builds a new schedule, whose
    first run is a placeholder forward through the stage: under FSDP2 that forward all-gathers the stage's shards
    over its replicas, so a replica whose packed micro-batches had other rows than the others' decided alone and
    waited for them forever."""
    rows = max(b["input_ids"].shape[0] for b in batches)
    width = -(-max(b["input_ids"].shape[1] for b in batches) // WIDTH_MULTIPLE) * WIDTH_MULTIPLE
    if agree is not None:
        rows, width = agree([rows, width])
    return rows, width


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly FSDP2-sharded DTensor) tensor, in place."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class PipelineEngine(AccelerateEngine):
    """The trainer's engine under pipeline parallelism: the model is the TokenLossModel, whole on every rank with
    the parts other ranks own on the meta device; the optimizer holds this rank's parameters."""

    def __init__(self, trainer: Any, pipeline: Pipeline):
        super().__init__(trainer)
        self.pipeline = pipeline
        self.params = [p for _, p in owned_parameters(trainer.model) if p.requires_grad]
        # seconds this rank computed inside the schedules (its stages' forward and backward passes) and seconds
        # the schedules took: the rest is the pipeline bubble and the waits for neighbouring stages
        self.busy_s, self.schedule_s = 0.0, 0.0
        self.schedule, self.schedule_key, self.scales = None, None, []
        for stage in pipeline.pipeline_stages:
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                setattr(stage, name, self._timed(getattr(stage, name)))
        for stage in pipeline.stages:
            stage.autocast = trainer.precision.autocast

    def _can_skip_on_device(self) -> bool:
        return False  # the stages' norm is read to clip (clip_and_norm): the verdict is the host's anyway

    def _timed(self, method: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.busy_s += time.perf_counter() - started
        return timed

    def after_training(self) -> None:
        """Each rank's idle share of the schedules' time, and its peak memory, logged (collective)."""
        from open_sft.monitor.metrics import peak_memory_gib

        t = self.trainer
        world, rank = t.accelerator.num_processes, t.accelerator.process_index
        values = torch.zeros(3 * world, dtype=torch.float64)
        values[rank], values[world + rank], values[2 * world + rank] = self.busy_s, self.schedule_s, peak_memory_gib()
        values = t.reduce_sum(values).tolist()
        self.idle = [round(1 - busy / wall, 3) if wall else 0.0 for busy, wall in zip(values[:world],
                                                                                      values[world:2 * world])]
        if t.accelerator.is_main_process:
            logger.info("pipeline: each rank's idle share of the schedules' time (the bubble and the waits for "
                        "its neighbours): %s", self.idle)
            logger.info("pipeline: each rank's peak memory (GiB): %s", [round(v, 2) for v in values[2 * world:]])

    # ---------------------------------------------------------------------------------------------------------
    def forward_backward(self, work: StepWork) -> StepLosses:
        """The replica's micro-batches through one schedule; the losses are counted on its last stage (0
        elsewhere in the step's sums)."""
        t = self.trainer
        group = [batch for batch, _ in t.batches.group(work.step, work.batches, self.pipeline.layout.replica_ranks())]
        self._run_schedule(group, self._scales(group, work.trained_global))
        losses = StepLosses.zeros(len(t.source_names), t.accelerator.device)
        last = self.pipeline.last()
        if last is not None:
            for m, (value, aux, kept) in enumerate(zip(last.sums, last.aux, last.kept)):
                losses.add(value, aux, kept, trained_sources(group[m]))
        return losses

    def _scales(self, batches: list[dict[str, torch.Tensor]], trained_global: float) -> list[float]:
        """Each micro-batch's loss multiplier: the other engines' (Trainer.loss_scale, one place for
        --loss_normalization) without the accumulation × ranks it multiplies in for those engines to divide out
        (the pipeline sums its micro-batches and its replicas' gradients), × the replicas under FSDP2, whose
        reduce-scatter averages over them."""
        t = self.trainer
        undone = t.steps.layout.gradient_accumulation_steps * t.steps.layout.world_size  # (no SP under PP)
        averaged = self.pipeline.layout.replicas if self.pipeline.sharded else 1
        return [t.loss_scale(trained_global, count_trained_batch(b["labels"])) * averaged / undone for b in batches]

    def _run_schedule(self, batches: list[dict[str, torch.Tensor]], scales: Optional[list[float]]) -> None:
        """One schedule over the batches (step: with backward, `scales` given; eval: forward only)."""
        rows, width = schedule_shape(batches, self._replicas_max)
        fitted = [fit_shape({k: v for k, v in b.items() if k in ("input_ids", *MODEL_KEYS)}, rows, width,
                            self.trainer.pad_token_id)
                  for b in batches]
        whole = to_device({k: torch.cat([b[k] for b in fitted]) for k in fitted[0]}, self.trainer.accelerator.device)
        # each row carries its micro-batch's index: the loss function looks its scale up
        index = torch.arange(len(batches), device=whole["input_ids"].device).repeat_interleave(rows)
        self.scales = scales or []
        p = self.pipeline
        for stage in p.stages:
            stage.clear()
        # a schedule infers the activations' shapes on its first run (a placeholder pass and an exchange of
        # metadata): it is kept while the shapes stay, and replaced when they change
        key = (rows, width, len(batches), scales is not None)
        if key != self.schedule_key:
            self.schedule_key = key
            self.schedule = make_schedule(p.stages, p.pipeline_stages, len(batches),
                                          p.schedule if scales is not None else "gpipe", self._loss)
        inputs = [whole["input_ids"]] if p.first() is not None else []
        kwargs = {k: whole[k] for k in MODEL_KEYS if k in whole}
        if p.routed:  # the router's loss counts the tokens each micro-batch really has, not the padding added here
            kwargs["router_mask"] = torch.cat([router_mask(b, rows, width) for b in batches]).to(index.device)
        if scales is None:
            busy = self.busy_s
            self.schedule.eval(*inputs, target=index, return_outputs=False, **kwargs)
            self.busy_s = busy  # the idle share is the training schedules'
        else:
            started = time.perf_counter()
            self.schedule.step(*inputs, target=index, return_outputs=False, **kwargs)
            self.schedule_s += time.perf_counter() - started
        for stage in p.stages:  # a new schedule first runs the stage on placeholder inputs (shape inference)
            stage.keep_last(len(batches))

    def _replicas_max(self, values: list[int]) -> list[int]:
        """The largest of each value over the stage's replicas, where FSDP2 shards the stage over them (collective
        over the replica group; `values` unchanged otherwise)."""
        if not self.pipeline.sharded:
            return values
        return all_reduce_max(torch.tensor(values, dtype=torch.long), self.pipeline.layout.replica_group).tolist()

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """A micro-batch's loss for the backward: its loss sum × its scale (`target`: its index), × the fp16 loss
        scale."""
        return self.trainer.precision.scale(output[0] * self.scales[int(target[0])]) if self.scales else output[0]

    def _sync_gradients(self) -> None:
        """Sum over the replicas (one flat buffer per dtype), then over the tied embedding's two stages."""
        layout, dist = self.pipeline.layout, torch.distributed
        grads = [p.grad for p in self.params if p.grad is not None]
        if layout.replicas > 1 and grads and not self.pipeline.sharded:  # (FSDP2 reduce-scatters its own)
            for dtype in {g.dtype for g in grads}:
                same = [g for g in grads if g.dtype == dtype]
                flat = torch.cat([g.reshape(-1) for g in same])
                dist.all_reduce(flat, group=layout.replica_group)
                offset = 0
                for g in same:
                    g.copy_(flat[offset : offset + g.numel()].view_as(g))
                    offset += g.numel()
        tied = self._tied_weight()
        if tied is not None and tied.grad is not None:  # both copies sharded alike under FSDP2: shard by shard
            dist.all_reduce(_local(tied.grad), group=layout.tied_group)

    def _tied_weight(self) -> Optional[torch.nn.Parameter]:
        """The tied embedding's copy on this rank (first stage: the input embedding; last: the LM head)."""
        if not self.pipeline.tied:
            return None
        first, last = self.pipeline.first(), self.pipeline.last()
        module = first.embed if first is not None else (last.head if last is not None else None)
        return module.weight if module is not None else None

    def clip_and_norm(self) -> float:
        """Gradients summed over the replicas and the tied copies, unscaled (fp16: every rank agrees on an
        overflow), their global norm over the stages (the tied weight counted once: on its first stage), clipped."""
        self._sync_gradients()
        t = self.trainer
        t.precision.unscale()
        last = self.pipeline.last()
        skip = self._tied_weight() if (self.pipeline.tied and last is not None) else None
        grads = [p.grad for p in self.params if p.grad is not None and p is not skip]
        squares = sum((_local(g).detach().double().pow(2).sum() for g in grads),
                      torch.zeros((), dtype=torch.float64, device=t.accelerator.device))
        squares = squares.reshape(1).cpu() if torch.distributed.get_backend() == "gloo" else squares.reshape(1)
        if self.pipeline.sharded:  # each replica holds a shard of the stage's gradients
            torch.distributed.all_reduce(squares, group=self.pipeline.layout.replica_group)
        torch.distributed.all_reduce(squares, group=self.pipeline.layout.pipe_group)
        norm = float(squares.sqrt())
        if t.args.clip_grad_norm > 0 and math.isfinite(norm) and norm > t.args.clip_grad_norm:
            coefficient = t.args.clip_grad_norm / (norm + 1e-6)
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(coefficient)
        return norm

    # ---------------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict:
        """The held-out loss through the pipeline: the replicas share the examples (replica r takes examples r,
        r + replicas, ...), each batch one forward-only schedule; the last stage counts. Every replica runs as
        many schedules (FSDP2-sharded stages gather over the replicas): its last batches loss-free copies where
        it has fewer examples, as open_sft.training.evaluate pads."""
        from open_sft.data.batching import collate
        from open_sft.training.evaluate import summarize, tally

        t = self.trainer
        layout, data = self.pipeline.layout, t.eval_data
        batch_size = t.args.per_device_eval_batch_size or t.args.per_device_train_batch_size
        kept_before, t.loss_model.keep_token_losses = t.loss_model.keep_token_losses, True
        totals = torch.zeros(2 + 2 * len(data.source_names), dtype=torch.float64)
        mine = list(range(layout.replica, len(data), layout.replicas))
        batches = -(-len(range(0, len(data), layout.replicas)) // batch_size)  # those of the largest share
        last = self.pipeline.last()
        t.model.eval()
        for b in range(batches):
            indices = mine[b * batch_size : (b + 1) * batch_size]
            loss_free, indices = not indices, indices or [0]
            batch = collate([data.example(i) for i in indices], t.pad_token_id, loss_free=loss_free,
                            sources=[data.source(i) for i in indices])
            self._run_schedule([batch], None)
            if last is not None and not loss_free:
                tally(totals, float(last.sums[0]), batch["labels"], trained_sources(batch), last.kept[0])
        t.model.train()
        t.loss_model.keep_token_losses = kept_before
        return summarize(t.reduce_sum(totals).tolist(), data.source_names)

    def full_state_dict(self, fp32: bool = False) -> dict[str, torch.Tensor]:
        from open_sft.training.pipeline_state import gather_state_dict

        return gather_state_dict(self.pipeline, self.trainer.model)  # collective

    def checkpoint_io(self) -> Any:
        from open_sft.training.pipeline_state import PipelineState

        return PipelineState(self.pipeline, self.trainer.model, self.trainer.optimizer)


def router_mask(batch: dict[str, torch.Tensor], rows: int, width: int) -> torch.Tensor:
    """The positions a micro-batch's router loss counts, at the schedule's (rows, width): its attention mask
    (packed rows: their real positions, `router_mask`), the padding `fit_shape` adds left out."""
    have_rows, have_width = batch["input_ids"].shape
    mask = torch.zeros((rows, width), dtype=torch.long)
    mask[:have_rows, :have_width] = batch.get("attention_mask", batch.get("router_mask", 1))
    return mask
