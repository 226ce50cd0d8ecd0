"""The model weights of a step checkpoint, whatever engine wrote it, read one group of tensors at a time.

Each engine leaves the weights in its own format (open_sft.training.checkpoint): accelerate's model.safetensors
(one process, DDP, TP), DeepSpeed's per-rank files (ZeRO-2 keeps the whole module in rank 0's model states, ZeRO-3
only each rank's partition of the fp32 master weights), FSDP2's torch.distributed.checkpoint directory, the
pipeline's per-stage files. A reader gives every weight's name (as in the run's model: TokenLossModel's `model.`
prefix stripped, so the names are the trained PreTrainedModel's or PeftModel's), its shape and training dtype,
and loads the tensors asked for. Files are memory-mapped or read piecewise: an export holds one output shard and
the tensors being converted, never the whole model.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from open_sft.errors import UserError
from open_sft.training.universal import MODEL_STATES, PARTITIONED_MODEL_STATES

WRAPPER = "model."  # open_sft.model.loss.TokenLossModel holds the trained model as `.model`
SAFETENSORS = "model.safetensors"  # accelerate's save_state
FSDP_DIR, FSDP_OPTIMIZER_DIR = "pytorch_model_fsdp_0", "optimizer_0"  # accelerate's save_state under FSDP2
PIPELINE_SHARDED = "pipeline_sharded"  # open_sft.training.pipeline_state.SHARDED
_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
                       "I64": torch.int64, "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool}


@dataclass(frozen=True)
class Weight:
    shape: torch.Size
    dtype: torch.dtype  # as trained: the module's dtype (bf16 under DeepSpeed bf16), not the fp32 master copy's


class CheckpointWeights:
    """`engine` (words for messages), `weights` (name → Weight, in the model's order) and `load(names)`."""

    def __init__(self, engine: str, weights: dict[str, Weight],
                 load: Callable[[list[str]], dict[str, torch.Tensor]]):
        self.engine, self.weights, self._load = engine, weights, load

    def load(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The named tensors, in their training dtype, on the CPU."""
        names = list(names)
        loaded = self._load(names)
        return {name: loaded[name].to(self.weights[name].dtype).contiguous() for name in names}


def _unwrapped(name: str) -> str:
    return name.removeprefix(WRAPPER)


def _safetensors(directory: Path) -> CheckpointWeights:
    from safetensors import safe_open

    path = directory / SAFETENSORS
    weights, keys = {}, {}
    with safe_open(str(path), "pt") as file:
        for key in file.keys():
            piece = file.get_slice(key)
            weights[_unwrapped(key)] = Weight(torch.Size(piece.get_shape()), _SAFETENSORS_DTYPES[piece.get_dtype()])
            keys[_unwrapped(key)] = key

    def load(names: list[str]) -> dict[str, torch.Tensor]:
        with safe_open(str(path), "pt") as file:
            return {name: file.get_tensor(keys[name]) for name in names}

    return CheckpointWeights("one process or DDP (accelerate's model.safetensors)", weights, load)


def _fp32_masters(directory: Path, tag: str) -> dict[str, Any]:
    """Every rank's fp32 master partitions joined by DeepSpeed's own reader in its lazy mode (each tensor gathered
    when asked for; frozen parameters as the module held them)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # its progress bars
        return get_fp32_state_dict_from_zero_checkpoint(str(directory), tag=tag, lazy_mode=True)


def _deepspeed(directory: Path, masters: bool = False) -> CheckpointWeights:
    """ZeRO-1/2: rank 0's model states hold the whole module in its training dtype. ZeRO-3: they hold empty
    placeholders (with that dtype); the weights are the fp32 master partitions of every rank's optimizer states,
    joined by DeepSpeed's own reader (_fp32_masters), then cast to the module's dtype, which is what the module held
    (DeepSpeed copies the masters into it after each step). `masters` (an fp32 export, which the run writes from
    the masters): the trained parameters are the fp32 masters at either stage, uncast."""
    tag = (directory / "latest").read_text().strip()
    ds_dir = directory / tag
    whole = ds_dir / MODEL_STATES
    if whole.is_file():
        states = torch.load(whole, map_location="cpu", mmap=True, weights_only=False)
        module = states["module"]
        weights = {_unwrapped(k): Weight(v.shape, v.dtype) for k, v in module.items()}
        if not masters:
            return CheckpointWeights("DeepSpeed ZeRO-1/2", weights,
                                     lambda names: {n: module[WRAPPER + n] for n in names})
        trained = {k for group in states["param_shapes"] for k in group}
        lazy = _fp32_masters(directory, tag)
        weights.update({_unwrapped(k): Weight(module[k].shape, torch.float32) for k in trained})
        return CheckpointWeights("DeepSpeed ZeRO-1/2 (fp32 masters)", weights, lambda names: {
            n: lazy[WRAPPER + n].contiguous() if WRAPPER + n in trained else module[WRAPPER + n] for n in names})
    states = torch.load(ds_dir / PARTITIONED_MODEL_STATES, map_location="cpu", mmap=True,
                        weights_only=False)
    dtypes = {k: v.dtype for k, v in states["module"].items()}
    shapes = {k: v for group in states["param_shapes"] for k, v in group.items()}
    if masters:
        dtypes.update({k: torch.float32 for k in shapes})
    shapes.update(states.get("frozen_param_shapes") or {})
    lazy = _fp32_masters(directory, tag)
    weights = {_unwrapped(k): Weight(torch.Size(shapes.get(k, lazy[k].shape)), dtypes.get(k, torch.float32))
               for k in lazy}
    return CheckpointWeights("DeepSpeed ZeRO-3", weights,
                             lambda names: {n: lazy[WRAPPER + n].contiguous() for n in names})


def distributed_checkpoint(path: Path, prefix: str = "model.") -> CheckpointWeights:
    """accelerate's torch.distributed.checkpoint directory of FSDP2 (the tensors under `prefix`: the model's weights,
    or the optimizer's states under `optimizer.state.`), read without a process group: each asked-for tensor
    assembled from the ranks' shards into a whole one."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    keys = {_unwrapped(k.removeprefix(prefix)): k for k, v in metadata.items()
            if k.startswith(prefix) and isinstance(v, TensorStorageMetadata)}
    weights = {name: Weight(metadata[key].size, metadata[key].properties.dtype) for name, key in keys.items()}

    def load(names: list[str]) -> dict[str, torch.Tensor]:
        state = {keys[n]: torch.empty(weights[n].shape, dtype=weights[n].dtype) for n in names}
        with warnings.catch_warnings():  # torch warns it assumes one process even where no_dist=True says so
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
            dcp.load(state, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
        return {n: state[keys[n]] for n in names}

    return CheckpointWeights("FSDP2 (torch distributed checkpoint)", weights, load)


def _pipeline(directory: Path) -> CheckpointWeights:
    """Each stage position's file holds its parameters by their names in the whole model."""
    parts = {}
    for file in sorted(directory.glob("pipeline_stage_*.pt")):
        parts.update(torch.load(file, map_location="cpu", mmap=True, weights_only=False)["model"])
    weights = {_unwrapped(k): Weight(v.shape, v.dtype) for k, v in parts.items()}
    return CheckpointWeights("pipeline stages", weights, lambda names: {n: parts[WRAPPER + n] for n in names})


def open_weights(directory: Path, fp32: bool = False) -> CheckpointWeights:
    """The weights of the step checkpoint `directory`, by the format its engine wrote; `fp32`: for an fp32 export
    (DeepSpeed's trained parameters are then its fp32 masters, as the run's own export takes them)."""
    if (directory / SAFETENSORS).is_file():
        return _safetensors(directory)
    if (directory / "latest").is_file():
        return _deepspeed(directory, masters=fp32)
    if (directory / FSDP_DIR).is_dir():
        return distributed_checkpoint(directory / FSDP_DIR)
    if list(directory.glob("pipeline_stage_*.pt")):
        return _pipeline(directory)
    if (directory / PIPELINE_SHARDED).is_dir():
        raise UserError(f"{directory} holds pipeline stages sharded by FSDP2 ({PIPELINE_SHARDED}/), which "
                        "`open_sft export` does not read yet; the run's own export at its end holds the same model, "
                        "or resume the run and let it finish")
    found = ", ".join(sorted(p.name for p in directory.iterdir())) or "nothing"
    raise UserError(f"{directory}: no model weights of a known format (found {found}); pass a step checkpoint "
                    "written by finetune.py (OUTPUT_DIR/checkpoints/step_N)")


def describe(weights: CheckpointWeights) -> str:
    count = sum(w.shape.numel() for w in weights.weights.values())
    dtypes = sorted({str(w.dtype).removeprefix("torch.") for w in weights.weights.values()})
    return f"{len(weights.weights)} tensors, {count:,} values ({', '.join(dtypes)}), written by {weights.engine}"

