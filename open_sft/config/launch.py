"""What the launch asked for, reconciled with finetune.py's flags before anything is built.

The launch's DeepSpeed config, accelerate's settings merged into its JSON, comes from
open_sft.config.deepspeed_request (FSDP's settings from open_sft.distributed.fsdp); here each value that
more than one place can set is decided, once:

* a flag the user gave (command line or run YAML) wins over accelerate's config, with one line saying
  so: `accelerate config` writes `gradient_accumulation_steps: 1` and a clipping value into every
  DeepSpeed YAML whether or not the user thought about them, while the flag is this run's recipe;
* an explicit value in the DeepSpeed JSON that contradicts a given flag is an error naming both: the
  file was written for a run, so one of the two is a mistake;
* a value the flags leave at their default is taken from the launch config (JSON, then accelerate),
  with one line saying so; otherwise the flag's default stands.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

import torch

from open_sft.config.deepspeed_request import (ENV_FIELDS_FROM_YAML, ENV_GRADIENT_ACCUMULATION, ENV_GRADIENT_CLIPPING,
                                               ENV_MIXED_PRECISION, ZERO_SETTINGS, deepspeed_request)
from open_sft.distributed.parallelism import Parallelism, resolve as resolve_parallelism
from open_sft.distributed.deepspeed import (FILLED_AUTO, STAGE3_AUTO, deepspeed_fp16_problem, replace_trainer_sections,
                                           unfilled_auto, zero_stage)
from open_sft.distributed.fsdp import fsdp_request
from open_sft.errors import ConfigError, UserError
from open_sft.model.precision import FLAG_DTYPES, DtypeChoice

logger = logging.getLogger("open_sft")  # the run's own lines, as run.py logs them

if TYPE_CHECKING:
    from open_sft.config.args import ModelArguments, TrainingArguments

# Every accelerate variable accelerate refuses beside a JSON file; cleared once their values are merged.
_MERGED_ENV = [env for env, _ in ZERO_SETTINGS.values()] + [ENV_GRADIENT_ACCUMULATION, ENV_GRADIENT_CLIPPING]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "no": torch.float32}


@dataclass
class LaunchPlan:
    """The decisions: flags as resolved, the compute dtype, the DeepSpeed config still holding "auto"
    where the flags fill it, how the run is spread, and one line per decision that was not the plain flag."""

    train: TrainingArguments
    dtype: torch.dtype
    deepspeed_config: Optional[dict[str, Any]]
    parallelism: Parallelism  # the engine and every degree, resolved once (open_sft.distributed.parallelism)
    notes: list[str] = field(default_factory=list)
    record: dict[str, Any] = field(default_factory=dict)
    dtype_choice: Optional[DtypeChoice] = None
    zero3_init: bool = False  # load the model partitioned, under deepspeed.zero.Init (ZeRO-3)
    fsdp: Optional[dict[str, str]] = None  # FSDP2: the launch's FSDP_* settings (open_sft.distributed.fsdp)

    def log(self) -> None:
        """The decisions, a line each (main process)."""
        for note in self.notes:
            logger.info("launch config: %s", note)
        if self.dtype_choice is not None:
            logger.info("compute dtype %s: %s", self.dtype_choice.dtype, self.dtype_choice.reason)
        logger.info("parallelism: %s", self.parallelism.describe())


class _Decider:
    """Picks each value from (given flag, DeepSpeed JSON, accelerate's config, flag default)."""

    def __init__(self, explicit: frozenset[str], path: Optional[str], problems: list[str]):
        """`problems`: the conflicts found so far; each pick adds its own, refused together once all are picked."""
        self.explicit, self.path, self.notes, self.problems = explicit, path, [], problems

    def pick(self, flag: str, flag_value: Any, json_key: Optional[str], json_value: Any,
             accelerate_name: Optional[str], accelerate_value: Any) -> Any:
        json_value = None if json_value == "auto" else json_value
        if json_value is not None and accelerate_value is not None and json_value != accelerate_value:
            self.problems.append(f"DeepSpeed config {self.path}: {json_key}={json_value!r} conflicts with "
                                 f"accelerate's {accelerate_name}={accelerate_value!r}; keep one of the two")
            return flag_value
        given = flag in self.explicit
        if json_value is not None and json_value != flag_value:
            if given:
                self.problems.append(f"DeepSpeed config {self.path}: {json_key}={json_value!r} conflicts with "
                                     f"--{flag} {flag_value}; set it to \"auto\" in the file or drop the flag")
                return flag_value
            self.notes.append(f"{flag} = {json_value} from {json_key} in {self.path} (no --{flag} given)")
            return json_value
        if accelerate_value is not None and accelerate_value != flag_value:
            if given:
                self.notes.append(f"--{flag} {flag_value} wins over accelerate's {accelerate_name}="
                                  f"{accelerate_value} (the flag is this run's recipe; the accelerate config "
                                  "only sets up the machine)")
                return flag_value
            self.notes.append(f"{flag} = {accelerate_value} from accelerate's {accelerate_name} "
                              f"(no --{flag} given)")
            return accelerate_value
        return flag_value


def _precision_in_json(cfg: Optional[dict], path: Optional[str]) -> Optional[str]:
    """"bf16", "fp16" or "no" when the DeepSpeed JSON fixes the precision (an `enabled: true`, or bf16 switched
    off), None when it leaves it to the flags ("auto" or absent)."""
    if not cfg:
        return None

    def enabled(name: str) -> Optional[bool]:
        value = cfg.get(name, {}).get("enabled", "auto") if isinstance(cfg.get(name), dict) else "auto"
        return None if str(value).lower() == "auto" else str(value).lower() == "true"

    bf16, fp16 = enabled("bf16"), enabled("fp16")
    if bf16 and fp16:
        raise UserError(f"DeepSpeed config {path}: bf16.enabled and fp16.enabled are both true; keep one of the two")
    if bf16 or fp16:
        return "bf16" if bf16 else "fp16"
    return "no" if bf16 is False else None  # bf16 switched off, fp16 not on: fp32


def _dtype(torch_dtype: str, decider: _Decider, json_precision: Optional[str], env: Mapping[str, str],
           choose: Callable[[], DtypeChoice]) -> DtypeChoice:
    """The compute dtype and why: --torch_dtype when given, else the launch config's precision, else auto."""
    mixed = env.get(ENV_MIXED_PRECISION, "no").lower()
    from_yaml = "mixed_precision" in env.get(ENV_FIELDS_FROM_YAML, "").split(",")
    # 'no' is also accelerate's default when nothing was said: only a YAML's 'no' is a request for fp32.
    accelerate = None if mixed == "no" and not from_yaml else mixed
    if accelerate not in (None, *DTYPES) and torch_dtype == "auto":
        raise UserError(f"accelerate's mixed_precision={mixed} is not supported with --torch_dtype auto "
                        "(open_sft trains in bf16, fp16 or fp32); set mixed_precision to bf16, fp16 or no, or pass "
                        "--torch_dtype bfloat16, float16 or float32")
    if torch_dtype != "auto":
        dtype = FLAG_DTYPES[torch_dtype]
        if json_precision is not None and DTYPES[json_precision] != dtype:
            raise UserError(f"DeepSpeed config {decider.path}: its precision ({json_precision}) conflicts with "
                            f"--torch_dtype {torch_dtype}; set bf16.enabled and fp16.enabled to \"auto\" in the file "
                            "or drop the flag")
        if accelerate is not None and DTYPES.get(accelerate) != dtype:
            decider.notes.append(f"--torch_dtype {torch_dtype} wins over accelerate's mixed_precision={mixed} "
                                 "(the flag is this run's recipe)")
        return choose()
    if json_precision is not None:
        if accelerate is not None and accelerate != json_precision:
            raise UserError(f"DeepSpeed config {decider.path}: its precision ({json_precision}) conflicts with "
                            f"accelerate's mixed_precision={mixed}; keep one of the two")
        return DtypeChoice(DTYPES[json_precision], f"{json_precision} in {decider.path} (--torch_dtype auto follows "
                                                   "the launch config)")
    if accelerate is not None:
        return DtypeChoice(DTYPES[accelerate], f"accelerate's mixed_precision={mixed} (--torch_dtype auto follows the "
                                              "launch config)")
    return choose()


def _env_number(env: Mapping[str, str], name: str, kind: type) -> Any:
    raw = env.get(name)
    if raw is None or raw.lower() in ("", "auto", "none"):
        return None
    try:
        return kind(raw)
    except ValueError as exc:
        raise UserError(f"accelerate passed {name}={raw!r}, not a number; fix the accelerate config") from exc


def _picked(train: TrainingArguments, cfg: Optional[dict], env: Mapping[str, str], decider: _Decider
            ) -> dict[str, Any]:
    """Accumulation, clipping and micro-batch from the flags, the DeepSpeed JSON and accelerate's config; every
    conflict found until now and here refused at once (one relaunch fixes them all), one conflict as one line."""
    ds = cfg or {}
    updates: dict[str, Any] = {}
    updates["gradient_accumulation_steps"] = int(decider.pick(
        "gradient_accumulation_steps", train.gradient_accumulation_steps, "gradient_accumulation_steps",
        ds.get("gradient_accumulation_steps"), "gradient_accumulation_steps",
        _env_number(env, ENV_GRADIENT_ACCUMULATION, int) if cfg is not None else None))
    clip = ds.get("gradient_clipping")
    clip = None if clip == "auto" or clip is None else (float(clip) if float(clip) > 0 else -1.0)
    acc_clip = _env_number(env, ENV_GRADIENT_CLIPPING, float) if cfg is not None else None
    flag_clip = float(train.clip_grad_norm) if train.clip_grad_norm > 0 else -1.0
    updates["clip_grad_norm"] = float(decider.pick("clip_grad_norm", flag_clip, "gradient_clipping", clip,
                                                   "gradient_clipping", acc_clip))
    updates["per_device_train_batch_size"] = int(decider.pick(
        "per_device_train_batch_size", train.per_device_train_batch_size, "train_micro_batch_size_per_gpu",
        ds.get("train_micro_batch_size_per_gpu"), None, None))
    if len(decider.problems) == 1:
        raise UserError(decider.problems[0])
    if decider.problems:
        raise ConfigError(decider.problems)
    return updates


def plan_launch(train: TrainingArguments, model_args: ModelArguments, explicit: frozenset[str],
                choose: Callable[[], DtypeChoice], env: Mapping[str, str] = os.environ,
                resumed: Optional[tuple[int, int]] = None, implied: Optional[Mapping[str, str]] = None) -> LaunchPlan:
    """Decide the run's accumulation, clipping, micro-batch, optimizer, schedule and dtype from the flags and the
    launch config (its DeepSpeed config keeps "auto" where they fill it); `resumed`: elastic.batch_of's checkpoint;
    `implied`: FinetuneConfig.implied."""
    cfg, path, settings = deepspeed_request(env)
    fsdp = fsdp_request(env)
    if cfg is not None and fsdp is not None:
        raise UserError("the launch asks for both DeepSpeed and FSDP; pick one engine (--use_deepspeed or --use_fsdp, "
                        "or one accelerate config file)")
    updates: dict[str, Any] = {}
    problems: list[str] = []
    section_notes: list[str] = []
    if cfg is not None:
        cfg, section_updates, section_notes, problems = replace_trainer_sections(cfg, path, train, explicit,
                                                                                 implied or {})
        updates.update(section_updates)
    decider = _Decider(explicit, path, problems)
    decider.notes += section_notes
    if cfg is not None and train.use_8bit_optimizer:
        raise UserError("--use_8bit_optimizer does not work under DeepSpeed (ZeRO steps its flat fp32 partitions "
                        "with a torch optimizer); drop the flag, or train without DeepSpeed")
    updates.update(_picked(train, cfg, env, decider))
    train = dataclasses.replace(train, **updates)
    choice = _dtype(model_args.torch_dtype, decider, _precision_in_json(cfg, path), env, choose)
    problem = deepspeed_fp16_problem() if cfg is not None and choice.dtype == torch.float16 else None
    if problem:
        raise UserError(f"{problem} (compute dtype float16: {choice.reason})")
    spread = resolve_parallelism(train, cfg, fsdp, env)
    if cfg is not None:
        _check_global_batch(cfg, path, train, spread.world_size, resumed, decider.notes)
        # Every value decided above now lives in the flags; the config takes them at resolve time.
        for key in ("gradient_accumulation_steps", "gradient_clipping", "train_micro_batch_size_per_gpu",
                    "train_batch_size"):
            cfg[key] = "auto"
        for name in ("bf16", "fp16"):
            section = cfg.setdefault(name, {})
            if not isinstance(section, dict):
                raise UserError(f"DeepSpeed config {path}: {name} must be an object, e.g. {{\"enabled\": \"auto\"}}")
            section["enabled"] = "auto"
        _refuse_unfilled_auto(cfg, path)
        _gather_on_save(cfg, path, settings, decider.notes)
        for var in _MERGED_ENV:  # merged above: accelerate would refuse them beside our own config
            os.environ.pop(var, None)
        os.environ.pop(ENV_FIELDS_FROM_YAML, None)
    zero3_init = _zero3_init(cfg, settings, decider.notes)
    record = {"deepspeed_config_file": path, "accelerate_deepspeed_settings": settings,
              "decisions": list(decider.notes), "zero3_init": zero3_init, "fsdp_settings": fsdp,
              "parallelism": spread.to_dict()}
    return LaunchPlan(train=train, dtype=choice.dtype, deepspeed_config=cfg, parallelism=spread, notes=decider.notes,
                      record=record, dtype_choice=choice, zero3_init=zero3_init, fsdp=fsdp)


def _refuse_unfilled_auto(cfg: dict, path: Optional[str]) -> None:
    """An "auto" open_sft does not fill (`"steps_per_print": "auto"`) is named with the file before anything loads
    (DeepSpeed would read the string as a number and fail inside its engine)."""
    leftover = unfilled_auto(cfg)
    if leftover:
        raise UserError(f"DeepSpeed config {path or '(the accelerate config)'}: \"auto\" is not a value open_sft "
                        f"fills for {', '.join(leftover)}; give {'it' if len(leftover) == 1 else 'each'} a value, "
                        "or remove the key for DeepSpeed's default. \"auto\" is filled for "
                        f"{', '.join(FILLED_AUTO)} (and, under ZeRO-3, {STAGE3_AUTO})")


def _gather_on_save(cfg: dict, path: Optional[str], settings: dict, notes: list[str]) -> None:
    """Under ZeRO-3 the export at the end gathers the full weights (accelerator.get_state_dict), which DeepSpeed
    allows only with stage3_gather_16bit_weights_on_model_save on: a false one (`accelerate config` answers no by
    default, writing zero3_save_16bit_model: false) would train to the end and fail there. It is switched on with a
    line: in DeepSpeed 0.19 and accelerate 1.16 it changes nothing but that save-time gather."""
    zero = cfg.get("zero_optimization", {})
    if zero_stage(cfg) != 3 or zero.get("stage3_gather_16bit_weights_on_model_save", "auto") in ("auto", True):
        return
    zero["stage3_gather_16bit_weights_on_model_save"] = True
    from_accelerate = settings.get("zero3_save_16bit_model") is False
    where = "(accelerate's zero3_save_16bit_model)" if from_accelerate else f"in {path}"
    notes.append(f"stage3_gather_16bit_weights_on_model_save false {where} is set to true: the export at the end "
                 "gathers the ZeRO-3 shards into full weights, which needs it (it changes nothing else)")


def _zero3_init(cfg: Optional[dict], settings: dict, notes: list[str]) -> bool:
    """ZeRO-3 loads the model partitioned (deepspeed.zero.Init: each rank materialises only its share of
    the weights) unless accelerate's zero3_init_flag is false; accelerate and the HF Trainer default to
    it for stage 3 too."""
    if zero_stage(cfg) != 3:
        return False
    if settings.get("zero3_init_flag") is False:
        notes.append("zero3_init_flag false: the model is loaded whole on each rank and partitioned by ZeRO-3 "
                     "when training starts")
        return False
    notes.append("ZeRO-3: the model is loaded partitioned (deepspeed.zero.Init), each rank holding its share")
    return True


def _check_global_batch(cfg: dict, path: Optional[str], train: TrainingArguments, world: int,
                        resumed: Optional[tuple[int, int]], notes: list[str]) -> None:
    """An explicit train_batch_size must be the global batch this launch trains. On a resume on other ranks that
    is the checkpoint's (the accumulation is fitted to keep it, open_sft.training.elastic): a file pinning the
    run's global batch goes on, said in a line. Otherwise the refusal names the accumulation that keeps it."""
    total = cfg.get("train_batch_size")
    if total in (None, "auto"):
        return
    micro, accumulation = train.per_device_train_batch_size, train.gradient_accumulation_steps
    wanted = micro * accumulation * world
    if int(total) == wanted:
        return
    if resumed is not None and resumed[1] != world and int(total) == resumed[0]:
        notes.append(f"train_batch_size={total} in {path} is the {resumed[1]}-rank checkpoint's global batch: on "
                     f"{world} rank(s) the accumulation is fitted to keep it")
        return
    if int(total) % (micro * world):
        way = f"{world} ranks cannot hold it in micro-batches of {micro}: launch a number of processes that divides "\
              f"{int(total) // micro}" if int(total) % micro == 0 else f"it is no multiple of micro-batch {micro}"
    else:
        keep = int(total) // (micro * world)
        pinned = cfg.get("gradient_accumulation_steps") not in (None, "auto")
        way = (f"accumulation {keep} keeps it on {world} ranks: pass --gradient_accumulation_steps {keep}"
               + (" and set gradient_accumulation_steps to \"auto\" in the file" if pinned else ""))
    raise UserError(f"DeepSpeed config {path}: train_batch_size={total} is not micro-batch {micro} × accumulation "
                    f"{accumulation} × {world} ranks = {wanted}; {way}; or set train_batch_size to \"auto\" (or "
                    "change --per_device_train_batch_size)")
