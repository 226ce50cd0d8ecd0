"""The `optimizer` and `scheduler` sections of a Trainer-style DeepSpeed JSON, read as settings.

Users bring the JSON they used with the HF Trainer: AdamW and a Warmup*LR schedule whose values are
mostly "auto". open_sft keeps its own torch AdamW and schedule (one implementation with and without
DeepSpeed: the same math, the non-finite-step skip, the exact resume of a pure (seed, step) schedule),
so both sections are removed from the config DeepSpeed sees and their explicit values become our
flags' values: a section value wins over a flag's default, a flag the user gave wins over a section's
type, and a number that contradicts a given flag is an error naming both.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

from open_sft.errors import UserError

OPTIMIZERS = ("adamw", "adam")  # DeepSpeed's Adam is AdamW unless adam_w_mode is false
SCHEDULERS = {"warmuplr": "constant_with_warmup", "warmupdecaylr": "linear", "warmupcosinelr": "cosine"}
# section param → our flag
PARAM_FLAGS = {
    "optimizer": {"lr": "learning_rate", "weight_decay": "weight_decay"},
    "scheduler": {"warmup_max_lr": "learning_rate", "warmup_num_steps": "warmup_steps",
                  "total_num_steps": "max_train_steps"},
}
FIXED = {"betas": ([0.9, 0.999], "open_sft's AdamW uses betas (0.9, 0.999)"),
         "eps": (1e-8, "open_sft's AdamW uses eps 1e-8"),
         "warmup_min_lr": (0, "open_sft's schedules warm up from 0"),
         "adam_w_mode": (True, "open_sft trains with AdamW (decoupled weight decay)")}
IGNORED = ("torch_adam", "warmup_type", "warmup_min_ratio", "cos_min_ratio", "last_batch_iteration")


def _number_equal(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_number_equal(x, y) for x, y in zip(a, b))
    try:
        return float(a) == float(b)
    except (TypeError, ValueError):
        return a == b


def _section_type(section: dict, name: str, path: Optional[str]) -> str:
    kind = str(section.get("type", "")).lower()
    allowed = OPTIMIZERS if name == "optimizer" else tuple(SCHEDULERS)
    if kind not in allowed:
        names = "AdamW, Adam" if name == "optimizer" else "WarmupLR, WarmupDecayLR, WarmupCosineLR"
        raise UserError(f"DeepSpeed config {path}: {name}.type={section.get('type')!r} is not one open_sft can "
                        f"train with ({names}: they become open_sft's AdamW and --lr_scheduler_type); remove the "
                        f"{name} section or use one of those")
    return kind


def replace_trainer_sections(cfg: dict[str, Any], path: Optional[str], train: Any,
                             explicit: frozenset[str]) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """(the config without optimizer/scheduler, flag values they set, one note per decision)."""
    if "optimizer" not in cfg and "scheduler" not in cfg:
        return cfg, {}, []
    cfg = copy.deepcopy(cfg)
    updates: dict[str, Any] = {}
    notes: list[str] = []
    for name in ("optimizer", "scheduler"):
        section = cfg.pop(name, None)
        if section is None:
            continue
        if not isinstance(section, dict):
            raise UserError(f"DeepSpeed config {path}: {name} must be an object with a type and params")
        kind = _section_type(section, name, path)
        if name == "scheduler":
            wanted = SCHEDULERS[kind]
            if "lr_scheduler_type" in explicit:
                if train.lr_scheduler_type != wanted:
                    notes.append(f"--lr_scheduler_type {train.lr_scheduler_type} wins over scheduler.type="
                                 f"{section['type']} in {path}")
            elif wanted != train.lr_scheduler_type:
                updates["lr_scheduler_type"] = wanted
        params = section.get("params") or {}
        if not isinstance(params, dict):
            raise UserError(f"DeepSpeed config {path}: {name}.params must be an object")
        for key, value in params.items():
            if value == "auto" or key in IGNORED:
                continue
            where = f"{name}.params.{key}={value!r}"
            if key in FIXED:
                fixed, why = FIXED[key]
                if not _number_equal(value, fixed):
                    raise UserError(f"DeepSpeed config {path}: {where} cannot be honoured ({why}); set it to "
                                    "\"auto\" or remove it")
                continue
            flag = PARAM_FLAGS[name].get(key)
            if flag is None:
                raise UserError(f"DeepSpeed config {path}: {where} has no open_sft equivalent; set it to \"auto\" "
                                "or remove it")
            if flag in updates and not _number_equal(value, updates[flag]):
                raise UserError(f"DeepSpeed config {path}: {where} disagrees with the file's other value for "
                                f"--{flag} ({updates[flag]}); make them equal or \"auto\"")
            current = updates.get(flag, getattr(train, flag))
            if current is not None and _number_equal(value, current):
                continue
            if flag in explicit:
                raise UserError(f"DeepSpeed config {path}: {where} conflicts with --{flag} {getattr(train, flag)}; "
                                "set it to \"auto\" in the file or drop the flag")
            updates[flag] = type(current)(value) if current is not None else int(value)
    notes.append(f"the optimizer/scheduler sections of {path} are replaced by open_sft's AdamW and "
                 f"--lr_scheduler_type schedule" + (f" (from them: {_describe(updates)})" if updates else ""))
    return cfg, updates, notes


def _describe(updates: dict[str, Any]) -> str:
    return ", ".join(f"--{flag} {value}" for flag, value in updates.items())
