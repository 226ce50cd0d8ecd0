"""One fine-tuning run: parse → build data → build model → train → export. `finetune.py` calls `main`."""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from open_sft.config.parse import parse_config
from open_sft.config.args import FinetuneConfig
from open_sft.errors import StopRun, UserError

logger = logging.getLogger("open_sft")


def _is_main_rank() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _setup_logging() -> None:
    """open_sft logs INFO on rank 0 and warnings elsewhere; other libraries only warnings."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S",
                        level=logging.WARNING, stream=sys.stdout, force=True)
    logging.getLogger("open_sft").setLevel(logging.INFO if _is_main_rank() else logging.WARNING)
    # torch.distributed's own deprecation notices, emitted from inside DeepSpeed's collectives.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)


def _accelerator_for(config: FinetuneConfig, model_config, dtype: torch.dtype, ds_config: Optional[dict],
                     zero3_init: bool = False):
    """The Accelerator, with the launch's DeepSpeed config (from launch_config) resolved from our flags;
    with `zero3_init`, a model loaded after it loads partitioned."""
    from open_sft.distributed import setup as distributed

    t = config.train
    if ds_config is not None:
        ds_config = distributed.resolve_deepspeed_config(
            ds_config, micro_batch_size=t.per_device_train_batch_size,
            gradient_accumulation_steps=t.gradient_accumulation_steps,
            world_size=int(os.environ.get("WORLD_SIZE", "1")), bf16=dtype == torch.bfloat16,
            clip_grad_norm=t.clip_grad_norm, hidden_size=getattr(model_config, "hidden_size", None),
        )
    accelerator = distributed.build_accelerator(
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        mixed_precision="bf16" if dtype == torch.bfloat16 else "no", deepspeed_config=ds_config,
        timeout_s=t.timeout, zero3_init=zero3_init,
    )
    return accelerator, ds_config


def _plan_launch(config: FinetuneConfig):
    """The flags reconciled with what `accelerate launch` was given (its YAML or flags, a DeepSpeed JSON);
    each decision that is not the plain flag is logged once."""
    from open_sft.config.launch import plan_launch
    from open_sft.model.precision import choose_dtype

    plan = plan_launch(config.train, config.model, config.explicit, lambda: choose_dtype(config.model, config.lora.use_qlora))
    if _is_main_rank():
        for note in config.notes:
            logger.info("%s", note)
        for warning in config.warnings:
            logger.warning("%s", warning)
        for note in plan.notes:
            logger.info("launch config: %s", note)
        logger.info("compute dtype %s: %s", plan.dtype_choice.dtype, plan.dtype_choice.reason)
    return dataclasses.replace(config, train=plan.train), plan


def _check_ranks_agree_on_dtype(accelerator, dtype: torch.dtype) -> None:
    """--torch_dtype auto is measured per node: nodes of different CPU kinds could choose differently."""
    from open_sft.distributed import setup as distributed

    if accelerator.num_processes > 1:
        bf16_ranks = int(distributed.all_reduce_sum(int(dtype == torch.bfloat16)))
        if bf16_ranks not in (0, accelerator.num_processes):
            raise UserError(f"the ranks chose different compute dtypes ({bf16_ranks} of {accelerator.num_processes} "
                            "bf16: the nodes' CPUs differ); pass --torch_dtype bfloat16 or float32")


def _run_info(config: FinetuneConfig, accelerator, dtype, schedule, data, ds_config, launch) -> dict:
    from open_sft.export.save import git_revision, library_versions

    return {
        "args": config.to_dict(), "versions": library_versions(), "world_size": accelerator.num_processes,
        "distributed_type": accelerator.distributed_type.name, "compute_dtype": str(dtype),
        "loss_normalization": config.train.loss_normalization, "schedule": schedule.to_dict(),
        "dataset_cache_key": data.cache_key, "dataset_cache_path": str(data.cache_path),
        "git_revision": git_revision(), "deepspeed_config": ds_config, "threads_per_rank": torch.get_num_threads(),
        "compute_dtype_choice": launch.dtype_choice.to_dict(), "launch": launch.record,
    }


def _flop_counter(model):
    from open_sft.monitor.metrics import FlopCounter
    from open_sft.model.load import param_numel

    head = model.get_output_embeddings().weight
    backbone_params = sum(param_numel(p) for n, p in model.named_parameters() if "embed" not in n and p is not head)
    return FlopCounter(model.config, backbone_params)


def _print_examples(data, tokenizer, count: int = 3) -> None:
    from open_sft.data.summary import mark_trained

    color = sys.stdout.isatty()
    for index in range(min(count, len(data))):
        example = data.example(index)
        print(f"\n--- example {index} ({len(example.input_ids)} tokens; trained tokens marked) ---")
        print(mark_trained(tokenizer, example.input_ids, example.labels, color))


def _build_trainer(config: FinetuneConfig, accelerator, model, schedule, data, tokenizer, dtype, metrics,
                   eval_data=None):
    from open_sft.distributed import setup as distributed
    from open_sft.model.loss import TokenLossModel
    from open_sft.monitor.metrics import device_peak_flops
    from open_sft.training.optim import build_optimizer
    from open_sft.training.trainer import Trainer

    t = config.train
    flop_counter = _flop_counter(model)
    wrapped = TokenLossModel(model)
    optimizer = build_optimizer(wrapped, t.learning_rate, t.weight_decay, fused=t.fused_optimizer,
                                eight_bit=t.use_8bit_optimizer)
    wrapped, optimizer = accelerator.prepare(wrapped, optimizer)
    return Trainer(accelerator, wrapped, optimizer, t, schedule, data, tokenizer.pad_token_id, flop_counter,
                   device_peak_flops(dtype), metrics, reduce_sum=distributed.all_reduce_sum, eval_data=eval_data)


def _probe_only(config: FinetuneConfig, accelerator, model, schedule, data, tokenizer, plan, dtype) -> dict:
    """--dry_run: train the probe steps on this throwaway copy of the model, print the time estimate,
    write nothing."""
    from open_sft.preflight import estimate as preflight

    trainer = _build_trainer(config, accelerator, model, schedule, data, tokenizer, dtype, metrics=None)
    probe = preflight.TimeProbe(schedule.total_steps, plan.step_slots)
    timer = preflight.StepTimer(probe, 0, inner=lambda done, window: probe.done)
    trainer.train(0, on_step_end=timer)
    estimate = timer.estimate
    if estimate is None:  # the whole run is shorter than the probe: it was measured, not estimated
        estimate = time.perf_counter() - timer.started
    if accelerator.is_main_process:
        print(f"time estimate: {preflight.format_seconds(estimate)} for {schedule.total_steps} optimizer steps "
              f"(from a probe of {len(probe.seconds)} step(s) after {probe.warmup} warm-up step)", flush=True)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return {"dry_run": True, "time_estimate_s": estimate, "preflight": plan.to_dict()}


def run(config: FinetuneConfig) -> dict:
    """Train and export; returns a summary. Raises UserError for problems the user can fix."""
    from open_sft.training import checkpoint
    from open_sft.distributed import setup as distributed
    from open_sft.preflight import estimate as preflight
    from open_sft.data.pipeline import prepare_data
    from open_sft.data.summary import format_report
    from open_sft.export.save import save_model, write_json
    from open_sft.export.model_card import write_model_card
    from open_sft.monitor.progress import ProgressBar, chain
    from open_sft.export.hub import push_output_dir
    from open_sft.model.lora import is_peft_model, save_lora
    from open_sft.monitor.metrics import MetricsWriter
    from open_sft.data.chat.templates import apply_chat_template_choice
    from open_sft.model.load import (add_bos_to_template, context_warning, load_model, load_model_config, load_tokenizer,
                                partition_summary)
    from open_sft.training.optim import optimizer_impl
    from open_sft.training.trainer import plan_schedule

    config, launch = _plan_launch(config)
    m, d, t = config.model, config.data, config.train
    dtype = launch.dtype
    torch.manual_seed(t.seed)
    tokenizer = load_tokenizer(m)
    apply_chat_template_choice(tokenizer, d.chat_template_name, d.chat_template_path)
    if d.add_bos:
        add_bos_to_template(tokenizer)
    data = prepare_data(d, tokenizer, t.seed)
    if d.cache_dataset_only:  # nothing is written but the cache (its report.json holds the data report)
        if _is_main_rank():
            print(format_report(data.report), flush=True)
            print(data.cache_path)
        return {"cache_path": str(data.cache_path)}
    eval_data = None
    if d.eval_dataset_mixer_list:
        eval_data = prepare_data(dataclasses.replace(d, dataset_mixer_list=d.eval_dataset_mixer_list), tokenizer, t.seed)
    elif d.eval_split_ratio:
        data, eval_data = data.split(d.eval_split_ratio, t.seed)
    if _is_main_rank():
        print(format_report(data.report), flush=True)
    if t.dry_run and _is_main_rank():
        _print_examples(data, tokenizer)
    baseline = preflight.runtime_bytes(launch.deepspeed_config is not None,
                                       config.lora.use_lora, config.lora.use_qlora)
    zero3_init = launch.zero3_init and not t.auto_micro_batch_size
    if zero3_init:  # the accelerator first: from_pretrained then loads under deepspeed.zero.Init
        accelerator, ds_config = _accelerator_for(config, load_model_config(m), dtype, launch.deepspeed_config, True)
        model = load_model(m, tokenizer, config.lora)
        logger.info("%s", partition_summary(model))
    else:
        if launch.zero3_init:
            logger.info("--auto_micro_batch_size measures the whole model: it is loaded whole on each rank and "
                        "partitioned by ZeRO-3 when training starts")
        model = load_model(m, tokenizer, config.lora)
        if t.auto_micro_batch_size:
            from open_sft.preflight.auto_batch import fit_micro_batch

            config = fit_micro_batch(config, model, data, launch.deepspeed_config,
                                     dtype == torch.bfloat16, baseline)
            t = config.train
        accelerator, ds_config = _accelerator_for(config, model.config, dtype, launch.deepspeed_config)
    _check_ranks_agree_on_dtype(accelerator, dtype)
    if launch.dtype_choice.bf16_via_fp32:
        from open_sft.model import bf16_matmul

        logger.info("bf16 matmuls of %d linear layers run on fp32 kernels", bf16_matmul.install(model))
    schedule = plan_schedule(t, data, accelerator.num_processes, d.max_seq_length)
    plan = preflight.plan_preflight(config, model, schedule, data, ds_config, dtype == torch.bfloat16, baseline)
    context = context_warning(model.config, max(data.lengths(), default=0))
    if accelerator.is_main_process and context:
        logger.warning("%s", context)
    if accelerator.is_main_process:
        print(plan.describe(schedule, data), flush=True)
        warning = preflight.over_budget_warning(plan.memory, plan.device_bytes)
        if warning:
            logger.warning(warning)
    if t.dry_run:
        return _probe_only(config, accelerator, model, schedule, data, tokenizer, plan, dtype)
    output_dir = Path(t.output_dir)
    identity = checkpoint.run_identity(config, data.cache_key, accelerator.num_processes)
    resume = checkpoint.resolve_resume(config.checkpoint.resume_from_checkpoint, output_dir, identity,
                                       accelerator.is_main_process)
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        checkpoint.prepare_metrics_file(output_dir / "metrics.jsonl", resume)
    logger.info("world size %d (%s), compute dtype %s, %d threads per rank", accelerator.num_processes,
                accelerator.distributed_type.name, dtype, torch.get_num_threads())
    logger.info("schedule: %s", schedule.to_dict())

    metrics = None
    if accelerator.is_main_process:
        metrics = MetricsWriter.for_run(output_dir, t.with_tracking, t.report_to, config.to_dict(), name=t.exp_name,
                                        project=t.wandb_project_name, entity=t.wandb_entity)
    trainer = _build_trainer(config, accelerator, model, schedule, data, tokenizer, dtype, metrics, eval_data)
    if accelerator.is_main_process:
        info = _run_info(config, accelerator, dtype, schedule, data, ds_config, launch)
        write_json(output_dir / "run.json", {**info, "preflight": plan.to_dict(),
                                             "optimizer": optimizer_impl(trainer.optimizer)})
        write_json(output_dir / "data_report.json", data.report)
    wrapped = trainer.model
    uploader = None
    if config.hub.push_checkpoints and accelerator.is_main_process:
        from open_sft.export.hub_checkpoints import CheckpointUploader

        uploader = CheckpointUploader(config.hub)
    checkpointer = checkpoint.Checkpointer(accelerator, trainer, output_dir, config.checkpoint, identity,
                                           config.to_dict(), reduce_sum=distributed.all_reduce_sum,
                                           uploader=uploader)
    start_step, window = checkpointer.restore(resume)
    progress = ProgressBar.for_rank(schedule.total_steps, start_step, accelerator.is_main_process)
    timer = preflight.StepTimer(preflight.TimeProbe(schedule.total_steps, plan.step_slots), start_step,
                                inner=chain(progress, checkpointer.on_step_end),
                                log=logger.info if accelerator.is_main_process else None)
    with progress.around_training():
        records = trainer.train(start_step, window, on_step_end=timer)
    checkpointer.raise_if_preempted(metrics)
    if os.environ.get("OPEN_SFT_RECORD_DATA_ORDER"):  # audit/test aid: which examples each rank trained on
        write_json(output_dir / f"data_order.rank{accelerator.process_index}.json",
                   {"rank": accelerator.process_index, "example_indices": trainer.seen_example_ids})

    state_dict = distributed.gather_full_state_dict(accelerator, wrapped)
    if accelerator.is_main_process:
        state_dict = {k.removeprefix("model."): v for k, v in state_dict.items()}
        trained_model = accelerator.unwrap_model(wrapped).model
        if is_peft_model(trained_model):
            save_lora(trained_model, state_dict, tokenizer, output_dir, merge=config.lora.merge_lora_on_save,
                      max_shard_size=config.checkpoint.max_shard_size)
        else:
            save_model(trained_model, state_dict, tokenizer, output_dir, max_shard_size=config.checkpoint.max_shard_size)
        metrics.close()
        from open_sft.monitor.report import write_run_report

        write_run_report(output_dir)
        write_model_card(output_dir)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    checkpointer.finish_uploads()  # main process, bounded; other ranks are released already
    if config.checkpoint.clean_checkpoints_at_end and accelerator.is_main_process:
        checkpoint.remove_all(output_dir)  # after the uploads: they read from these directories
    if config.hub.push_to_hub and accelerator.is_main_process:
        push_output_dir(output_dir, config.hub)
    return {"records": records, "output_dir": str(output_dir)}


def main(argv: Optional[list[str]] = None) -> int:
    _setup_logging()
    argv = sys.argv[1:] if argv is None else argv
    try:
        from open_sft.distributed import setup as distributed

        distributed.setup_cpu_environment()
        config = parse_config(argv)
        run(config)
    except UserError as exc:
        if _is_main_rank():
            print(f"error: {exc}", file=sys.stderr)
        return 2
    except StopRun as exc:  # preempted (checkpoint saved) or the Hub upload failed (export intact)
        if _is_main_rank():
            print(f"open_sft: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0
