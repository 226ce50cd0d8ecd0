"""Resuming a checkpoint on another number of ranks: a preempted job is often requeued on fewer or more GPUs.

What makes it possible is that a step's examples depend on the global batch, never on how it is spread
(open_sft.data.batching): unpacked, a step takes the next micro-batch × accumulation × ranks examples of the
epoch's shuffle, and micro-batch slot k (accumulation index × ranks + rank) always holds the same ones; packed,
a step fills accumulation × ranks micro-batches of the token budget. So a run that keeps micro-batch ×
accumulation × ranks trains on the same examples at every step, in the same micro-batches, and its loss, summed
over the global batch and normalised once, is the same sum taken in another order: equal within rounding
(the tests measure it), not bitwise.

What stays refused, and why:
  - a global batch that M ranks cannot hold in whole micro-batches (2 ranks × accumulation 1 → 4 ranks);
  - --loss_normalization mean, or an MoE router's load-balancing loss, with token-balanced micro-batches:
    balancing groups a step's examples into micro-batches by the number of ranks, and under mean each
    micro-batch's own mean counts, as each micro-batch's routing does in the router loss;
  - pipeline, tensor and sequence parallelism: their groups, not only the data-parallel degree, would change.

Plain and DDP checkpoints hold the whole model and optimizer (accelerate's save_state on the main process); FSDP2
checkpoints are torch.distributed.checkpoint's, which reshards on load; a DeepSpeed ZeRO checkpoint is converted
to DeepSpeed's universal format first (open_sft.training.universal). Random states are per rank: a rank the
checkpoint had keeps its own; a rank it did not have gets one derived from (seed, step, rank).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch

from open_sft.errors import UserError
from open_sft.model.anatomy import causal_lm_of, outside_text_path, text_config
from open_sft.training.checkpoint import (CHECKPOINTS, PEEKED_PATH, STATE_FILE, ResumePoint, continued, newest_usable,
                                         problem_with)
from open_sft.training.completion import resume_setting
from open_sft.training.portable import ENGINE_WORDS, refusal

if TYPE_CHECKING:
    from open_sft.config.args import FinetuneConfig

logger = logging.getLogger(__name__)

#: Checkpoint formats (the identity's "engine") that load on any number of ranks.
RESHARDABLE = ("torch", "fsdp2", "deepspeed")
_GROUPS = {"sequence_parallel_size": "--sequence_parallel_size", "tensor_parallel_size": "tensor parallelism",
           "pipeline_parallel_size": "--pipeline_parallel_size"}


def global_batch(identity: dict[str, Any]) -> int:
    """Micro-batches of a step across all ranks (packed: token budgets) × examples per micro-batch (unpacked)."""
    return int(identity["micro_batch_size"]) * int(identity["gradient_accumulation_steps"]) * int(
        identity["world_size"])


def batch_of(state: Optional[dict[str, Any]]) -> Optional[tuple[int, int]]:
    """(global batch, ranks) of a checkpoint's trainer state (peek), or None (no checkpoint, or one without them)."""
    saved = (state or {}).get("identity") or {}
    if not {"micro_batch_size", "gradient_accumulation_steps", "world_size"} <= saved.keys():
        return None
    return global_batch(saved), int(saved["world_size"])


