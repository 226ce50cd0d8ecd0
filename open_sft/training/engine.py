"""The engines of the training step. A step is the same everywhere (open_sft.training.trainer.Trainer.train_step):
begin (the micro-batches and the step's global counts) → the engine's forward and backward over the step's
micro-batches → the engine's unscale, clip and gradient norm → the non-finite verdict → the engine's optimizer
step → finish (the loss sums, the schedule, the records). What differs between the ways a run is spread lives
here, in the parts an engine supplies:

- `AccelerateEngine`: one process, DDP, FSDP2, tensor and Ulysses sequence parallelism — micro-batches under
  accelerate's `accumulate` (DDP's gradient sync on the last), accelerate's clipping, the optimizer stepped once.
  Where the optimizer is torch's fused AdamW on plain (unsharded) parameters in bf16 or fp32 (one process, DDP:
  `skips_on_device`), the non-finite verdict stays on the device: the optimizer skips the update itself, so the
  host reads nothing of the step before the optimizer step is queued (on a GPU the host no longer waits for the
  backward to end there; the step's values are read once, after it).
- `DeepSpeedEngine`: the same passes; DeepSpeed clips and steps inside the last backward, skipping a step whose
  gradient is not finite by itself, so its verdict and its gradient norm are read afterwards.
- `open_sft.training.pipeline_engine.PipelineEngine`: the micro-batches of a pipeline replica through torch's
  schedule.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

from open_sft.data.batching import host_to_device, to_device, trained_index
from open_sft.distributed.collectives import gather_full_state_dict
from open_sft.errors import UserError
from open_sft.model.flash_packing import packed_rows, uses_flash
from open_sft.model.packed_attention import known_segments
from open_sft.training.evaluate import evaluate

if TYPE_CHECKING:
    from open_sft.training.trainer import Trainer


class NonFiniteError(UserError):
    """Training diverged: too many non-finite steps in a row (or DeepSpeed applied a non-finite step)."""


@dataclass
class StepWork:
    """What the step's beginning hands the engine: this rank's micro-batches of the step (with their example
    indices), each one's trained tokens and the source of each trained position, and the global counts."""

    step: int
    batches: list[tuple[dict[str, torch.Tensor], list[int]]]
    counts: list[int]
    positions: list[torch.Tensor]
    trained_global: float
    tokens_global: float
    squares_global: float  # the sum of squared example lengths (the strict count's attention FLOPs)
    row_squares_global: float  # the sum of squared row lengths, real tokens (the PaLM count's)
    slots_global: float  # positions computed
    busiest_rank_slots: int
    source_tokens: list[int]


@dataclass
class StepLosses:
    """This rank's sums over the step's passes, kept on the device: the language model's loss, the router's
    auxiliary loss (× trained tokens) and the loss per source."""

    loss_sum: torch.Tensor
    aux_sum: torch.Tensor
    source_loss: torch.Tensor

    @classmethod
    def zeros(cls, sources: int, device: torch.device) -> "StepLosses":
        zero = lambda: torch.zeros((), dtype=torch.float64, device=device)  # noqa: E731
        return cls(zero(), zero(), torch.zeros(sources, dtype=torch.float64, device=device))

    def add(self, lm_loss: torch.Tensor, aux: Optional[torch.Tensor], kept: Optional[torch.Tensor],
            positions: torch.Tensor) -> None:
        """One pass: its language-model loss sum, its aux sum (None: no router loss), each trained position's
        loss (None: one source, whose loss is the language model's) and each trained position's source."""
        lm_loss = lm_loss.detach().double()
        self.loss_sum += lm_loss
        if aux is not None:
            self.aux_sum += aux.double()
        if kept is not None:
            self.source_loss.index_add_(0, host_to_device(positions, self.source_loss.device), kept.double())
        else:
            self.source_loss[0] += lm_loss


def fused_adamw(optimizer: Any) -> Optional[torch.optim.AdamW]:
    """The torch AdamW with the fused kernel inside accelerate's wrapper, if that is what steps the weights."""
    inner = getattr(optimizer, "optimizer", optimizer)
    return inner if isinstance(inner, torch.optim.AdamW) and inner.defaults.get("fused") else None


