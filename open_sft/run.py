"""One fine-tuning run, as named phases over one Job: parse → launch plan → fit to the checkpoint (of another
number of ranks) → data → model → preflight → train → export. `finetune.py` calls `main`.

The phases import the heavy modules (torch's distributed stack, transformers, DeepSpeed) inside their bodies:
`main` first sets up this process (`setup_cpu_environment`), and DeepSpeed picks its accelerator when it is
first imported, so nothing may import it earlier; `finetune.py --help` also stays fast that way.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from open_sft.config.args import FinetuneConfig
from open_sft.config.parse import parse_config
from open_sft.distributed import lifeline
from open_sft.distributed.env import setup_cpu_environment
from open_sft.errors import StopRun, UserError, report_to_launcher
from open_sft.export.hub_checkpoints import upload_pending
from open_sft.monitor.quiet import quiet_third_parties, setup_logging
from open_sft.training.amp import HALF
from open_sft.training.completion import already_complete
from open_sft.training.output_lock import lock_output_dir
from open_sft.training.preemption import finish_first, stop_outside_training

if TYPE_CHECKING:  # the heavy modules load inside the phases (see above)
    from accelerate import Accelerator
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from open_sft.config.launch import LaunchPlan
    from open_sft.data.prepare import PreparedData
    from open_sft.preflight.estimate import Preflight
    from open_sft.training.steps import StepPlan

logger = logging.getLogger("open_sft")


@dataclass
class Job:
    """What the phases hand on. `config` is final once the model phase has fitted the micro-batch."""

    config: FinetuneConfig
    launch: LaunchPlan
    tokenizer: Optional[PreTrainedTokenizerBase] = None
    data: Optional[PreparedData] = None
    eval_data: Optional[PreparedData] = None
    model: Optional[PreTrainedModel] = None
    accelerator: Optional[Accelerator] = None
    ds_config: Optional[dict] = None  # resolved: no "auto" left
    steps: Optional[StepPlan] = None
    preflight: Optional[Preflight] = None
    baseline_bytes: int = 0  # this process's memory before the model
    # each step range's settings (training.run_settings): several only after --allow_changed_settings
    settings_history: list = dataclasses.field(default_factory=list)
    as_parsed: Optional[FinetuneConfig] = None  # the config before the plan: what the completion record keeps
    resuming: Optional[dict] = None  # the trainer state of the checkpoint a resume would read (elastic.peek)

    @property
    def dtype(self) -> torch.dtype:
        return self.launch.dtype

    @property
    def output_dir(self) -> Path:
        return Path(self.config.train.output_dir)


def _is_main_rank() -> bool:
    return os.environ.get("RANK", "0") == "0"


# --------------------------------------------------------------------------------------------------------------
# Phases
# --------------------------------------------------------------------------------------------------------------
def plan_launch(config: FinetuneConfig) -> Job:
    """The flags reconciled with what `accelerate launch` was given (its YAML or flags, a DeepSpeed JSON) and the
    compute dtype chosen; each decision that is not the plain flag is logged once. Every problem of the launch
    is reported here, at once, before anything is loaded."""
    from open_sft.config.launch import plan_launch as reconcile
    from open_sft.config.launch_check import check_launch
    from open_sft.model.precision import choose_dtype, resumed_choice
    from open_sft.training.elastic import batch_of, peek

    resuming = None if config.data.cache_dataset_only else peek(config)  # read once: fit_to_checkpoint's too
    resumed = resumed_choice(resuming) if config.model.torch_dtype == "auto" else None  # a resume keeps its dtype
    plan = reconcile(config.train, config.model, config.explicit,
                     lambda: resumed or choose_dtype(config.model, config.lora.use_qlora), resumed=batch_of(resuming),
                     implied=config.implied)
    if _is_main_rank():
        for note in config.notes:
            logger.info("%s", note)
        for warning in config.warnings:
            logger.warning("%s", warning)
        plan.log()
    job = Job(dataclasses.replace(config, train=plan.train), plan, as_parsed=config, resuming=resuming)
    check_launch(job.config, plan)
    torch.manual_seed(plan.train.seed)
    return job


def fit_to_checkpoint(job: Job) -> None:
    """A checkpoint of another number of ranks: the accumulation keeping its global batch, before the Accelerator is
    built from it and before the data (it reads only the batch layout), or a refusal naming why (training.elastic)."""
    from open_sft.training.elastic import fit_to_checkpoint as fit
    from open_sft.training.resume import run_identity

    if not job.config.data.cache_dataset_only:
        job.config = fit(job.config, run_identity(job.config, "", job.launch.parallelism), job.resuming,
                         _is_main_rank(), job.dtype)


def prepare_data(job: Job) -> None:
    """Tokenizer with its chat template; the training (and evaluation) examples, from the cache when it has them."""
    from open_sft.data.chat.render import warn_split_turn_closers
    from open_sft.data.chat.templates import apply_chat_template_choice
    from open_sft.data.prepare import ResumedDataDiffer, prepare_run_data
    from open_sft.data.summary import report_data
    from open_sft.model.head_bias import refuse_dropped_head_bias
    from open_sft.model.tokenizer import add_bos_to_template, load_tokenizer
    from open_sft.training.resume import changed_data_refusal, run_identity
    from open_sft.training.run_settings import settings

    m, d, seed = job.config.model, job.config.data, job.config.train.seed
    job.tokenizer = load_tokenizer(m)
    apply_chat_template_choice(job.tokenizer, d.chat_template_name, d.chat_template_path)
    refuse_dropped_head_bias(job.config, job.tokenizer)  # the tokens the run adds are known: before tokenizing
    warn_split_turn_closers(job.tokenizer)
    if d.add_bos:
        add_bos_to_template(job.tokenizer)
    try:
        job.data, job.eval_data = prepare_run_data(d, job.tokenizer, seed, job.resuming)
    except ResumedDataDiffer as exc:  # before tokenizing: the flags that changed, not the two cache keys
        current = run_identity(job.config, exc.key, job.launch.parallelism)
        if job.config.train.auto_micro_batch_size:  # settled by build_model, later: not compared here
            del current["micro_batch_size"], current["gradient_accumulation_steps"]
        raise changed_data_refusal(job.resuming, settings(job.as_parsed or job.config), current) from None
    if _is_main_rank():  # --cache_dataset_only: the notes here, the report last (cache_only_summary)
        report_data(job.data, job.eval_data, d, job.tokenizer, job.config.train.dry_run, not d.cache_dataset_only)


def build_model(job: Job) -> None:
    """The model and the Accelerator. Under ZeRO-3 init the Accelerator comes first, so that from_pretrained loads
    partitioned; --auto_micro_batch_size measures the whole model first and settles the config's micro-batch."""
    from open_sft.distributed.parallelize import parallelize
    from open_sft.model.load import load_model, load_model_config, partition_summary
    from open_sft.preflight.estimate import runtime_bytes

    config, launch, spread = job.config, job.launch, job.launch.parallelism
    given = "lora_dropout" in config.explicit  # else its default yields where peft needs no dropout (MoE experts)
    job.baseline_bytes = runtime_bytes(spread.deepspeed, config.lora.use_lora, config.lora.use_qlora)
    whole = "--auto_micro_batch_size measures the whole model" if config.train.auto_micro_batch_size else (
        "--sequence_parallel_size: DeepSpeed's partitioned load does not know the SP groups"
        if spread.sp_enabled else None)
    if launch.zero3_init and not whole:
        _start_accelerator(job, load_model_config(config.model), zero3_init=True)
        job.model = load_model(config.model, job.tokenizer, config.lora, job.dtype, given, spread)
        logger.info("%s", partition_summary(job.model))
    else:
        if launch.zero3_init:
            logger.info("%s: the model is loaded whole on each rank and partitioned by ZeRO-3 when training starts",
                        whole)
        job.model = load_model(config.model, job.tokenizer, config.lora, job.dtype, given, spread)
        if config.train.auto_micro_batch_size:
            from open_sft.preflight.auto_batch import fit_micro_batch

            job.config = fit_micro_batch(config, job.model, job.data, launch.deepspeed_config,
                                         job.dtype in HALF, job.baseline_bytes, spread)
        _start_accelerator(job, job.model.config)
    parallelize(job.accelerator, job.model, spread, job.dtype)
    if launch.dtype_choice.bf16_via_fp32:
        from open_sft.model import bf16_matmul

        logger.info("bf16 matmuls of %d linear layers run on fp32 kernels", bf16_matmul.install(job.model))
    if not spread.sp_enabled:  # after bf16_matmul's: it wraps what that put in place
        from open_sft.model.packing_check import route_packed_rows

        route_packed_rows(job.model, config.train, spread, job.dtype, job.accelerator.device)


