"""The loaded model spread as the launch says, in one ordered function (torchtitan's parallelize_llama is the
model): FSDP2 adopts it (its plugin wraps the layers when accelerate prepares the model), TP shards its layers over
each TP group, and every rank checks it computes in the dtype the others do. DeepSpeed partitions inside
accelerate's prepare (or at load, under ZeRO-3 init), the pipeline splits the loss-wrapped model into stages
(open_sft.distributed.pipeline), so neither has a part here."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from open_sft.distributed.collectives import check_ranks_agree_on_dtype
from open_sft.distributed.fsdp import adopt_model
from open_sft.distributed.tensor_parallel import shard_model

if TYPE_CHECKING:
    from open_sft.distributed.parallelism import Parallelism

logger = logging.getLogger("open_sft")


def parallelize(accelerator: Any, model: torch.nn.Module, spread: Parallelism, dtype: torch.dtype) -> None:
    if spread.fsdp:
        adopt_model(accelerator.state.fsdp_plugin, model)
    if spread.tp_enabled:
        logger.info("%s", shard_model(accelerator, model, spread.tp))
    check_ranks_agree_on_dtype(accelerator, dtype)
