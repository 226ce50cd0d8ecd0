"""The loss-wrapped model, its optimizer and the Trainer of a run: prepared by the Accelerator, or under
--pipeline_parallel_size split into this rank's stages (open_sft.distributed.pipeline) and trained by the
pipeline engine."""

from __future__ import annotations

import logging
from functools import partial
from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:
    from open_sft.monitor.metrics import MetricsWriter
    from open_sft.run import Job
    from open_sft.training.trainer import Trainer

logger = logging.getLogger("open_sft")


def build_trainer(job: Job, metrics: Optional[MetricsWriter]) -> Trainer:
    """The loss-wrapped model and the optimizer, prepared by the Accelerator (or split into this rank's pipeline
    stages), in a Trainer with the engine of the run's parallelism."""
    from open_sft.distributed.collectives import all_reduce_sum
    from open_sft.model.anatomy import matmul_params
    from open_sft.model.loss import TokenLossModel
    from open_sft.monitor.metrics import FlopCounter, device_peak_flops
    from open_sft.training.engine import AccelerateEngine, DeepSpeedEngine
    from open_sft.training.optim import optimizer_for
    from open_sft.training.trainer import Trainer

    t, model, spread = job.config.train, job.model, job.launch.parallelism
    backbone_params, head_params = matmul_params(model)
    # under TP the LM head's columns are sharded: its gathered logits feed the plain loss (the fused one reads
    # the whole weight)
    wrapped = TokenLossModel(model, fused_loss=not spread.tp_enabled, load_balancing=t.load_balancing_loss,
                             liger=job.config.model.use_liger_kernel)
    if wrapped.router_choice:
        logger.info("%s", wrapped.router_choice)
    if spread.sp_enabled:
        from open_sft.distributed.sequence_parallel import ulysses_config

        wrapped.config = ulysses_config(model.config)  # accelerate's Ulysses setup reads the prepared model's config
    engine: Callable[[Trainer], AccelerateEngine] = DeepSpeedEngine if spread.deepspeed else AccelerateEngine
    if spread.pp_enabled:  # this rank's stages; the rest of the model goes to the meta device
        from open_sft.distributed.pipeline import describe, start_pipeline
        from open_sft.training.pipeline_engine import PipelineEngine

        pipeline = start_pipeline(wrapped, t, job.accelerator.device, shard=spread.fsdp)
        logger.info("%s", describe(pipeline))
        engine = partial(PipelineEngine, pipeline=pipeline)
    optimizer = optimizer_for(wrapped, t)
    if not spread.pp_enabled:
        wrapped, optimizer = job.accelerator.prepare(wrapped, optimizer)
    peak = device_peak_flops(job.dtype, on_fp32_kernels=job.launch.dtype_choice.bf16_via_fp32)
    return Trainer(job.accelerator, wrapped, optimizer, t, job.steps, job.data, job.tokenizer.pad_token_id,
                   FlopCounter(model.config, backbone_params, head_params), peak, metrics, reduce_sum=all_reduce_sum,
                   eval_data=job.eval_data, dtype=job.dtype, parallelism=spread, engine=engine)