def preflight(job: Job) -> None:
    """The step plan, and the memory and time the run will need, printed before anything is trained."""
    from open_sft.data.prepare import on_main_clock
    from open_sft.distributed.fsdp import fsdp_layout
    from open_sft.model.load import context_warning
    from open_sft.preflight.estimate import over_budget_warning, estimate_run
    from open_sft.training.steps import plan_steps

    # the first phase with a process group: every rank takes the data of the main rank's date (data/prepare.py)
    job.data, job.eval_data = on_main_clock(job.config.data, job.tokenizer, job.config.train.seed, job.resuming,
                                            job.data, job.eval_data)
    config, data = job.config, job.data
    job.steps = plan_steps(config.train, data, job.accelerator.num_processes, config.data.max_seq_length)
    job.preflight = estimate_run(config, job.model, job.steps, data, job.ds_config, job.dtype in HALF,
                                 job.baseline_bytes, job.launch.parallelism,
                                 fsdp_layout(job.accelerator, job.launch.parallelism))
    if job.accelerator.is_main_process:
        context = context_warning(job.model.config, max(data.lengths(), default=0))
        if context:
            logger.warning("%s", context)
        print(job.preflight.describe(job.steps, data), flush=True)
        warning = over_budget_warning(job.preflight.memory, job.preflight.device_bytes)
        if warning:
            logger.warning(warning)


