"""Collectives every rank calls: sums over ranks, the main process's answer sent to all, and the full weights
gathered onto the main process."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # pragma: no cover - import only for type checkers
    from accelerate import Accelerator


def all_reduce_sum(value: int | float | torch.Tensor) -> torch.Tensor:
    """Sum a scalar (or tensor) over all ranks; works with gloo on CPU (and nccl).

    Must be called by every rank (collective).  Python ints are summed exactly as int64,
    floats as float64; the result is on the input tensor's device (CPU for Python numbers).
    """
    return _all_reduce(value, torch.distributed.ReduceOp.SUM)


def all_reduce_max(value: int | float | torch.Tensor, group: Any = None) -> torch.Tensor:
    """The largest of a scalar (or of each element of a tensor) over the ranks of `group` (all by default); as
    all_reduce_sum otherwise. Every rank of the group calls it."""
    return _all_reduce(value, torch.distributed.ReduceOp.MAX, group)


def _all_reduce(value: int | float | torch.Tensor, op: Any, group: Any = None) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        tensor = value.detach().clone()
    elif isinstance(value, int):
        tensor = torch.tensor(value, dtype=torch.int64)
    else:
        tensor = torch.tensor(float(value), dtype=torch.float64)
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        backend = torch.distributed.get_backend()
        device = tensor.device
        if backend == "nccl" and device.type != "cuda":
            tensor = tensor.cuda()
        elif backend == "gloo" and device.type != "cpu":
            tensor = tensor.cpu()
        torch.distributed.all_reduce(tensor, op=op, group=group)
        tensor = tensor.to(device)
    return tensor


def broadcast_object(value: Any) -> Any:
    """The main process's `value` on every rank (picklable; as it is without a process group or with one rank)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_full_state_dict(accelerator: Accelerator, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) model weights on the main process, ``{}`` on the other ranks.

    Collective: call on every rank.  Under ZeRO-3 the parameters are gathered layer by layer
    (needs ``stage3_gather_16bit_weights_on_model_save=true``, which resolve_deepspeed_config
    sets); tensors are CPU copies in the model's dtype (bf16 under DS bf16, else fp32).
    """
    state_dict = accelerator.get_state_dict(model)
    if not accelerator.is_main_process or state_dict is None:
        return {}
    return {name: tensor.detach().to("cpu").clone() for name, tensor in state_dict.items()}


def check_ranks_agree_on_dtype(accelerator: Any, dtype: torch.dtype) -> None:
    """--torch_dtype auto is measured per node: nodes of different CPU kinds could choose differently."""
    from open_sft.errors import UserError

    if accelerator.num_processes > 1:
        kinds = (torch.float32, torch.bfloat16, torch.float16)
        counts = all_reduce_sum(torch.tensor([int(dtype == kind) for kind in kinds])).tolist()
        if max(counts) != accelerator.num_processes:
            chosen = ", ".join(f"{n} {str(kind).removeprefix('torch.')}" for n, kind in zip(counts, kinds) if n)
            raise UserError(f"the ranks chose different compute dtypes ({chosen}: the nodes' CPUs differ); pass "
                            "--torch_dtype bfloat16, float16 or float32")
