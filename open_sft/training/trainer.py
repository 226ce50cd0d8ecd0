"""The training loop: global batches, token-normalised loss, optimizer steps, metrics.

Loss normalisation (--loss_normalization token): the gradient of an optimizer step is that of
    sum of token losses over the global batch (all micro-batches of all ranks) / its trained tokens.
The trained-token count of the global batch is all-reduced before the first micro-batch, so each
micro-batch's loss sum can be divided by it. Accelerate (outside DeepSpeed) and DeepSpeed both
divide the loss by the accumulation steps, and DDP/ZeRO average gradients over ranks, so we
multiply by accumulation × world size to undo both.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable, Optional, Sequence

import torch

from open_sft.config.args import TrainingArguments
from open_sft.data.batching import count_trained_batch, pop_counts, trained_sources
from open_sft.data.prepare import PreparedData
from open_sft.distributed.tensor_parallel import group_ranks
from open_sft.monitor.activations import SavedActivations
from open_sft.monitor.metrics import FlopCounter, MetricsWriter, peak_memory_gib, per_source, reserved_memory
from open_sft.monitor.quiet import SAID_ALIKE_BY_EVERY_RANK
from open_sft.training.amp import Precision
from open_sft.distributed.parallelism import Parallelism
from open_sft.training.engine import AccelerateEngine, NonFiniteError, StepLosses, StepWork
from open_sft.training.micro_batches import StepBatches
from open_sft.training.optim import lr_multiplier, optimizer_impl, schedule_floor, set_hyperparameters
from open_sft.training.steps import StepPlan
from open_sft.training.window import TrainingClock, Window

logger = logging.getLogger(__name__)

StepHook = Callable[[int, float], bool]  # (optimizer steps done, seconds the last one took) -> stop now


class Trainer:
    """The loop and the step every engine shares (`train_step`); `engine` (open_sft.training.engine) supplies the
    forward and backward passes, the clipping and the optimizer step of the way the run is spread."""

    def __init__(self, accelerator, model, optimizer, args: TrainingArguments, steps: StepPlan,
                 data: PreparedData, pad_token_id: int, flop_counter: FlopCounter, peak_flops: float,
                 metrics: Optional[MetricsWriter], reduce_sum: Callable[[torch.Tensor], torch.Tensor],
                 eval_data: Optional[PreparedData] = None, dtype: torch.dtype = torch.float32,
                 parallelism: Parallelism = Parallelism("single"),
                 engine: Callable[["Trainer"], AccelerateEngine] = AccelerateEngine):
        self.accelerator = accelerator
        self.model = model
        self.optimizer = optimizer
        self.args = args
        self.steps = steps
        self.data = data
        self.pad_token_id = pad_token_id
        self.flop_counter = flop_counter
        self.peak_flops = peak_flops
        self.metrics = metrics
        self.reduce_sum = reduce_sum
        # a pipeline's ranks hold different parameters: its fp16 loss scaler agrees on overflows over all of them
        self.precision = Precision(dtype, accelerator, optimizer, parallelism.deepspeed,
                                   torch.distributed.group.WORLD if parallelism.pp_enabled else None)
        # DeepSpeed 0.19's reduction of an SP group's gradients: ZeRO-3 leaves them 1/N of the group's sum, ZeRO-1/2
        # the whole sum (measured: the same run's gradient norm under ZeRO-2 was exactly N times one process's and
        # ZeRO-3's; clipping then cut twice as hard), so only ZeRO-3's loss is scaled back up by N
        self.sp_scale = parallelism.sp if parallelism.zero_stage == 3 else 1
        # --sequence_parallel_size: an SP group computes each micro-batch in N slices (distributed.sequence_parallel);
        # tensor parallelism: a TP group computes its members' micro-batches together (distributed.tensor_parallel)
        self.batches = StepBatches(data, steps, args, pad_token_id, accelerator.process_index, parallelism.sp,
                                   group_ranks(accelerator) if parallelism.tp_enabled else [],
                                   ahead=accelerator.device.type == "cuda",
                                   routed=accelerator.unwrap_model(model).router is not None)
        if accelerator.is_main_process:
            logger.info("optimizer: %s", optimizer_impl(optimizer))
        self.train_tokens = 0
        self.total_tokens = 0
        self.eval_data = eval_data
        self.eval_seconds: list[float] = []  # each evaluation's of this launch (the time estimate's)
        self.nonfinite_steps = 0
        self.nonfinite_in_a_row = 0
        self.window = Window(started=time.perf_counter())  # the logging window open now
        # training seconds of the launches before this one (a checkpoint's), and when this launch's loop started:
        # elapsed_s, tokens/s and the ETA count training time across resumes, never the downtime between them
        self.elapsed_before = 0.0
        self.clock = TrainingClock()  # this launch's training seconds (evaluation and checkpoints left out)
        self.source_names = data.source_names
        self.loss_model = accelerator.unwrap_model(model)  # the TokenLossModel: per-position losses
        # each trained position's loss, for the per-source losses of a run of several sources (one source's loss is
        # the step's; Liger's fused loss gives no per-position losses)
        self.loss_model.keep_token_losses = len(self.source_names) > 1
        self.seen_example_ids: list[int] = []  # this rank's examples, in order (tests check sharding)
        self.saved_activations = SavedActivations.if_requested()  # audit aid: measured activation bytes
        self.engine = engine(self)

    def loss_scale(self, trained_global: float, trained_local: float) -> float:
        """Multiplier on a micro-batch's loss sum so the step's gradient follows --loss_normalization, for an
        engine that divides the step's summed gradients by accumulation × ranks (DDP, FSDP2, DeepSpeed)."""
        undo = self.steps.layout.gradient_accumulation_steps * self.steps.layout.world_size * self.sp_scale
        if self.args.loss_normalization == "token":
            return undo / max(trained_global, 1.0)
        if self.args.loss_normalization == "sum":
            return float(undo)
        return 1.0 / max(trained_local, 1.0)  # "mean": each micro-batch's own mean, averaged

    def _set_lr(self, step: int) -> float:
        args = self.args
        lr = args.learning_rate * lr_multiplier(
            args.lr_scheduler_type, step, self.steps.warmup_steps, self.steps.total_steps, args.wsd_decay_ratio,
            schedule_floor(args.lr_scheduler_type, args.learning_rate, args.final_lr_ratio))
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def _nonfinite(self, loss_sum: torch.Tensor, grad_norm: torch.Tensor | float) -> bool | torch.Tensor:
        """Whether the step is skipped: any rank saw a non-finite loss or gradient norm (all ranks agree), as the
        engine judges it (DeepSpeed has stepped already, or skipped by itself: its verdict). Where the engine
        `skips_on_device`, the verdict is a device tensor (1.0: skip), agreed by an all-reduce on the device and
        read by the host only after the optimizer step (`_finish_step`)."""
        if self.engine.skips_on_device:
            bad = (~torch.isfinite(loss_sum) | ~torch.isfinite(grad_norm)).to(torch.float32).reshape(1)
            if self.steps.layout.world_size > 1:
                bad = (self.reduce_sum(bad) > 0).to(torch.float32)
            return bad.reshape(())
        bad = not (math.isfinite(float(loss_sum)) and (not self.engine.norm_before_step or math.isfinite(grad_norm)))
        bad = bool(self.reduce_sum(torch.tensor([float(bad)], dtype=torch.float64))[0] > 0)
        return self.engine.skipped(bad)

    def _count_nonfinite(self, step: int, bad: bool, overflow: bool = False) -> None:
        """Count a skipped step. An fp16 overflow (finite loss, gradients past fp16's range) is how dynamic loss
        scaling finds its scale: it counts toward the abort only once the scale is down to 1 and still overflows."""
        if not bad:
            self.nonfinite_in_a_row = 0
            return
        self.nonfinite_steps += 1
        scale = self.precision.loss_scale
        if overflow and scale is not None and scale >= 1:
            logger.warning("step %d: fp16 gradient overflow; the update was skipped and the loss scale is now %g",
                           step + 1, scale, **SAID_ALIKE_BY_EVERY_RANK)
            return
        self.nonfinite_in_a_row += 1
        logger.warning("step %d: non-finite loss or gradient; the update was skipped (%d so far, %d in a row)",
                       step + 1, self.nonfinite_steps, self.nonfinite_in_a_row, **SAID_ALIKE_BY_EVERY_RANK)
        if self.nonfinite_in_a_row >= self.args.max_nonfinite_steps:
            raise NonFiniteError(
                f"{self.nonfinite_in_a_row} optimizer steps in a row had a non-finite loss or gradient (last at "
                f"step {step + 1}); lower --learning_rate, check the data, or raise --max_nonfinite_steps")

    def _step_counts(self, batches: list, local_counts: list[int], positions: list[torch.Tensor],
                     n_sources: int) -> tuple:
        """The step's global counts in one all-reduce: trained tokens, tokens, the sums of squared example and row
        lengths (the two counts' attention FLOPs), positions computed, the busiest rank's positions, trained tokens
        per source."""
        lengths, row_lengths = zip(*(pop_counts(batch) for batch, _ in batches))
        slots_local = sum(batch["input_ids"].numel() for batch, _ in batches)
        squares = lambda tensors: sum(int((t.double() ** 2).sum()) for t in tensors)  # noqa: E731
        local = torch.tensor([sum(local_counts), sum(int(l.sum()) for l in lengths), squares(lengths),
                              squares(row_lengths), slots_local], dtype=torch.float64)
        source_counts = sum((torch.bincount(p, minlength=n_sources) for p in positions),
                            torch.zeros(n_sources, dtype=torch.float64))
        world = self.steps.layout.world_size
        rank_slots = torch.zeros(world, dtype=torch.float64)  # each rank's positions, gathered by the sum
        rank_slots[self.accelerator.process_index] = slots_local
        reduced = self.reduce_sum(torch.cat([local, rank_slots, source_counts])).tolist()
        return (*reduced[:5], int(max(reduced[5:5 + world])), [int(t) for t in reduced[5 + world:]])

    def _begin_step(self, step: int) -> StepWork:
        """This rank's micro-batches of the step, their trained tokens, each trained position's source, and the
        step's global counts (`_step_counts`, collective)."""
        batches = self.batches.for_step(step, step + 1 if step + 1 < self.steps.total_steps else None)
        local_counts = [count_trained_batch(batch["labels"]) for batch, _ in batches]
        positions = [trained_sources(batch) for batch, _ in batches]
        self.seen_example_ids.extend(i for _, indices in batches for i in indices)
        return StepWork(step, batches, local_counts, positions,
                        *self._step_counts(batches, local_counts, positions, len(self.source_names)))

    def train_step(self, step: int) -> dict:
        """One optimizer step: begin → the engine's forward and backward passes → its clipping and norm → the
        non-finite verdict → its optimizer step → finish. The per-source token counts and loss sums ride in the
        two all-reduces the step makes anyway (counts before the first micro-batch, loss sums after the last)."""
        work = self._begin_step(step)
        lr = self._set_lr(step)
        self.model.train()
        losses = self.engine.forward_backward(work)
        grad_norm = self.engine.clip_and_norm()
        skipped = self._nonfinite(losses.loss_sum, grad_norm)
        self.engine.optimizer_step(skipped)
        return self._finish_step(work, losses, lr, grad_norm, skipped)

    def _finish_step(self, work: StepWork, losses: StepLosses, lr: float, grad_norm: torch.Tensor | float,
                     skipped: bool | torch.Tensor) -> dict:
        """The step's global loss sums (collective), the non-finite count, and the step's record. The first place
        the host reads the step's device values (the verdict and norm, if still on the device, are read after the
        sums: by then the step is done)."""
        n_sources = len(self.source_names)
        summed = self.reduce_sum(torch.cat([losses.loss_sum.reshape(1), losses.aux_sum.reshape(1),
                                            losses.source_loss])).tolist()
        skipped, grad_norm = bool(skipped), self.engine.grad_norm(float(grad_norm))
        loss_global, aux_global, source_loss_global = float(summed[0]), float(summed[1]), summed[2:]
        trained_global, source_tokens = work.trained_global, work.source_tokens
        self._count_nonfinite(work.step, skipped or not math.isfinite(loss_global),
                              overflow=self.precision.fp16 and math.isfinite(loss_global))
        if skipped or not math.isfinite(loss_global):  # the step taught nothing: keep it out of the loss
            loss_global, trained_global, aux_global = 0.0, 0, 0.0
            source_loss_global, source_tokens = [0.0] * n_sources, [0] * n_sources
        flops = self.flop_counter.step_flops(int(work.tokens_global), int(trained_global), int(work.squares_global))
        flops_palm = self.flop_counter.palm_flops(int(work.tokens_global), int(work.row_squares_global))
        return {"loss_sum": loss_global, "trained_tokens": int(trained_global), "tokens": int(work.tokens_global),
                "padded_slots": int(work.slots_global), "busiest_rank_slots": work.busiest_rank_slots,
                "source_loss": source_loss_global, "source_tokens": source_tokens, "aux_sum": aux_global,
                "lr": lr, "grad_norm": grad_norm, "flops": flops, "flops_palm": flops_palm}

    def elapsed(self) -> float:  # training seconds so far: earlier launches' (the checkpoint's) and this one's
        return self.elapsed_before + self.clock.seconds()

    def state_dict(self) -> dict[str, Any]:
        """What a resume needs of the loop besides model, optimizer and RNG: the run's counters, its training
        seconds so far and the open logging window (its sums and the seconds it has run)."""
        return {"train_tokens": self.train_tokens, "total_tokens": self.total_tokens, "elapsed_s": self.elapsed(),
                "nonfinite_steps": self.nonfinite_steps, "nonfinite_in_a_row": self.nonfinite_in_a_row,
                "window": self.window.to_state(self.clock.now()), **self.precision.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state_dict()` (older checkpoints lack the non-finite counters and the elapsed
        seconds: 0), with the optimizer's hyperparameters the flags' (the checkpoint's were loaded with its state)."""
        args = self.args
        set_hyperparameters(self.optimizer, args.weight_decay, (args.adam_beta1, args.adam_beta2), args.adam_epsilon)
        self.train_tokens = int(state["train_tokens"])
        self.elapsed_before = float(state.get("elapsed_s", 0.0))
        self.total_tokens = int(state["total_tokens"])
        self.nonfinite_steps = int(state.get("nonfinite_steps", 0))
        self.nonfinite_in_a_row = int(state.get("nonfinite_in_a_row", 0))
        self.window = Window.from_state(state["window"])
        self.precision.load_state_dict(state)

    def train(self, start_step: int = 0, after_step: Sequence[StepHook] = ()) -> list[dict]:
        """Run to the end of the schedule; returns the logged records (also written to metrics.jsonl).

        Resuming passes the step to start at (after `load_state_dict`). Each hook of `after_step` (step timer,
        progress bar, checkpointing and preemption) is called after every optimizer step with the steps done
        and the seconds the step took; the loop stops early when any of them returns True.
        """
        records = []
        self.clock.start(self.window)
        for step in range(start_step, self.steps.total_steps):
            step_started = self.clock.seconds()
            window = self.window
            result = self.train_step(step)
            window.add(result, len(self.source_names))
            self.train_tokens += result["trained_tokens"]
            self.total_tokens += result["tokens"]
            done = step + 1
            if done % self.args.logging_steps == 0 or done == self.steps.total_steps:
                record = self._window_record(done, window, result)
                records.append(record)
                self._log(record)
                self.window = Window(started=time.perf_counter())
            with self.clock.pause(self.window):
                if self.eval_data is not None and (done == self.steps.total_steps or (
                        self.args.eval_steps and done % self.args.eval_steps == 0)):
                    began = time.perf_counter()
                    records.append(self.evaluate(done))
                    self.eval_seconds.append(time.perf_counter() - began)
            seconds = self.clock.seconds() - step_started
            with self.clock.pause(self.window):
                stop = any([hook(done, seconds) for hook in after_step])  # a list: every hook runs
            if stop:
                break
        self.clock.stop()
        self.batches.close()
        self.engine.after_training()
        return records

    def _window_record(self, done: int, window: Window, result: dict) -> dict:
        """The metrics.jsonl line of a logging window closing after `done` optimizer steps (`result`: its last step's,
        Trainer.train_step's): the window's sums over its training seconds, the run's counters so far."""
        seconds = max(time.perf_counter() - window.started, 1e-9)
        return {
            "step": done,
            "epoch": round(self.steps.epochs_done(done), 4),
            # A window whose every step was skipped (non-finite) has no loss: NaN, not a false 0.0.
            "loss": window.loss_sum / window.trained_tokens if window.trained_tokens else float("nan"),
            "learning_rate": result["lr"],
            "grad_norm": result["grad_norm"],
            "train_tokens": self.train_tokens,
            "total_tokens": self.total_tokens,
            "tokens_per_second": window.tokens / seconds,
            "mfu": window.flops / seconds / (self.peak_flops * self.steps.layout.world_size),
            "mfu_palm": window.flops_palm / seconds / (self.peak_flops * self.steps.layout.world_size),
            "peak_memory_gib": peak_memory_gib(),
            **reserved_memory(),
            "padding_ratio": 1 - window.tokens / max(window.padded_slots, 1),
            # 1.0 when ranks computed equal shares; 1.5: each step waited for a rank with 1.5× the mean.
            "rank_tokens_max_over_mean": self.steps.layout.world_size * window.busiest_rank_slots
                                         / max(window.padded_slots, 1),
            "nonfinite_steps": self.nonfinite_steps,
            **({"loss_scale": self.precision.loss_scale} if self.precision.fp16 else {}),
            **({"aux_loss": window.aux_sum / max(window.trained_tokens, 1)} if self.loss_model.router else {}),
            "elapsed_s": self.elapsed(),
            **per_source(self.source_names, window.source_loss, window.source_tokens),
        }

    def evaluate(self, done: int) -> dict:
        """Evaluate now and log an eval line: step, epoch, eval_loss, eval_tokens."""
        record = {"step": done, "epoch": round(self.steps.epochs_done(done), 4), **self.engine.evaluate()}
        if self.accelerator.is_main_process:
            logger.info("step %d/%d | eval_loss %.4f over %d tokens", done, self.steps.total_steps,
                        record["eval_loss"], record["eval_tokens"])
            if self.metrics is not None:
                self.metrics.write(record)
        return record


    def _log(self, record: dict) -> None:
        if not self.accelerator.is_main_process:
            return
        total = self.steps.total_steps
        remaining = record["elapsed_s"] / record["step"] * (total - record["step"])
        logger.info(
            "step %d/%d | loss %.4f | lr %.3g | grad_norm %.3f | %.0f tok/s | mfu %.1f%% (PaLM count %.1f%%) | "
            "mem %.2f GiB | eta %.0fs",
            record["step"], total, record["loss"], record["learning_rate"], record["grad_norm"],
            record["tokens_per_second"], 100 * record["mfu"], 100 * record["mfu_palm"], record["peak_memory_gib"],
            remaining,
        )
        if self.metrics is not None:
            self.metrics.write(record)