def probe_only(job: Job) -> dict:
    """--dry_run: train the probe steps on this throwaway copy of the model, print the time estimate, write
    nothing."""
    from open_sft.preflight.timing import run_timer
    from open_sft.training.build import build_trainer

    trainer = build_trainer(job, metrics=None)
    timer = run_timer(job, trainer, 0)
    probe = timer.probe
    trainer.train(0, after_step=[timer, lambda done, seconds: probe.done])
    # a run shorter than the probe was measured whole, not estimated; evaluations and saves at their cadence
    estimate, words = timer.describe(timer.training if timer.training is not None else timer.elapsed)
    if job.accelerator.is_main_process:
        print(f"time estimate: {words} for {job.steps.total_steps} optimizer steps "
              f"(from a probe of {len(probe.seconds)} step(s) after {probe.warmup} warm-up step)", flush=True)
    job.accelerator.wait_for_everyone()
    lifeline.release()
    job.accelerator.end_training()
    return {"dry_run": True, "time_estimate_s": estimate, "preflight": job.preflight.to_dict()}


def train(job: Job) -> tuple[Any, Any, list[dict]]:
    """Resume if there is something to resume, train to the end (or to a stop signal: checkpoint, then
    Preempted); returns the trainer, the checkpointer and the logged records."""
    from open_sft.distributed.collectives import all_reduce_sum
    from open_sft.export.hub_checkpoints import CheckpointUploader
    from open_sft.export.save import model_files_writer
    from open_sft.monitor.metrics import MetricsWriter
    from open_sft.monitor.progress import ProgressBar
    from open_sft.model.precision import COMPUTE_DTYPE_KEY
    from open_sft.monitor.run_info import write_run_files
    from open_sft.preflight.timing import run_timer
    from open_sft.training.checkpointer import Checkpointer
    from open_sft.training.completion import SETTINGS_KEY, check_resume_point, clear_marker, resume_setting
    from open_sft.training.build import build_trainer
    from open_sft.training.elastic import reseed_new_ranks
    from open_sft.training.portable import checkpoint_io
    from open_sft.training.preemption import StopRequest
    from open_sft.training.resume import (continued_step, prepare_metrics_file, resolve_resume, run_identity,
                                          set_aside_other_timeline)

    config, acc, output_dir = job.config, job.accelerator, job.output_dir
    identity = run_identity(config, job.data.cache_key, job.launch.parallelism, job.model.config)
    resume = resolve_resume(resume_setting(config), output_dir, identity, acc.is_main_process, config.train)
    job.settings_history = check_resume_point(resume, job.steps.total_steps, job.as_parsed or config, config.to_dict(),
                                              acc.is_main_process, identity)
    if acc.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        clear_marker(output_dir)  # training starts: the directory holds a run in progress (a relaunch resumes it)
        set_aside_other_timeline(resume, output_dir)
        prepare_metrics_file(output_dir / "metrics.jsonl", resume)
    logger.info("%s, compute dtype %s, %d threads per rank", job.launch.parallelism.describe(), job.dtype,
                torch.get_num_threads())
    logger.info("schedule: %s", job.steps.describe())
    metrics = MetricsWriter.for_job(job, continued_step(resume, output_dir)) if acc.is_main_process else None
    trainer = build_trainer(job, metrics)
    if acc.is_main_process:
        write_run_files(job, trainer)
    saved_config = {**config.to_dict(), SETTINGS_KEY: job.settings_history,  # each checkpoint carries the history
                    COMPUTE_DTYPE_KEY: str(job.dtype).removeprefix("torch.")}  # and the dtype a resume keeps
    checkpointer = Checkpointer(acc, trainer, output_dir, config.checkpoint, identity, saved_config,
                               reduce_sum=all_reduce_sum, stop=StopRequest().install(),
                               uploader=CheckpointUploader.for_run(config.hub, acc.is_main_process),
                               state_io=checkpoint_io(resume, trainer, identity, config.lora.use_qlora),
                               model_files=model_files_writer(config, acc, trainer, job.tokenizer))
    start_step = checkpointer.restore(resume)
    reseed_new_ranks(resume, acc.process_index, acc.num_processes, config.train.seed, trainer.loss_model.model)
    progress = ProgressBar.for_rank(job.steps.total_steps, start_step, acc.is_main_process)
    timer = run_timer(job, trainer, start_step, logger.info if acc.is_main_process else None,
                      checkpointer.save_seconds)
    with progress.around_training():  # the timer after the checkpointer: it reads the step's save time
        records = trainer.train(start_step, after_step=[progress, checkpointer.on_step_end, timer])
    checkpointer.raise_if_preempted(metrics)
    return trainer, checkpointer, records


