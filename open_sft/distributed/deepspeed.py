"""Every rule about a DeepSpeed JSON past the launch: its Trainer-style `optimizer` and `scheduler` sections read as
settings, and its "auto" values filled from our flags (`resolve_deepspeed_config`).

Users bring the JSON they used with the HF Trainer: AdamW and a Warmup*LR schedule whose values are
mostly "auto". open_sft keeps its own torch AdamW and schedule (one implementation with and without
DeepSpeed: the same math, the non-finite-step skip, the exact resume of a pure (seed, step) schedule),
so both sections are removed from the config DeepSpeed sees and their explicit values become our
flags' values: a section value wins over a flag's default, a flag the user gave wins over a section's
type, and a number that contradicts a given flag is an error naming both.
"""

from __future__ import annotations

import copy
import json
from typing import Any, Mapping, Optional

import torch

from open_sft.config.ranges import RANGES
from open_sft.errors import UserError

OPTIMIZERS = ("adamw", "adam")  # DeepSpeed's Adam is AdamW unless adam_w_mode is false
SCHEDULERS = {"warmuplr": "constant_with_warmup", "warmupdecaylr": "linear", "warmupcosinelr": "cosine"}
# section param → our flag
PARAM_FLAGS = {
    "optimizer": {"lr": "learning_rate", "weight_decay": "weight_decay", "eps": "adam_epsilon",
                  "betas": ("adam_beta1", "adam_beta2")},  # a list: one flag per element
    "scheduler": {"warmup_max_lr": "learning_rate", "warmup_num_steps": "warmup_steps",
                  "total_num_steps": "max_train_steps"},
}
# Section params whose only value open_sft trains with: another changes the optimizer or the learning rates, so it is
# refused rather than dropped (--final_lr_ratio, our one floor, is linear's alone, as in open-instruct).
FIXED = {"warmup_min_lr": (0, "open_sft's schedules warm up from 0"),
         "warmup_min_ratio": (0, "open_sft's schedules warm up from 0"),
         "warmup_type": ("linear", "open_sft's warmup rises linearly"),  # left out: DeepSpeed's log (said)
         "cos_min_ratio": (0, "open_sft's cosine decays to 0"),
         "adam_w_mode": (True, "open_sft trains with AdamW (decoupled weight decay)")}
IGNORED = ("torch_adam", "last_batch_iteration")  # how DeepSpeed runs or resumes, not what it computes
# A flag that sets what a section param's flag would (the steps from the epochs, the warmup from a ratio): given, it
# conflicts with the param as the param's own flag would.
ALSO_SET_BY = {"max_train_steps": "num_train_epochs", "warmup_steps": "warmup_ratio"}


