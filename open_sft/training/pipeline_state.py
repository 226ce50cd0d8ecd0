"""A pipeline run's checkpoints and export: each stage's weights and optimizer state by their names in the whole
model (open_sft.distributed.pipeline keeps those names), written by the stage position's first replica; under
FSDP2 every rank's shards through torch.distributed.checkpoint."""

from __future__ import annotations

from typing import Any

import torch

from open_sft.distributed.pipeline import Pipeline, owned_state_dict

SHARDED = "pipeline_sharded"  # torch.distributed.checkpoint's directory of an FSDP2-sharded pipeline


def gather_state_dict(pipeline: Pipeline, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights on the main process (each stage's from the first replica), {} elsewhere. The names,
    shapes and dtypes travel as objects, the tensors one at a time to CPU memory on the main process: a stage's
    state dict as one object (gather_object) would be pickled into a buffer on the communication device, every
    stage's at once on the main process's GPU under NCCL."""
    layout, dist = pipeline.layout, torch.distributed
    # an FSDP2-sharded stage is gathered over its replicas first (collective: every replica takes part)
    mine = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().clone()
            for k, v in owned_state_dict(model).items()}
    if layout.replica != 0:
        return {}
    shapes = {name: (tuple(t.shape), t.dtype) for name, t in mine.items()}
    parts = [None] * layout.size if dist.get_rank() == 0 else None
    dist.gather_object(shapes, parts, dst=0, group=layout.pipe_group)
    device = torch.device("cpu") if "gloo" in dist.get_backend(layout.pipe_group) else \
        torch.device("cuda", torch.cuda.current_device())
    if dist.get_rank() != 0:
        for tensor in mine.values():
            dist.send(tensor.contiguous().to(device), dst=0, group=layout.pipe_group)
        return {}
    whole = dict(mine)
    for member, part in zip(dist.get_process_group_ranks(layout.pipe_group), parts):
        if member == 0:
            continue
        for name, (shape, dtype) in part.items():
            buffer = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(buffer, src=member, group=layout.pipe_group)
            whole[name] = buffer.cpu()
    return whole


class PipelineState:
    """A checkpoint's model and optimizer under PP: each stage position's first replica writes
    pipeline_stage_<position>.pt (its parameters by their names in the whole model, and its optimizer's state);
    every rank writes its RNG states. A resume loads its position's file (the replicas are equal)."""

    def __init__(self, pipeline: Pipeline, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.pipeline, self.model, self.optimizer = pipeline, model, optimizer

    def _file(self, directory: str) -> str:
        return f"{directory}/pipeline_stage_{self.pipeline.layout.position}.pt"

    def _sharded(self) -> tuple[dict[str, Any], Any]:
        """An FSDP2-sharded run's model and optimizer state for torch.distributed.checkpoint: each rank's shards,
        named within its stage modules (a resume has the same layout)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        options = StateDictOptions(flatten_optimizer_state_dict=True)  # the nested form loses lr/betas on load
        modules = torch.nn.ModuleList(self.pipeline.stages)
        model, optim = get_state_dict(modules, self.optimizer, options=options)
        return {"model": model, "optim": optim}, (modules, options)

    def save(self, directory: str) -> None:
        rank = torch.distributed.get_rank()
        if self.pipeline.sharded:
            import torch.distributed.checkpoint as dcp

            dcp.save(self._sharded()[0], checkpoint_id=f"{directory}/{SHARDED}")
        elif self.pipeline.layout.replica == 0:
            torch.save({"model": owned_state_dict(self.model), "optimizer": self.optimizer.state_dict()},
                       self._file(directory))
        torch.save(_rng_states(), f"{directory}/random_states_{rank}.pt")

    def load(self, directory: str) -> None:
        rank = torch.distributed.get_rank()
        if self.pipeline.sharded:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import set_state_dict

            state, (modules, options) = self._sharded()
            dcp.load(state, checkpoint_id=f"{directory}/{SHARDED}")
            set_state_dict(modules, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"], options=options)
            _set_rng_states(torch.load(f"{directory}/random_states_{rank}.pt", weights_only=False))
            return
        state = torch.load(self._file(directory), map_location="cpu", weights_only=False)
        missing = set(self.model.load_state_dict(state["model"], strict=False).missing_keys)
        not_loaded = missing & set(owned_state_dict(self.model))
        if not_loaded:
            raise RuntimeError(f"the checkpoint lacks this stage's {sorted(not_loaded)[:3]}...")
        self.optimizer.load_state_dict(state["optimizer"])
        _set_rng_states(torch.load(f"{directory}/random_states_{rank}.pt", weights_only=False))


def _rng_states() -> dict[str, Any]:
    import random

    import numpy as np

    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _set_rng_states(states: dict[str, Any]) -> None:
    import random

    import numpy as np

    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
