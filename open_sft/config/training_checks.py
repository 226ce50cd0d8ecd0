"""Checks of the training flags against each other, made with the others before anything loads
(open_sft.config.checks.validate): the micro-batch's token budget, what --auto_micro_batch_size may not change,
and a wsd warmup that runs into its decay."""

from __future__ import annotations

from open_sft.config.args import DataArguments, TrainingArguments


def training_problems(t: TrainingArguments, d: DataArguments) -> list[str]:
    problems = []
    if t.max_tokens_per_batch is not None and t.max_tokens_per_batch < d.max_seq_length:
        problems.append(f"--max_tokens_per_batch {t.max_tokens_per_batch} is below --max_seq_length "
                        f"{d.max_seq_length}; every example must fit a micro-batch, raise it")
    if t.auto_micro_batch_size and t.packing:
        problems.append("--auto_micro_batch_size cannot keep the packing of --packing runs; set "
                        "--max_tokens_per_batch (the packed micro-batch's token budget) instead")
    problems += _split_dependent_problems(t) + _schedule_problems(t)
    return problems


def _schedule_problems(t: TrainingArguments) -> list[str]:
    """A wsd warmup that runs into its decay, where --max_train_steps gives the steps (else the step plan, after
    the data, refuses it: open_sft.training.steps); values out of range are numeric_problems'."""
    from open_sft.training.optim import warmup_flag, warmup_steps_for, wsd_overlap_problem

    steps, ratio, decay = t.max_train_steps, t.warmup_ratio, t.wsd_decay_ratio
    if t.lr_scheduler_type != "wsd" or not steps or steps < 1 or not (0 <= ratio <= 1 and 0 <= decay <= 1) or (
            t.warmup_steps is not None and t.warmup_steps < 0):
        return []
    warmup = t.warmup_steps if t.warmup_steps is not None else warmup_steps_for(ratio, steps)
    problem = wsd_overlap_problem("wsd", warmup, steps, decay, warmup_flag(t))
    return [problem] if problem else []


def _split_dependent_problems(t: TrainingArguments) -> list[str]:
    """--auto_micro_batch_size keeps the per-rank batch but splits it into other micro-batches: the same run only
    where the loss does not depend on the split (--loss_normalization token or sum, no router loss)."""
    if not t.auto_micro_batch_size:
        return []
    fix = ("set --per_device_train_batch_size and --gradient_accumulation_steps yourself (the preflight's memory "
           "estimate says what fits; --dry_run shows it; a resume of a checkpoint trained with "
           "--auto_micro_batch_size also needs --allow_changed_settings, as the flag is one of its recorded settings)")
    problems = []
    if t.loss_normalization == "mean":
        problems.append("--auto_micro_batch_size with --loss_normalization mean: under mean each micro-batch's own "
                        "mean counts, so another micro-batch size trains other gradients (micro-batch 8 and 2 × "
                        f"accumulation 4 differ); {fix}, or use --loss_normalization token")
    if t.load_balancing_loss:
        problems.append("--auto_micro_batch_size with --load_balancing_loss: the router's load-balancing loss is "
                        "computed over each micro-batch's routing, so another micro-batch size trains another "
                        f"loss; {fix}, or drop --load_balancing_loss")
    return problems