# DeepSpeed's fp16 settings unless the user's JSON gives them: dynamic scale from 2^16 (torch's default too),
# halved at the first overflow (DeepSpeed's default hysteresis 2 waits for a second one, which skips an extra
# step), never below 1.
DEEPSPEED_FP16_DEFAULTS = {"loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                           "hysteresis": 1, "min_loss_scale": 1}


def zero_stage(config: Optional[dict]) -> int:
    """The ZeRO stage of a DeepSpeed config dict (an int, or a string as JSON written by hand may hold); 0
    without a config or without a zero_optimization section."""
    zero = (config or {}).get("zero_optimization") or {}
    return int(zero.get("stage", 0)) if isinstance(zero, dict) else 0


def zero_settings(ds_config: Optional[dict]) -> tuple[int, bool, int]:
    """(ZeRO stage, offload, reduce bucket elements) of a DeepSpeed config; (0, False, 0) without one."""
    if not ds_config:
        return 0, False, 0
    zero = ds_config.get("zero_optimization", {})
    offload = any(isinstance(zero.get(k), dict) and zero[k].get("device", "none") not in ("none", None)
                  for k in ("offload_optimizer", "offload_param"))
    bucket = zero.get("reduce_bucket_size", 0)
    return zero_stage(ds_config), offload, bucket if isinstance(bucket, int) else 0


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


def replace_trainer_sections(cfg: dict[str, Any], path: Optional[str], train: Any, explicit: frozenset[str],
                             implied: Optional[Mapping[str, str]] = None
                             ) -> tuple[dict[str, Any], dict[str, Any], list[str], list[str]]:
    """(the config without optimizer/scheduler, flag values they set, one note per decision, every param that
    conflicts with a flag or cannot be honoured: the caller refuses them all at once, so one relaunch fixes them).
    `implied`: the flags in `explicit` that a command line implies, with what sets them (FinetuneConfig.implied)."""
    if "optimizer" not in cfg and "scheduler" not in cfg:
        return cfg, {}, [], []
    cfg = copy.deepcopy(cfg)
    updates: dict[str, Any] = {}
    notes: list[str] = []
    problems: list[str] = []
    warmup = ""  # what DeepSpeed's warmup would have been, where the file leaves it to DeepSpeed's default
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
        if name == "scheduler" and "warmup_type" not in params:
            warmup = (f"; its {section['type']} gives no warmup_type, so DeepSpeed would warm up log-shaped (its "
                      "default), and open_sft's warmup rises linearly")
        for key, value in params.items():
            if value == "auto" or key in IGNORED:
                continue
            problem = _param_problem(name, key, value, train, explicit, updates, implied or {})
            if problem:
                problems.append(f"DeepSpeed config {path}: {name}.params.{key}={value!r} {problem}")
                continue
            for flag, number in _flag_values(name, key, value):
                current = updates.get(flag, getattr(train, flag))
                if current is None or not _number_equal(number, current):
                    updates[flag] = type(current)(number) if current is not None else int(number)
    notes.append(f"the optimizer/scheduler sections of {path} are replaced by open_sft's AdamW and "
                 f"--lr_scheduler_type schedule" + (f" (from them: {_describe(updates)})" if updates else "") + warmup)
    return cfg, updates, notes, problems


def _param_problem(name: str, key: str, value: Any, train: Any, explicit: frozenset[str],
                   updates: dict[str, Any], implied: Mapping[str, str]) -> Optional[str]:
    """Why a section param cannot stand (the rest of the refusal after `DeepSpeed config PATH: name.params.key=v`),
    or None when it is honoured or agrees with the flags."""
    if key in FIXED:
        fixed, why = FIXED[key]
        return None if _number_equal(value, fixed) else (
            f"cannot be honoured ({why}); set it to {json.dumps(fixed)} or \"auto\", or remove it")
    flags = PARAM_FLAGS[name].get(key)
    if flags is None:
        return "has no open_sft equivalent; set it to \"auto\" or remove it"
    if isinstance(flags, tuple) and (not isinstance(value, list) or len(value) != len(flags)):
        return f"must be a list of {len(flags)} numbers ({', '.join(flags)}) or \"auto\""
    for flag, number in _flag_values(name, key, value):
        problem = _flag_problem(flag, number, train, explicit, updates, implied)
        if problem:
            return problem
    return None


def _flag_values(name: str, key: str, value: Any) -> list[tuple[str, Any]]:
    """(our flag, the value it takes) for a section param: betas [b1, b2] are --adam_beta1 b1, --adam_beta2 b2."""
    flags = PARAM_FLAGS[name].get(key)
    if flags is None:
        return []
    return list(zip(flags, value)) if isinstance(flags, tuple) else [(flags, value)]


def _flag_problem(flag: str, value: Any, train: Any, explicit: frozenset[str], updates: dict[str, Any],
                  implied: Mapping[str, str]) -> Optional[str]:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return f"is not a number (it sets --{flag}); give one or \"auto\""
    allowed = RANGES.get(flag)
    if allowed is not None and not allowed.holds(number):
        return f"cannot be --{flag} (it must be {allowed.describe()}); fix it or set it to \"auto\""
    if flag in updates and not _number_equal(value, updates[flag]):
        return f"disagrees with the file's other value for --{flag} ({updates[flag]}); make them equal or \"auto\""
    current = updates.get(flag, getattr(train, flag))
    if current is not None and _number_equal(value, current):
        return None
    if flag in implied:  # no flag to drop: the value is the command line's, and a flag or the file changes it
        return (f"conflicts with --{flag} {getattr(train, flag)}, which {implied[flag]}, no --{flag} given; pass "
                f"--{flag} {value} to train with the file's value, or set it to \"auto\" in the file")
    if flag in explicit:
        return f"conflicts with --{flag} {getattr(train, flag)}; set it to \"auto\" in the file or drop the flag"
    other = ALSO_SET_BY.get(flag)
    if other in explicit:
        return (f"would override --{other} {getattr(train, other)} (it sets --{flag}); set it to \"auto\" in the "
                f"file, or drop --{other} (or give --{flag} {value} instead)")
    return None


def _describe(updates: dict[str, Any]) -> str:
    return ", ".join(f"--{flag} {value}" for flag, value in updates.items())


# DeepSpeed's own defaults, used for hidden-size dependent "auto" keys when the hidden size
# is unknown.
_DS_DEFAULT_REDUCE_BUCKET = 500_000_000
_DS_DEFAULT_PREFETCH_BUCKET = 50_000_000
_DS_DEFAULT_PERSISTENCE_THRESHOLD = 100_000
# Lower bound for bucket sizes derived from a (tiny) hidden size: hidden**2 for a toy model
# would mean thousands of tiny gloo collectives per step.
_MIN_BUCKET = 1 << 20


def _check_or_fill(node: dict[str, Any], key: str, value: Any) -> None:
    current = node.get(key, "auto")
    if current == "auto":
        node[key] = value
    elif current != value:
        raise ValueError(
            f"DeepSpeed config {key}={current!r} conflicts with the training flags ({value!r}); "
            'set it to "auto"'
        )


#: The "auto" values resolve_deepspeed_config fills from the flags and the model (those HF's integration fills,
#: but the optimizer's and scheduler's, which open_sft's own replace); stage 3 also fills the save-time gather.
FILLED_AUTO = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
               "gradient_clipping", "bf16.enabled", "fp16.enabled", "zero_optimization.reduce_bucket_size",
               "zero_optimization.stage3_prefetch_bucket_size", "zero_optimization.stage3_param_persistence_threshold")