def export(job: Job, trainer: Any, checkpointer: Any) -> None:
    """The model in Hugging Face layout (full, or LoRA with its optional merge), the report and the model card
    (open_sft.export.final); then the checkpoint uploads are awaited, checkpoints cleaned if asked, and the export
    pushed if asked."""
    from open_sft.export.final import write_export
    from open_sft.export.hub_checkpoints import end_of_run
    from open_sft.export.save import finite_state_dict, save_dtype
    from open_sft.model.compile import log_summary
    from open_sft.model.load import load_model_config
    from open_sft.monitor.run_info import write_audit_files
    from open_sft.training.completion import mark_complete, trained_batch
    from open_sft.training.run_settings import by_steps

    config, acc, output_dir = job.config, job.accelerator, job.output_dir
    with finish_first("the export") as noted:  # a stop there promised a checkpoint the run may not have
        if config.model.torch_compile:
            log_summary()
        write_audit_files(output_dir, acc.process_index, trainer)
        dtype = save_dtype(config.checkpoint.save_dtype, load_model_config(config.model))  # the checkpoint's own
        state_dict = finite_state_dict(trainer.engine, dtype == torch.float32, acc.is_main_process)  # collective
        if acc.is_main_process:
            write_export(config, acc.unwrap_model(trainer.model).model, trainer, job.tokenizer, output_dir,
                         state_dict, dtype)
        acc.wait_for_everyone()
        lifeline.release()  # the last collective: ranks may now finish one after another
        acc.end_training()
        if acc.is_main_process:  # "already complete" from here: a relaunch does the uploads left, never trains again
            mark_complete(output_dir, job.steps.total_steps, trainer.elapsed(), job.as_parsed,
                          by_steps(job.settings_history, job.steps.total_steps), job.dtype,
                          trained_batch(config.train, job.launch.parallelism.world_size),
                          uploads_left=checkpointer.uploader is not None)
    end_of_run(checkpointer, output_dir, config, noted, acc.is_main_process)  # uploads, clean-up, push


