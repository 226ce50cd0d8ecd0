"""The optimizer step under pipeline parallelism (open_sft.distributed.pipeline has the layout and the stages).

A replica of N stage ranks computes its members' micro-batches of the step plan together (as a TP group does),
slot by slot: N × accumulation micro-batches go through torch's schedule per step, each padded to the step's
largest (rows, width) — a schedule exchanges one activation shape; it is kept while the shape stays and replaced
when it changes, so shapes may differ between steps. Micro-batch m's loss is its token-loss sum × scale[m] (the target
passed to the schedule is each row's micro-batch index, so the scale is applied as the same Python float as in
the other engines). After the schedule: gradients summed over the replicas, and between the first and the last
stage for tied embeddings; the global gradient norm is summed over the stages; one optimizer step.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

from open_sft.data.batching import count_trained_batch, to_device, trained_sources
from open_sft.data.token_rows import IGNORE_INDEX
from open_sft.distributed.pipeline import StageModule, make_schedule, owned_parameters
from open_sft.distributed.pipeline_plan import PipelineLayout
from open_sft.training.trainer import Trainer

MODEL_KEYS = ("attention_mask", "position_ids", "labels")
WIDTH_MULTIPLE = 64  # a step's micro-batches are padded to a multiple of this: fewer distinct shapes
logger = logging.getLogger("open_sft.training.trainer")


@dataclass
class Pipeline:
    layout: PipelineLayout
    stages: list[StageModule]  # this rank's, in stage order
    pipeline_stages: list[Any]  # torch's PipelineStage of each
    schedule: str
    tied: bool  # the unsplit model ties its input embeddings and LM head
    sharded: bool = False  # FSDP2 shards each stage over its replicas (else every replica holds it whole)

    def last(self) -> Optional[StageModule]:
        return next((stage for stage in self.stages if stage.last), None)

    def first(self) -> Optional[StageModule]:
        return next((stage for stage in self.stages if stage.first), None)


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


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly FSDP2-sharded DTensor) tensor, in place."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class PipelineTrainer(Trainer):
    """Trainer whose forward and backward passes are a pipeline schedule (model: the TokenLossModel, whole on
    every rank with the parts other ranks own on the meta device; optimizer: this rank's parameters)."""

    def __init__(self, *args: Any, pipeline: Pipeline, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.pipeline = pipeline
        self.params = [p for _, p in owned_parameters(self.model) if p.requires_grad]
        # seconds this rank computed inside the schedules (its stages' forward and backward passes) and seconds
        # the schedules took: the rest is the pipeline bubble and the waits for neighbouring stages
        self.busy_s, self.schedule_s = 0.0, 0.0
        self.schedule, self.schedule_key, self.scales = None, None, []
        for stage in pipeline.pipeline_stages:
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                setattr(stage, name, self._timed(getattr(stage, name)))

    def _timed(self, method: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.busy_s += time.perf_counter() - started
        return timed

    def train(self, *args: Any, **kwargs: Any) -> list[dict]:
        """The loop; at its end each rank's idle share of the schedules' time is logged (collective)."""
        from open_sft.monitor.metrics import peak_memory_gib

        records = super().train(*args, **kwargs)
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        values = torch.zeros(3 * world, dtype=torch.float64)
        values[rank], values[world + rank], values[2 * world + rank] = self.busy_s, self.schedule_s, peak_memory_gib()
        values = self.reduce_sum(values).tolist()
        self.idle = [round(1 - busy / wall, 3) if wall else 0.0 for busy, wall in zip(values[:world],
                                                                                      values[world:2 * world])]
        if self.accelerator.is_main_process:
            logger.info("pipeline: each rank's idle share of the schedules' time (the bubble and the waits for "
                        "its neighbours): %s", self.idle)
            logger.info("pipeline: each rank's peak memory (GiB): %s", [round(v, 2) for v in values[2 * world:]])
        return records

    # ---------------------------------------------------------------------------------------------------------
    def _group_micro_batches(self, step: int, own: list) -> list[tuple[dict[str, torch.Tensor], list[int]]]:
        """The replica's micro-batches, slot by slot and member by member (every member collates the others'
        from the plan, a pure function: no collective)."""
        me = self.accelerator.process_index
        members = [own if rank == me else self._micro_batches(step, rank) for rank in self.pipeline.layout.replica_ranks()]
        return [passes[slot] for slot in range(len(own)) for passes in members]

    def _scales(self, batches: list[dict[str, torch.Tensor]], trained_global: float) -> list[float]:
        """Each micro-batch's loss multiplier: the other engines' (Trainer._loss_scale, one place for
        --loss_normalization) without the accumulation × ranks it multiplies in for those engines to divide out
        (the pipeline sums its micro-batches and its replicas' gradients), × the replicas under FSDP2, whose
        reduce-scatter averages over them."""
        undone = self.steps.layout.gradient_accumulation_steps * self.steps.layout.world_size  # (no SP under PP)
        averaged = self.pipeline.layout.replicas if self.pipeline.sharded else 1
        return [self._loss_scale(trained_global, count_trained_batch(b["labels"])) * averaged / undone
                for b in batches]

    def _run_schedule(self, batches: list[dict[str, torch.Tensor]], scales: Optional[list[float]]) -> None:
        """One schedule over the batches (step: with backward, `scales` given; eval: forward only)."""
        rows = max(b["input_ids"].shape[0] for b in batches)
        width = -(-max(b["input_ids"].shape[1] for b in batches) // WIDTH_MULTIPLE) * WIDTH_MULTIPLE
        fitted = [fit_shape({k: v for k, v in b.items() if k in ("input_ids", *MODEL_KEYS)}, rows, width,
                            self.pad_token_id)
                  for b in batches]
        whole = to_device({k: torch.cat([b[k] for b in fitted]) for k in fitted[0]}, self.accelerator.device)
        # each row carries its micro-batch's index: the loss function looks its scale up
        index = torch.arange(len(batches), device=whole["input_ids"].device).repeat_interleave(rows)
        self.scales = scales or []
        p = self.pipeline
        for stage in p.stages:
            stage.sums.clear()
            stage.kept.clear()
        # a schedule infers the activations' shapes on its first run (a placeholder pass and an exchange of
        # metadata): it is kept while the shapes stay, and replaced when they change
        key = (rows, width, len(batches), scales is not None)
        if key != self.schedule_key:
            self.schedule_key = key
            self.schedule = make_schedule(p.stages, p.pipeline_stages, len(batches),
                                          p.schedule if scales is not None else "gpipe", self._loss)
        schedule = self.schedule
        inputs = [whole["input_ids"]] if p.first() is not None else []
        kwargs = {k: whole[k] for k in MODEL_KEYS if k in whole}
        if scales is None:
            busy = self.busy_s
            schedule.eval(*inputs, target=index, return_outputs=False, **kwargs)
            self.busy_s = busy  # the idle share is the training schedules'
        else:
            started = time.perf_counter()
            schedule.step(*inputs, target=index, return_outputs=False, **kwargs)
            self.schedule_s += time.perf_counter() - started
        for stage in p.stages:  # a new schedule first runs the stage on placeholder inputs (shape inference)
            del stage.sums[: -len(batches)], stage.kept[: -len(batches)]

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """A micro-batch's loss for the backward: its token-loss sum × its scale (`target`: its index)."""
        return output[0] * self.scales[int(target[0])] if self.scales else output[0]

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

    def _clip_and_norm(self) -> float:
        """The global gradient norm over the stages (the tied weight counted once: on its first stage), clipped."""
        last = self.pipeline.last()
        skip = self._tied_weight() if (self.pipeline.tied and last is not None) else None
        grads = [p.grad for p in self.params if p.grad is not None and p is not skip]
        squares = sum((_local(g).detach().double().pow(2).sum() for g in grads),
                      torch.zeros((), dtype=torch.float64, device=self.accelerator.device))
        squares = squares.reshape(1).cpu() if torch.distributed.get_backend() == "gloo" else squares.reshape(1)
        if self.pipeline.sharded:  # each replica holds a shard of the stage's gradients
            torch.distributed.all_reduce(squares, group=self.pipeline.layout.replica_group)
        torch.distributed.all_reduce(squares, group=self.pipeline.layout.pipe_group)
        norm = float(squares.sqrt())
        if self.args.clip_grad_norm > 0 and math.isfinite(norm) and norm > self.args.clip_grad_norm:
            coefficient = self.args.clip_grad_norm / (norm + 1e-6)
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(coefficient)
        return norm

    def train_step(self, step: int) -> dict:
        n_sources = len(self.source_names)
        own, _, _, (trained_global, tokens_global, squares_global, slots_global, busiest_rank_slots,
                    source_tokens) = self._begin_step(step)
        self.seen_example_ids.extend(i for _, indices in own for i in indices)
        group = [batch for batch, _ in self._group_micro_batches(step, own)]
        positions = [trained_sources(batch) for batch in group]
        lr = self._set_lr(step)
        self.model.train()
        self._run_schedule(group, self._scales(group, trained_global))
        device = self.accelerator.device
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        source_loss = torch.zeros(n_sources, dtype=torch.float64, device=device)
        last = self.pipeline.last()
        if last is not None:  # the replica's losses: on its last stage only (0 elsewhere in the sums)
            for m, (value, kept) in enumerate(zip(last.sums, last.kept)):
                loss_sum += value.double()
                if kept is not None:
                    source_loss.index_add_(0, positions[m].to(device), kept.double())
                else:
                    source_loss[0] += value.double()
        self._sync_gradients()
        grad_norm = self._clip_and_norm()
        skipped = self._nonfinite(loss_sum, grad_norm)
        if not skipped:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        summed = self.reduce_sum(torch.cat([loss_sum.reshape(1), source_loss])).tolist()
        loss_global, source_loss_global = float(summed[0]), summed[1:]
        self._count_nonfinite(step, skipped or not math.isfinite(loss_global))
        if skipped or not math.isfinite(loss_global):
            loss_global, trained_global = 0.0, 0
            source_loss_global, source_tokens = [0.0] * n_sources, [0] * n_sources
        flops = self.flop_counter.step_flops(int(tokens_global), int(trained_global), int(squares_global))
        return {"loss_sum": loss_global, "trained_tokens": int(trained_global), "tokens": int(tokens_global),
                "padded_slots": int(slots_global), "busiest_rank_slots": busiest_rank_slots,
                "source_loss": source_loss_global, "source_tokens": source_tokens, "aux_sum": 0.0,
                "lr": lr, "grad_norm": grad_norm, "flops": flops}

    # ---------------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def _eval_result(self) -> dict:
        """The held-out loss through the pipeline: the replicas share the examples (replica r takes examples r,
        r + replicas, ...), each batch one forward-only schedule; the last stage counts."""
        from open_sft.data.batching import collate
        from open_sft.training.evaluate import summarize, tally

        layout, data = self.pipeline.layout, self.eval_data
        batch_size = self.args.per_device_eval_batch_size or self.args.per_device_train_batch_size
        kept_before, self.loss_model.keep_token_losses = self.loss_model.keep_token_losses, True
        totals = torch.zeros(2 + 2 * len(data.source_names), dtype=torch.float64)
        mine = list(range(layout.replica, len(data), layout.replicas))
        last = self.pipeline.last()
        self.model.eval()
        for start in range(0, len(mine), batch_size):
            indices = mine[start : start + batch_size]
            batch = collate([data.example(i) for i in indices], self.pad_token_id,
                            sources=[data.source(i) for i in indices])
            self._run_schedule([batch], None)
            if last is not None:
                tally(totals, float(last.sums[0]), batch["labels"], trained_sources(batch), last.kept[0])
        self.model.train()
        self.loss_model.keep_token_losses = kept_before
        return summarize(self.reduce_sum(totals).tolist(), data.source_names)


# -------------------------------------------------------------------------------------------------------------
# Building, checkpoints and the export
# -------------------------------------------------------------------------------------------------------------
def start_pipeline(loss_model: torch.nn.Module, train: Any, device: torch.device, shard: bool = False) -> Pipeline:
    """Split the TokenLossModel into this rank's stages (collective: the process groups). `shard` (an FSDP2
    launch): each stage's layers, and the rest of it, are FSDP2 units sharded over the stage's replicas, as
    torchtitan composes them; kept gathered through a step's micro-batches (reshard_after_forward=False)."""
    from torch.distributed.pipelining import PipelineStage

    from open_sft.distributed.pipeline import _backbone, check_stage_entry, split_model
    from open_sft.distributed.pipeline_plan import build_layout, plan_stages
    from open_sft.errors import UserError

    backbone = _backbone(loss_model)
    problem = check_stage_entry(loss_model)
    if problem is not None:
        raise UserError(f"--pipeline_parallel_size {train.pipeline_parallel_size}: {problem}; train this model "
                        "without pipeline parallelism")
    head = loss_model.causal_lm().get_output_embeddings()
    tied = head is not None and head.weight is backbone.embed_tokens.weight
    size, virtual = train.pipeline_parallel_size, train.pipeline_virtual_stages
    ranges, _ = plan_stages(loss_model.causal_lm(), train)
    layout = build_layout(size, virtual, tied)
    stages = split_model(loss_model, layout, ranges, device)
    sharded = shard and layout.replicas > 1
    if sharded:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (layout.replicas, size), mesh_dim_names=("replica", "stage"))["replica"]
        for stage in stages:
            for layer in stage.owned:
                fully_shard(layer, mesh=mesh, reshard_after_forward=False)
            fully_shard(stage, mesh=mesh, reshard_after_forward=False)
    pipeline_stages = [PipelineStage(stage, index, layout.stages, device, group=layout.pipe_group)
                       for stage, index in zip(stages, layout.stage_ids())]
    return Pipeline(layout, stages, pipeline_stages, train.pipeline_schedule, tied, sharded)


def describe(pipeline: Pipeline) -> str:
    ranges = ", ".join(f"stage {i}: layers {r.start}-{r.stop - 1}" for i, r in
                       ((s.stage_index, m.layer_range) for s, m in zip(pipeline.pipeline_stages, pipeline.stages)))
    layout = pipeline.layout
    sharded = ", each stage FSDP2-sharded over them" if pipeline.sharded else ""
    return (f"pipeline parallel {layout.size} × {layout.replicas} data-parallel replica(s){sharded}, schedule "
            f"{pipeline.schedule}, {layout.stages} stages; this rank: {ranges}")