STAGE3_AUTO = "zero_optimization.stage3_gather_16bit_weights_on_model_save"


def unfilled_auto(cfg: dict[str, Any]) -> list[str]:
    """The keys of `cfg` set to "auto" that nothing fills (`"steps_per_print": "auto"`): refused up front."""
    filled = FILLED_AUTO + ((STAGE3_AUTO,) if zero_stage(cfg) == 3 else ())
    return [key for key in find_auto(cfg) if key not in filled]


def find_auto(node: Any, prefix: str = "") -> list[str]:
    found: list[str] = []
    if isinstance(node, dict):
        for key, value in node.items():
            found += find_auto(value, f"{prefix}{key}.")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += find_auto(value, f"{prefix}{i}.")
    elif node == "auto":
        found.append(prefix[:-1])
    return found


def resolve_deepspeed_config(
    config: dict[str, Any],
    *,
    micro_batch_size: int,
    gradient_accumulation_steps: int,
    world_size: int,
    bf16: bool,
    clip_grad_norm: float,
    hidden_size: int | None = None,
    fp16: bool = False,
) -> dict[str, Any]:
    """Return a copy of ``config`` with every "auto" filled from our flags.

    ``config`` comes from :func:`open_sft.config.launch.plan_launch`, which has already settled every
    conflict between the launch config and the flags (and reported it to the user), so a ``ValueError``
    here is a bug: explicit values that contradict the flags (DeepSpeed would otherwise silently train
    with e.g. a different batch size or precision), an "auto" this function does not know, or an
    "optimizer"/"scheduler" section (we always pass our own torch optimizer and scheduler).
    ``clip_grad_norm <= 0`` disables clipping (0.0).
    """
    cfg = copy.deepcopy(config)
    for section in ("optimizer", "scheduler"):
        if section in cfg:
            raise ValueError(
                f"DeepSpeed config must not contain {section!r}: open_sft creates its own {section}"
            )
    if micro_batch_size < 1 or gradient_accumulation_steps < 1 or world_size < 1:
        raise ValueError("micro_batch_size, gradient_accumulation_steps and world_size must be >= 1")

    _check_or_fill(cfg, "train_micro_batch_size_per_gpu", micro_batch_size)
    _check_or_fill(cfg, "gradient_accumulation_steps", gradient_accumulation_steps)
    _check_or_fill(cfg, "train_batch_size", micro_batch_size * gradient_accumulation_steps * world_size)
    _check_or_fill(cfg, "gradient_clipping", float(clip_grad_norm) if clip_grad_norm > 0 else 0.0)

    _fill_precision(cfg, bf16, fp16)
    zero = cfg.get("zero_optimization")
    if not isinstance(zero, dict):
        raise ValueError("DeepSpeed config needs a zero_optimization section")
    _fill_zero(zero, hidden_size)
    leftover = find_auto(cfg)
    if leftover:
        raise ValueError(f"DeepSpeed config has unsupported \"auto\" value for: {', '.join(leftover)}")
    return cfg


def _fill_precision(cfg: dict[str, Any], bf16: bool, fp16: bool) -> None:
    """bf16.enabled and fp16.enabled from the compute dtype; under fp16 the dynamic loss scaling settings the
    JSON leaves out (DEEPSPEED_FP16_DEFAULTS)."""
    for name, wanted in (("bf16", bf16), ("fp16", fp16)):
        section = cfg.setdefault(name, {})
        if not isinstance(section, dict):
            raise ValueError(f"DeepSpeed config {name} must be an object")
        enabled = section.get("enabled", "auto")
        if enabled != "auto" and str(enabled).lower() in ("true", "false"):
            enabled = str(enabled).lower() == "true"
        if enabled == "auto":
            section["enabled"] = wanted
        elif enabled != wanted:
            raise ValueError(f"DeepSpeed config {name}.enabled={section['enabled']!r} conflicts with the compute "
                             f"dtype (bf16={bf16}, fp16={fp16}); set it to \"auto\"")
        else:
            section["enabled"] = wanted
    if fp16:
        for key, value in DEEPSPEED_FP16_DEFAULTS.items():
            cfg["fp16"].setdefault(key, value)