def run(config: FinetuneConfig) -> dict:
    """Train and export; returns a summary (UserError: a problem the user can fix); a completed run stays as it is."""
    done = already_complete(config)
    if done is not None:
        if _is_main_rank():
            print(done, flush=True)
            upload_pending(config)  # an upload of the export that failed or was stopped: this relaunch does it
        return {"already_complete": config.train.output_dir}
    quiet_third_parties()
    job = plan_launch(config)
    with lock_output_dir(job.config, _is_main_rank()):  # held until the run has ended, however it ends
        return _phases(job)


def _phases(job: Job) -> dict:
    fit_to_checkpoint(job)
    prepare_data(job)
    if job.config.data.cache_dataset_only:  # nothing is written but the cache (its report.json holds the report)
        if _is_main_rank():
            from open_sft.data.summary import cache_only_summary

            print(cache_only_summary(job.data, job.eval_data), flush=True)
        return {"cache_path": str(job.data.cache_path),
                "eval_cache_path": str(job.eval_data.cache_path) if job.eval_data is not None else None}
    build_model(job)
    preflight(job)
    if job.config.train.dry_run:
        return probe_only(job)
    trainer, checkpointer, records = train(job)
    export(job, trainer, checkpointer)
    return {"records": records, "output_dir": str(job.output_dir)}


@record  # a bug's traceback becomes the root cause in torchrun's summary (our own ends write theirs: _stop)
def main(argv: Optional[list[str]] = None) -> int:
    setup_logging(_is_main_rank())
    argv = sys.argv[1:] if argv is None else argv
    lifeline.install()  # a rank started by a launcher stops when the launcher or a peer on its host is gone
    restore_signals = stop_outside_training()
    try:
        setup_cpu_environment()  # before anything imports deepspeed: it picks its accelerator at import
        run(parse_config(argv, check_data_files=True))
    except UserError as exc:
        return _stop(f"error: {exc}", 2)
    except StopRun as exc:  # preempted (checkpoint saved) or the Hub upload failed (export intact)
        return _stop(f"open_sft: {exc}", exc.exit_code)
    except KeyboardInterrupt:  # Ctrl-C outside the training loop (whose stop is graceful): loading, export
        return _stop("open_sft: interrupted (Ctrl-C); the same command starts again from where it can: a cache "
                     "build from its last complete chunk, training from the newest complete checkpoint", 130)
    except Exception as exc:
        lifeline.explain_failure(exc)  # a collective failed because a peer or the launcher is gone: say that instead
        raise
    finally:
        restore_signals()
    return 0


def _stop(message: str, code: int) -> int:
    """A run that ends on a handled error or stop: the main process prints the message; every rank leaves it for
    the launcher's closing summary (open_sft.errors.report_to_launcher), which a user reads last."""
    lifeline.release()
    if _is_main_rank():
        print(message, file=sys.stderr, flush=True)
    report_to_launcher(message)
    return code


# ----------------------------------------------- Helpers of the phases -----------------------------------------
def _start_accelerator(job: Job, model_config: Any, zero3_init: bool = False) -> None:
    from open_sft.distributed.setup import start_accelerator

    job.accelerator, job.ds_config = start_accelerator(job.config, job.launch, job.dtype, model_config, zero3_init)
    lifeline.watch_ranks()  # collective: from here on a peer that disappears stops this rank
    from open_sft.training.completion import resume_setting
    from open_sft.training.resume import relaunch_point

    # its lost line says where the relaunch starts: the step under auto, the named checkpoint, or step 0 under none
    lifeline.resume_from(job.output_dir, resume_setting(job.config), relaunch_point)