class AccelerateEngine:
    """One process, DDP, FSDP2, TP or Ulysses SP: the model and optimizer as the Accelerator prepared them."""

    norm_before_step = True  # the gradient norm is known before the optimizer step (the non-finite check reads it)

    def __init__(self, trainer: "Trainer"):
        self.trainer = trainer
        self.skips_on_device = self._can_skip_on_device()
        # packed rows under flash_attention_2 are told where each example starts (Ulysses SP: its own attention)
        self.flash_rows = uses_flash(trainer.loss_model.causal_lm()) and trainer.batches.sp_size == 1

    def _can_skip_on_device(self) -> bool:
        """Whether the step's non-finite verdict can stay a device tensor the optimizer reads (`optimizer_step`):
        torch's fused AdamW skips the whole update (weights, moments, weight decay, its step count) when its
        `found_inf` tensor is 1 — the argument torch's GradScaler hands it — so the host need not know the verdict
        before the step. Not under fp16 (GradScaler sets that argument itself) nor on DTensor parameters (FSDP2, TP:
        the fused kernel's DTensor rule takes no plain tensor beside them); the others decide on the host."""
        t = self.trainer
        return (fused_adamw(t.optimizer) is not None and not t.precision.fp16
                and not any(hasattr(p, "to_local") for p in t.model.parameters()))

    def forward_backward(self, work: StepWork) -> StepLosses:
        """Every forward pass of the step, each followed by its backward (gradients synced on the last); the
        weights cast to the compute dtype once for all of them (Precision.step_casts)."""
        t = self.trainer
        losses = StepLosses.zeros(len(t.source_names), t.accelerator.device)
        passes = t.batches.passes(work.step, [batch for batch, _ in work.batches], work.positions, work.counts,
                                  t.accelerator, t.model)
        with t.precision.step_casts():
            for batch, trained_positions, trained_local in passes:
                self._pass(batch, trained_positions, trained_local, work, losses)
        return losses

    def _pass(self, batch: dict, trained_positions: Optional[torch.Tensor], trained_local: int, work: StepWork,
              losses: StepLosses) -> None:
        """One forward pass and its backward; its losses added to the step's."""
        t = self.trainer
        loss_model = t.loss_model
        inputs = to_device(batch, t.accelerator.device)
        # what the host knows of the batch, so the device need not be asked: the trained positions and the example
        # lengths of packed rows (on a GPU, finding either from the device's copy waits for the device)
        if "labels" in batch and "shift_labels" not in batch:
            inputs["trained_index"] = host_to_device(trained_index(batch["labels"]), t.accelerator.device)
        known_segments(inputs.get("position_ids"), batch.get("position_ids"))
        if self.flash_rows and "position_ids" in batch and "attention_mask" not in batch:
            inputs.update(packed_rows(batch["position_ids"], t.accelerator.device))
        with t.accelerator.accumulate(t.model):
            with t.precision.autocast(), (t.saved_activations.measure() if t.saved_activations
                                          else contextlib.nullcontext()):
                token_loss_sum = t.model(**inputs)
            if trained_positions is not None:  # None: a TP group member's pass, counted on its own rank
                aux = loss_model.aux_sum if loss_model.router else None
                lm_loss = token_loss_sum.detach().double() - (  # the logged loss: the language model's
                    loss_model.router.coefficient * aux.double() if aux is not None else 0.0)
                losses.add(lm_loss, aux, loss_model.token_losses, trained_positions)
            t.accelerator.backward(
                t.precision.scale(token_loss_sum * t.loss_scale(work.trained_global, trained_local)))

    def clip_and_norm(self) -> torch.Tensor | float:
        """The gradients unscaled (fp16) and clipped to --clip_grad_norm; their global norm before clipping (a
        device tensor where the verdict stays on the device: not read before the optimizer step)."""
        t = self.trainer
        t.precision.unscale()
        max_norm = t.args.clip_grad_norm if t.args.clip_grad_norm > 0 else float("inf")
        norm = t.accelerator.clip_grad_norm_(t.model.parameters(), max_norm)
        return norm.detach() if self.skips_on_device else float(norm)

    def skipped(self, bad: bool) -> bool:
        """Whether the step is skipped, given whether any rank saw a non-finite loss or norm."""
        return bad

    def optimizer_step(self, skipped: bool | torch.Tensor) -> None:
        """The update, unless `skipped`: a bool the host decided, or (`skips_on_device`) a device tensor, 1.0 to
        skip, which the fused kernel reads on the device."""
        t = self.trainer
        if isinstance(skipped, torch.Tensor):
            adamw = fused_adamw(t.optimizer)
            adamw.found_inf = skipped
            try:
                t.optimizer.step()
            finally:
                del adamw.found_inf  # never left to a step that did not set it
        elif not skipped:
            t.optimizer.step()
        t.optimizer.zero_grad(set_to_none=True)
        t.precision.update()

    def grad_norm(self, measured: float) -> float:
        """The step's gradient norm for the records."""
        return measured

    def evaluate(self) -> dict:
        """eval_loss, eval_tokens and the per-source fields over the held-out set (collective)."""
        t = self.trainer
        batch_size = t.args.per_device_eval_batch_size or t.args.per_device_train_batch_size
        return evaluate(t.accelerator, t.model, t.eval_data, batch_size, t.pad_token_id, t.reduce_sum,
                        t.precision.autocast, tp_ranks=t.batches.tp_ranks)

    def after_training(self) -> None:
        """At the end of the loop (every rank)."""

    def full_state_dict(self, fp32: bool = False) -> dict[str, torch.Tensor]:
        """The whole model's weights on the main process, for the export (collective); `fp32`: the export is fp32
        (the parameters here are the fp32 ones trained)."""
        return gather_full_state_dict(self.trainer.accelerator, self.trainer.model)

    def checkpoint_io(self) -> Any:
        """What saves and loads the model and optimizer in a checkpoint (None: accelerate's save_state)."""
        return None