def _fill_zero(zero: dict[str, Any], hidden_size: int | None) -> None:
    """The hidden-size dependent bucket sizes HF's integration fills, and the ZeRO-3 save-time gather."""
    if hidden_size:
        hidden_defaults = {
            "reduce_bucket_size": max(hidden_size * hidden_size, _MIN_BUCKET),
            "stage3_prefetch_bucket_size": max(int(0.9 * hidden_size * hidden_size), _MIN_BUCKET),
            "stage3_param_persistence_threshold": 10 * hidden_size,
        }
    else:
        hidden_defaults = {
            "reduce_bucket_size": _DS_DEFAULT_REDUCE_BUCKET,
            "stage3_prefetch_bucket_size": _DS_DEFAULT_PREFETCH_BUCKET,
            "stage3_param_persistence_threshold": _DS_DEFAULT_PERSISTENCE_THRESHOLD,
        }
    for key, value in hidden_defaults.items():
        if zero.get(key) == "auto":
            zero[key] = value
    if zero.get("stage") == 3 and zero.get("stage3_gather_16bit_weights_on_model_save", "auto") == "auto":
        # Needed by accelerator.get_state_dict to gather full weights under ZeRO-3.
        zero["stage3_gather_16bit_weights_on_model_save"] = True


def deepspeed_fp16_problem() -> Optional[str]:
    """Why DeepSpeed cannot train fp16 here, or None. On CPU, DeepSpeed 0.19 refuses fp16 ("Type fp16 is not
    supported on your device") unless oneDNN has fp16 kernels for this CPU (AVX512-FP16 or AMX-FP16)."""
    if torch.cuda.is_available():
        return None
    try:
        supported = bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except Exception:  # an older or unusual torch build: DeepSpeed's own check fails the same way
        supported = False
    if supported:
        return None
    return ("DeepSpeed cannot train fp16 on this CPU (it needs oneDNN fp16 kernels: AVX512-FP16 or AMX-FP16, "
            "which this CPU lacks); use --torch_dtype bfloat16 or float32 here, or train fp16 without DeepSpeed "
            "(torch autocast + GradScaler, which runs on any CPU)")


def deepspeed_nonfinite_problems(config: dict) -> list[str]:
    """Settings under which DeepSpeed 0.19 applies an optimizer step whose gradient is not finite.

    ZeRO-3, and bf16 without ZeRO, skip a step whose global gradient norm is not finite. ZeRO-1/2 do so
    in fp32 when they compute the norm (zero_optimization.compute_grad_norm, default true) and in bf16
    when bf16.check_grad_overflow is on (default true). Without ZeRO, fp32 steps a plain torch optimizer.
    """
    zero = config.get("zero_optimization", {})
    stage = zero_stage(config)
    bf16 = config.get("bf16", {})
    fp16 = config.get("fp16", {}).get("enabled", False)  # fp16 checks overflow at every stage
    problems = []
    if stage == 0 and not bf16.get("enabled", False) and not fp16:
        problems.append("zero_optimization.stage 0 in fp32 has no overflow check; use stage 1, 2 or 3")
    if stage in (1, 2) and bf16.get("enabled", False) and bf16.get("check_grad_overflow", True) is False:
        problems.append("bf16.check_grad_overflow is false; remove it or set it to true")
    if stage in (1, 2) and not bf16.get("enabled", False) and not fp16 and zero.get("compute_grad_norm", True) is False:
        problems.append("zero_optimization.compute_grad_norm is false; remove it or set it to true")
    return problems


def fp32_master_weights(engine: Any, main: bool) -> dict[str, torch.Tensor]:
    """DeepSpeed's fp32 master weights of the trained parameters of `engine.module` by state-dict name (every name
    of a tied one), CPU copies on the main process, {} elsewhere. Collective (ZeRO-1/2 all-reduce each one's
    fragments, ZeRO-3 all-gather its partitions): every rank calls it. Frozen parameters have no master."""
    from deepspeed.utils import safe_get_full_fp32_param

    from open_sft.model.anatomy import param_shape

    names: dict[int, list[str]] = {}
    for name, param in engine.module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    masters = {}
    for param in [p for p in engine.module.parameters() if p.requires_grad]:
        full = safe_get_full_fp32_param(param)
        if full is not None and main:
            full = full.detach().reshape(param_shape(param)).to("cpu", copy=True)
            masters.update({name: full for name in names[id(param)]})
    return masters
