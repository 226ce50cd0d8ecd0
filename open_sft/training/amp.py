"""Mixed precision of the training step: the autocast context and, for fp16, dynamic loss scaling.

bf16 has fp32's exponent range, so its gradients need no scaling; fp16 (GPUs without bf16: V100, T4)
underflows small gradients to zero unless the loss is multiplied by a large scale before backward and
the gradients divided by it before the optimizer step. The scale halves whenever a step's gradients
overflow (that step is skipped) and doubles after a run of clean steps.

- Under DeepSpeed, its fp16 section does all of it (module in fp16, fp32 master weights in the ZeRO
  optimizer, dynamic scale, skipped overflow steps); we read the scale for the logs.
- Outside DeepSpeed, parameters stay fp32 (master weights), the forward runs under
  `torch.autocast(fp16)` and torch's `GradScaler` scales. Under pipeline parallelism each rank holds other
  parameters, so an overflow one stage finds must skip the step and halve the scale on every rank: torch's
  `ShardedGradScaler` (made for FSDP's shards, the same problem) all-reduces what each rank found. We do this ourselves rather than through
  `Accelerator(mixed_precision="fp16")`: accelerate 1.15 silently does neither autocast nor scaling
  on CPU, so that path would train fp32 while saying fp16, and one path for CPU and GPU is the one
  the CPU tests prove.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch

HALF = (torch.bfloat16, torch.float16)  # 16-bit compute: 2-byte activations, autocast copies of the weights


def accelerate_mixed_precision(dtype: torch.dtype, deepspeed: bool) -> str:
    """The Accelerator's mixed_precision for a compute dtype. fp16 outside DeepSpeed is ours (see above)."""
    if dtype == torch.bfloat16:
        return "bf16"
    return "fp16" if dtype == torch.float16 and deepspeed else "no"


def loss_scale_of(optimizer: Any) -> Optional[float]:
    """The current fp16 loss scale of a DeepSpeed optimizer (ZeRO-1/2: `loss_scale`, ZeRO-3: `cur_scale`)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    for name in ("loss_scale", "cur_scale"):
        value = getattr(inner, name, None)
        if isinstance(value, (int, float)):
            return float(value)
    scaler = getattr(inner, "loss_scaler", None)
    return float(scaler.cur_scale) if scaler is not None and hasattr(scaler, "cur_scale") else None


class Precision:
    """What the trainer asks of the compute dtype: a forward context, the loss to backpropagate, the
    gradients unscaled before clipping, the scale updated after the step, and the scale's state."""

    def __init__(self, dtype: torch.dtype, accelerator: Any, optimizer: Any, deepspeed: bool,
                 scaler_group: Any = None):
        """`scaler_group`: the process group whose ranks hold different parameters (a pipeline's): the scaler
        agrees with them on each step's overflow."""
        self.dtype, self.accelerator, self.optimizer, self.deepspeed = dtype, accelerator, optimizer, deepspeed
        self.fp16 = dtype == torch.float16
        own = self.fp16 and not deepspeed
        self.device_type = accelerator.device.type
        # growth_interval as DeepSpeed's loss_scale_window: the two paths grow the scale alike.
        settings = dict(init_scale=2.0 ** 16, growth_interval=1000)
        if not own:
            self.scaler = None
        elif scaler_group is not None:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(self.device_type, process_group=scaler_group, **settings)
            # the scale comes to be at its first use: on every rank now, as only the last stage scales a loss
            self.scaler.scale(torch.zeros((), device=accelerator.device))
        else:
            self.scaler = torch.amp.GradScaler(self.device_type, **settings)

    def autocast(self):
        if self.scaler is not None:
            return torch.autocast(self.device_type, dtype=torch.float16)
        return self.accelerator.autocast() if not self.fp16 else contextlib.nullcontext()

    def step_casts(self):
        """Around every forward and backward pass of an optimizer step: autocast's casts of the fp32 master weights
        to the compute dtype are made once a step and reused by every micro-batch, not made again at each pass.

        The weights do not change within a step, so the cast copies are the same numbers (bitwise the same
        gradients, tested); autocast keeps them in its cache until the outermost autocast context exits. This is an
        autocast context of its own (disabled: the backward passes inside it run without autocast, as before), so
        the forward passes' contexts nest in it and leave the cache for the next micro-batch; it is dropped when the
        step's passes are done, before the optimizer changes the weights. With 4 micro-batches a step: 1 cast of
        each weight instead of 4 (a full read of the fp32 weights and write of their copies each). What a forward
        holds of the copies anyway (saved for its backward) is held through the step's last backward."""
        return torch.autocast(self.device_type, enabled=False)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def unscale(self) -> None:
        """Divide the gradients by the scale (before clipping; records whether any is inf or nan)."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)

    def update(self) -> None:
        """After the step: halve the scale if the gradients overflowed, else count toward doubling it."""
        if self.scaler is not None:
            self.scaler.update()

    @property
    def loss_scale(self) -> Optional[float]:
        if self.scaler is not None:
            return float(self.scaler.get_scale())
        if self.fp16 and self.deepspeed:
            return loss_scale_of(self.optimizer)
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"grad_scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """DeepSpeed keeps its scale in its own checkpoint; ours rides in the trainer state."""
        if self.scaler is not None and state.get("grad_scaler"):
            self.scaler.load_state_dict(state["grad_scaler"])