def _refusal(saved: dict[str, Any], now: dict[str, Any], loss_normalization: str,
             router_loss: bool = False) -> Optional[str]:
    """Why the checkpoint's steps cannot be trained on this run's number of ranks, whatever the accumulation;
    None when they can. `router_loss`: the run trains an MoE router's load-balancing loss."""
    engine = saved.get("engine", "torch")
    if engine != now.get("engine", engine) and not convertible(saved, now):
        return None  # the check names the other engine
    if engine not in RESHARDABLE:
        return (f"a {engine} checkpoint is written per stage and rank and resumes only on its own "
                f"{saved['world_size']} process(es)")
    for key, flag in _GROUPS.items():
        if saved.get(key, 1) not in (1, None) or now.get(key, 1) not in (1, None):
            return f"{flag} groups ranks within the data-parallel degree: resume on {saved['world_size']} process(es)"
    if loss_normalization == "mean" and now.get("balanced"):
        return ("--loss_normalization mean with --balance_micro_batches: balancing groups a step's examples into "
                "micro-batches by the number of ranks, and under mean each micro-batch's mean counts; relaunch on "
                f"{saved['world_size']} process(es) (a run that may change its ranks: --balance_micro_batches false "
                "from its first step)")
    if router_loss and now.get("balanced"):
        return ("the router's load-balancing loss with --balance_micro_batches: balancing groups a step's examples "
                "into micro-batches by the number of ranks, and the router loss is computed over each micro-batch's "
                f"routing; relaunch on {saved['world_size']} process(es) (a run that may change its ranks: "
                "--balance_micro_batches false from its first step)")
    return None


def convertible(saved: dict[str, Any], now: dict[str, Any]) -> bool:
    """Whether a checkpoint of another engine goes on under this run's (open_sft.training.portable converts it):
    both engines are in RESHARDABLE; what else may refuse it is portable.refusal's."""
    return saved.get("engine", "torch") in RESHARDABLE and now.get("engine", "torch") in RESHARDABLE