class DeepSpeedEngine(AccelerateEngine):
    """ZeRO stage 1-3: DeepSpeed clips, checks the gradient norm and steps inside the last backward."""

    norm_before_step = False

    def _can_skip_on_device(self) -> bool:
        return False  # DeepSpeed steps (or skips) inside the last backward, on its own verdict

    # (DeepSpeed settings that would apply a non-finite step are refused by open_sft.config.launch_check)

    def clip_and_norm(self) -> float:
        return float("nan")  # DeepSpeed clips inside its step; the norm is read after it

    def skipped(self, bad: bool) -> bool:
        """DeepSpeed skips by itself when the gradient norm is not finite (under the settings
        deepspeed_nonfinite_problems allows), leaving weights and optimizer state untouched: its verdict counts,
        so a gradient that is non-finite under a finite loss is counted too."""
        skipped = bool(self.trainer.optimizer.step_was_skipped)
        if bad and not skipped:
            raise NonFiniteError("DeepSpeed applied an optimizer step with a non-finite loss; the weights can no "
                                 "longer be trusted. Use ZeRO stage 1-3 with the gradient-norm check enabled")
        return skipped

    def grad_norm(self, measured: float) -> float:
        """DeepSpeed's global gradient norm of the step; NaN where it has none (a 0.0 norm is a norm)."""
        norm = self.trainer.model.get_global_grad_norm()
        return float("nan") if norm is None else float(norm)

    def full_state_dict(self, fp32: bool = False) -> dict[str, torch.Tensor]:
        """The module's 16-bit weights gathered; with `fp32` the trained parameters are DeepSpeed's fp32 master
        weights instead (its bf16/fp16 module holds them rounded), as one process and FSDP2 export them."""
        from open_sft.distributed.deepspeed import fp32_master_weights

        state_dict = super().full_state_dict()
        if fp32:
            masters = fp32_master_weights(self.trainer.model, self.trainer.accelerator.is_main_process)
            state_dict.update({name: master for name, master in masters.items() if name in state_dict})
        return state_dict