def fitted_accumulation(saved: dict[str, Any], now: dict[str, Any], loss_normalization: str,
                        router_loss: bool = False) -> int:
    """The accumulation that keeps the checkpoint's global batch on this run's number of ranks. `now['
    gradient_accumulation_steps']` is the launch's: the checkpoint's (the same command relaunched) is fitted, any
    other must keep the global batch itself. Raises UserError naming the reason and the fix."""
    world, micro = int(now["world_size"]), int(now["micro_batch_size"])
    was = f"the {saved['world_size']}-rank checkpoint"
    refusal = _refusal(saved, now, loss_normalization, router_loss)
    if refusal:
        raise UserError(f"cannot resume {was} on {world} process(es): {refusal}")
    total = global_batch(saved)
    given, accumulation = int(now["gradient_accumulation_steps"]), saved["gradient_accumulation_steps"]
    # packed, a micro-batch is one token budget, whatever its examples: the global batch is counted in them
    packed = bool(saved.get("packing"))
    if given != int(accumulation):
        if micro * given * world == total:
            return given
        mine, its = ((f"accumulation {given} × {world} ranks = {given * world} packed micro-batches", total // micro)
                     if packed else (f"micro-batch {micro} × {given} × {world} ranks", total))
        raise UserError(
            f"cannot resume {was} on {world} process(es) with --gradient_accumulation_steps {given}: {mine} is not "
            f"its global batch of {its}; pass the checkpoint's --gradient_accumulation_steps {accumulation} (it is "
            "fitted to the ranks)")
    if total % (micro * world):
        its, each = ((f"{total // micro} packed micro-batches (accumulation {accumulation} × {saved['world_size']} "
                      "ranks)", "packed micro-batches") if packed else
                     (f"{total} (micro-batch {micro} × accumulation {accumulation} × {saved['world_size']} ranks)",
                      f"micro-batches of {micro}"))
        raise UserError(
            f"cannot resume {was} on {world} process(es): its global batch of {its} is not a whole number of "
            f"{each} on each of {world} ranks; launch a number of processes that divides {total // micro}, or "
            "start over with --resume_from_checkpoint none")
    return total // (micro * world)


def describe(saved: dict[str, Any], accumulation: int, world: int, packed: bool) -> str:
    """The one log line of a resume on another number of ranks."""
    size = global_batch(saved) // (int(saved["micro_batch_size"]) if packed else 1)
    unit = "packed micro-batches" if packed else "sequences"
    return (f"resuming a {saved['world_size']}-rank checkpoint on {world} rank{'s' * (world != 1)}: gradient "
            f"accumulation {saved['gradient_accumulation_steps']} -> {accumulation} keeps the global batch of "
            f"{size} {unit}")


def peek(config: FinetuneConfig) -> Optional[dict[str, Any]]:
    """The trainer state (identity, resolved config, ...) of the checkpoint the run's resume would read
    (open_sft.training.resume chooses it again later, collectively), read by every rank on its own before the
    process group exists, with its path (PEEKED_PATH); None for a fresh start or a checkpoint that is not usable
    (the resume says why)."""
    setting = resume_setting(config)
    if setting == "none":
        return None
    if setting == "auto":
        path = newest_usable(Path(config.train.output_dir) / CHECKPOINTS)
    else:
        path = continued(setting, Path(config.train.output_dir)) or Path(setting).expanduser()
        path = path if problem_with(path) is None else None
    if path is None:
        return None
    return {**json.loads((path / STATE_FILE).read_text()), PEEKED_PATH: str(path)}


def fit_to_checkpoint(config: FinetuneConfig, identity: dict[str, Any], state: Optional[dict[str, Any]],
                      is_main: bool, dtype: Optional[torch.dtype] = None) -> FinetuneConfig:
    """The config with the accumulation that trains the checkpoint's global batch on this run's ranks (logged
    in one line), or unchanged: no checkpoint, the same number of ranks, or another micro-batch (the resume
    refuses that with the other differences). Under --auto_micro_batch_size, the per-rank batch that trains it
    (`_auto_fit`). A checkpoint of another engine is refused here, before anything loads, when it cannot be
    converted (open_sft.training.portable.refusal); `dtype`: this run's compute dtype."""
    saved = (state or {}).get("identity")
    if saved and saved.get("engine", "torch") != identity["engine"] and convertible(saved, identity):
        reason = refusal(state, config.to_dict(), dtype)
        if reason:
            raise UserError(f"cannot resume the {ENGINE_WORDS[saved.get('engine', 'torch')]} checkpoint under "
                            f"{ENGINE_WORDS[identity['engine']]}: {reason}")
    if config.train.auto_micro_batch_size and batch_of(state) is not None:
        return _auto_fit(config, identity, state, is_main)
    if not saved or "world_size" not in saved or saved["world_size"] == identity["world_size"] or (
            saved.get("micro_batch_size") != identity["micro_batch_size"]):
        return config
    t = config.train
    accumulation = fitted_accumulation(saved, identity, t.loss_normalization,
                                       bool(identity.get("balanced")) and trains_router_loss(config))
    if is_main:
        logger.info("%s", describe(saved, accumulation, identity["world_size"], t.packing))
    return dataclasses.replace(config, train=dataclasses.replace(t, gradient_accumulation_steps=accumulation))


def trains_router_loss(config: FinetuneConfig) -> bool:
    """Whether the run trains an MoE router's load-balancing loss: --load_balancing_loss where given, else the
    model's config (read here, before the model loads; open_sft.model.router_loss decides alike)."""
    from open_sft.model.load import load_model_config
    from open_sft.model.router_loss import router_loss_choice

    flag = config.train.load_balancing_loss
    return bool(flag) if flag is not None else router_loss_choice(None, load_model_config(config.model))[0]


def split_is_free(train: Any) -> bool:
    """Whether a run's split of its global batch into micro-batches is a performance choice alone, so that a resume
    may take another split of the checkpoint's global batch: --auto_micro_batch_size chooses it by memory (never
    packed), and the loss is normalised over the global batch, not a mean of micro-batch means."""
    return bool(train.auto_micro_batch_size) and not train.packing and train.loss_normalization != "mean"


def _auto_fit(config: FinetuneConfig, identity: dict[str, Any], state: dict[str, Any],
              is_main: bool) -> FinetuneConfig:
    """--auto_micro_batch_size resuming: the checkpoint's global batch on this run's ranks, each rank's share split
    by auto (open_sft.preflight.auto_batch, from the model). The flags may keep the global batch themselves, or be
    the command's (its --gradient_accumulation_steps as the checkpoint's settings record it): auto's split is not the
    command's. The split is always free here: the flag is refused up front with --packing, --loss_normalization
    mean or --load_balancing_loss (open_sft.config.training_checks)."""
    from open_sft.training.run_settings import checkpoint_settings

    saved, t, world = state["identity"], config.train, int(identity["world_size"])
    total, micro = global_batch(saved), int(saved["micro_batch_size"])
    was = f"the {saved['world_size']}-rank checkpoint"
    reason = _refusal(saved, identity, t.loss_normalization) if saved["world_size"] != world else None
    if reason:
        raise UserError(f"cannot resume {was} on {world} process(es): {reason}")
    given, launched = t.gradient_accumulation_steps, checkpoint_settings(state).get("gradient_accumulation_steps")
    if t.per_device_train_batch_size * given * world != total and given != launched:
        raise UserError(
            f"cannot resume {was} on {world} process(es) with --gradient_accumulation_steps {given}: micro-batch "
            f"{t.per_device_train_batch_size} × {given} × {world} ranks is not its global batch of {total}; pass the "
            f"command's --gradient_accumulation_steps {launched} (the global batch is fitted to the ranks)")
    if total % world:
        raise UserError(
            f"cannot resume {was} on {world} process(es): its global batch of {total} (micro-batch {micro} × "
            f"accumulation {saved['gradient_accumulation_steps']} × {saved['world_size']} ranks) is not a whole "
            f"number of examples on each of {world} ranks; launch a number of processes that divides {total}, or "
            "start over with --resume_from_checkpoint none")
    share = total // world
    micro = micro if share % micro == 0 else share
    if is_main:
        logger.info("--auto_micro_batch_size resumes %s's global batch of %d sequences on %d rank%s: %d per rank (the "
                    "checkpoint's split: micro-batch %d × accumulation %d), split by the memory estimate", was, total,
                    world, "s" * (world != 1), share, saved["micro_batch_size"], saved["gradient_accumulation_steps"])
    return dataclasses.replace(config, train=dataclasses.replace(
        t, per_device_train_batch_size=micro, gradient_accumulation_steps=share // micro, auto_micro_batch_size=True))


def keeps_global_batch(saved: dict[str, Any], now: dict[str, Any]) -> bool:
    """Whether this run's layout trains the checkpoint's global batch, in a format that loads on any number of
    ranks: its number of ranks alone is then no reason to refuse the resume."""
    keys = ("micro_batch_size", "gradient_accumulation_steps", "world_size")
    return (all(key in saved and key in now for key in keys) and global_batch(saved) == global_batch(now)
            and _refusal(saved, now, "token") is None)


def rescalable(saved: dict[str, Any], now: dict[str, Any]) -> bool:
    """Whether a checkpoint of another number of ranks goes on with this run's layout: the same micro-batch and
    global batch, in a format that loads on any number of ranks (fit_to_checkpoint has fitted the accumulation,
    or refused with the reason, before the model was built)."""
    return keeps_global_batch(saved, now) and saved["micro_batch_size"] == now["micro_batch_size"]


def rng_seed(seed: int, step: int, rank: int) -> int:
    """The random seed of a rank the checkpoint did not have, from what every launch knows."""
    return (seed * 1_000_003 + step) * 1_009 + rank


def reseed_new_ranks(resume: Optional[ResumePoint], process_index: int, world: int, seed: int,
                     model: Optional[torch.nn.Module] = None) -> None:
    """A rank whose random state the checkpoint lacks (it had fewer ranks): python, numpy and torch seeded from
    (seed, step, rank), said once by the main process. accelerate's load_state skipped such a rank quietly.
    On another number of ranks a `model` that draws dropout masks is warned about (`dropout_in`)."""
    saved = int((resume.state.get("identity") or {}).get("world_size", world)) if resume else world
    if resume is None or saved == world:
        return
    drawn = dropout_in(model) if model is not None and process_index == 0 else []
    if drawn:
        logger.warning("the %d-rank checkpoint resumes on %d rank(s) with dropout on (%s): each rank draws its masks "
                       "from its own random stream, so the steps from here train on other masks than the "
                       "uninterrupted run's (alike in distribution, not the same numbers; the losses and weights "
                       "follow it within rounding only without dropout, e.g. --lora_dropout 0 from the first step)",
                       saved, world, ", ".join(drawn))
    if saved > world:
        return
    if process_index == 0:
        logger.info("the %d-rank checkpoint has no random state for rank(s) %s: theirs are derived from --seed, "
                    "the step and the rank", saved, ", ".join(str(r) for r in range(saved, world)))
    if (resume.path / f"random_states_{process_index}.pkl").is_file():
        return
    derived = rng_seed(seed, resume.step, process_index)
    random.seed(derived)
    np.random.seed(derived % 2**32)
    torch.manual_seed(derived)


# config keys transformers' causal LMs apply as dropout(p=...) in their forward, with no nn.Dropout module: attention
# dropout (`dropout=0.0 if not self.training else self.attention_dropout`, 400+ families), GPT-BigCode's attn_pdrop,
# BERT-style decoders' attention_probs_dropout_prob, BART-style decoders' (OPT's) dropout and activation_dropout,
# Falcon's and Bloom's hidden_dropout (dropout_add on the residual stream), DBRX's resid_pdrop and emb_pdrop; read
# also in a text config's sub-configs (DBRX's and MPT's attn_config.attn_pdrop)
FUNCTIONAL_DROPOUT = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob", "attn_dropout", "dropout",
                      "activation_dropout", "hidden_dropout", "resid_pdrop", "emb_pdrop")


def dropout_in(model: torch.nn.Module) -> list[str]:
    """Where `model` draws random masks in training a causal LM on text, as `name p`: the nn.Dropout modules of p > 0
    on its text path (LoRA's lora_dropout among them; not a vision tower's) and its text config's dropout
    probabilities above 0 that its attention or layers apply as a function argument, not a module. A config's
    other keys are for heads a causal LM does not have (GPT-NeoX's classifier_dropout, GPT-2's summary_first_dropout)."""
    causal_lm = causal_lm_of(model)
    elsewhere = [module for part in outside_text_path(model).values() for module in part.modules()]
    found = set()
    for name, module in causal_lm.named_modules():
        if isinstance(module, torch.nn.Dropout) and module.p > 0 and not any(module is m for m in elsewhere):
            parts = [part for part in name.split(".") if part != "default" and not part.isdigit()]
            found.add(f"{parts[-1] if parts else 'dropout'} {module.p:g}")
    config = text_config(causal_lm.config)
    for where, part in [("", config), *((f"{name}.", getattr(config, name, None)) for name in _sub_configs(config))]:
        for key in FUNCTIONAL_DROPOUT:
            value = part.get(key) if isinstance(part, dict) else getattr(part, key, None)
            if isinstance(value, float) and value > 0:
                found.add(f"{where}{key} {value:g}")
    return sorted(found)


def _sub_configs(config: Any) -> list[str]:
    """The names of a text config's own sub-configs (DBRX's and MPT's attn_config and ffn_config), as transformers
    declares them or, in remote code (MPT's), as plain dicts named *_config; not a tower's, an image tokenizer's
    (Chameleon's vq_config) or quantization's."""
    declared = list(getattr(config, "sub_configs", None) or {})
    plain = [name for name, value in vars(config).items() if name.endswith("_config") and isinstance(value, dict)]
    return sorted({name for name in declared + plain if not any(
        word in name for word in ("vision", "audio", "speech", "quantization", "vq"))})  # vq: an image tokenizer's
