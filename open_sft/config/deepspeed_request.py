"""What the launch asked of DeepSpeed: accelerate's settings and the DeepSpeed JSON, read into one config.

`accelerate launch` hands its settings to every worker as ACCELERATE_* environment variables, whether
they came from an `accelerate config` YAML (`--config_file`: `distributed_type: DEEPSPEED`, a
`deepspeed_config:` block, `mixed_precision`) or from its own flags (`--use_deepspeed --zero_stage 3
--offload_optimizer_device cpu ...`). A DeepSpeed JSON (`--deepspeed_config_file`, also a Trainer-style
one with `optimizer`/`scheduler` sections) may add explicit values. accelerate itself refuses to combine
a JSON with the YAML's DeepSpeed fields and leaves "auto" to the script; `deepspeed_request` reads them
all and builds one DeepSpeed config, its ZeRO section checked by DeepSpeed's own schema. Each value that
more than one place can set is decided from it in open_sft.config.launch.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Optional

from open_sft.errors import UserError

# accelerate 1.15 (utils/launch.py prepare_deepspeed_cmd_env): DeepSpeed settings → worker environment.
ENV_USE_DEEPSPEED = "ACCELERATE_USE_DEEPSPEED"
ENV_CONFIG_FILE = "ACCELERATE_DEEPSPEED_CONFIG_FILE"
ENV_FIELDS_FROM_YAML = "ACCELERATE_CONFIG_DS_FIELDS"
ENV_MIXED_PRECISION = "ACCELERATE_MIXED_PRECISION"
ENV_GRADIENT_ACCUMULATION = "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"
ENV_GRADIENT_CLIPPING = "ACCELERATE_GRADIENT_CLIPPING"
ENV_ZERO3_INIT = "ACCELERATE_DEEPSPEED_ZERO3_INIT"
# accelerate setting → (its environment variable, the DeepSpeed config key it sets).
ZERO_SETTINGS = {
    "zero_stage": ("ACCELERATE_DEEPSPEED_ZERO_STAGE", "zero_optimization.stage"),
    "offload_optimizer_device": ("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
                                 "zero_optimization.offload_optimizer.device"),
    "offload_param_device": ("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "zero_optimization.offload_param.device"),
    "offload_optimizer_nvme_path": ("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH",
                                    "zero_optimization.offload_optimizer.nvme_path"),
    "offload_param_nvme_path": ("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH",
                                "zero_optimization.offload_param.nvme_path"),
    "zero3_save_16bit_model": ("ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL",
                               "zero_optimization.stage3_gather_16bit_weights_on_model_save"),
}


# What deepspeed/launcher/launch.py (0.19) sets for each worker and torchrun does not: under `accelerate launch`
# only its multi-node DeepSpeed launchers (pdsh, ...) set them, and those pass ACCELERATE_USE_DEEPSPEED along.
DEEPSPEED_LAUNCHER_ENV = ("CROSS_RANK", "CROSS_SIZE", "LOCAL_SIZE")


def uses_deepspeed(env: Mapping[str, str] = os.environ) -> bool:
    return env.get(ENV_USE_DEEPSPEED, "false").lower() == "true"


def check_launcher(env: Mapping[str, str] = os.environ) -> None:
    """`deepspeed --num_gpus 8 finetune.py ... --no_local_rank` starts workers without accelerate's settings: the
    run would be plain data parallelism, no ZeRO, without a word. Refused with the accelerate command line."""
    if uses_deepspeed(env) or not all(name in env for name in DEEPSPEED_LAUNCHER_ENV):
        return
    world, nodes = env.get("WORLD_SIZE", "N"), env["CROSS_SIZE"]
    machines = (f" --num_machines {nodes} --machine_rank {env['CROSS_RANK']} --main_process_ip "
                f"{env.get('MASTER_ADDR', 'HOST')}" if nodes != "1" else "")
    raise UserError("started by DeepSpeed's own launcher (`deepspeed finetune.py`: CROSS_RANK, CROSS_SIZE and "
                    "LOCAL_SIZE are set, no accelerate DeepSpeed settings), which would train plain data parallelism "
                    f"without ZeRO; launch with accelerate: accelerate launch --num_processes {world}{machines} "
                    "--use_deepspeed --deepspeed_config_file configs/ds/zero2.json finetune.py ...")


def _set_path(node: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value


def _get_path(node: dict, dotted: str) -> Any:
    for key in dotted.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(key)
    return node


def _setting_value(name: str, raw: str) -> Any:
    if name == "zero_stage":
        return int(raw)
    if name == "zero3_save_16bit_model":
        return raw.lower() == "true"
    return raw.lower() if name.endswith("_device") else raw


# open_sft's DeepSpeed configs (configs/ds/ of the checkout), and the one that does what each of open-instruct's
# configs/ds_configs/ files does, named in the error for a path that is not there (its command lines name those)
OUR_CONFIGS = ("zero2.json", "zero3.json", "zero3_offload.json")


def equivalent_config(path: str) -> Optional[str]:
    """Which of OUR_CONFIGS does what open-instruct's config named like `path` does (None: not one of its names)."""
    name = os.path.basename(path)
    if not name.startswith("stage") or not name.endswith((".conf", ".json")):
        return None
    if name.startswith("stage3"):
        return "zero3.json" if "no_offloading" in name else "zero3_offload.json" if "offloading" in name else None
    return "zero2.json" if name.startswith(("stage2", "stage1")) else None


def missing_config_hint(path: str) -> str:
    """What to pass instead of a DeepSpeed config path that cannot be read."""
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs", "ds")
    where = here if os.path.isdir(here) else "configs/ds"
    equivalent = equivalent_config(path)
    if equivalent is not None:
        return (f"; open_sft's config for what {os.path.basename(path)} does in open-instruct is "
                f"{os.path.join(where, equivalent)}")
    if os.path.basename(path).startswith("stage0"):
        return "; ZeRO stage 0 is plain data parallelism: launch without --use_deepspeed (DDP)"
    return f"; open_sft's configs are {', '.join(os.path.join(where, c) for c in OUR_CONFIGS)}"


def load_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as fh:
            cfg = json.load(fh)
    except OSError as exc:
        raise UserError(f"DeepSpeed config {path}: cannot read it ({exc.strerror}); check "
                        f"--deepspeed_config_file{missing_config_hint(path)}") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"DeepSpeed config {path}: not valid JSON ({exc}); fix the file") from exc
    if not isinstance(cfg, dict):
        raise UserError(f"DeepSpeed config {path}: expected a JSON object, got {type(cfg).__name__}")
    _check_zero_section(cfg, path)
    return cfg


def _check_zero_section(cfg: dict[str, Any], path: str) -> None:
    """The ZeRO section checked by DeepSpeed's own schema now, so a wrong key is an error naming the file
    (not a failure deep inside model loading), and its settings under one spelling: DeepSpeed takes the
    ZeRO-3 ones with or without their stage3_ prefix (axolotl's configs write
    gather_16bit_weights_on_model_save), and the settings merged and filled later use the prefixed names."""
    zero = cfg.get("zero_optimization")
    if not isinstance(zero, dict):
        return
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from pydantic import ValidationError

    for name, spec in DeepSpeedZeroConfig.model_fields.items():
        if spec.alias and spec.alias != name and name in zero:
            value = zero.pop(name)
            if zero.get(spec.alias, value) != value:
                raise UserError(f"DeepSpeed config {path}: zero_optimization sets both {name}={value!r} and "
                                f"{spec.alias}={zero[spec.alias]!r}; keep one")
            zero[spec.alias] = value
    try:
        DeepSpeedZeroConfig(**{key: value for key, value in zero.items() if value != "auto"})
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise UserError(f"DeepSpeed config {path}: zero_optimization is not valid for DeepSpeed ({problems}); "
                        "fix the file") from None


def _minimal_config() -> dict[str, Any]:
    """The DeepSpeed config of a launch that gave no JSON: every value from the flags or accelerate."""
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
            "fp16": {"enabled": False}, "zero_optimization": {}}


def deepspeed_request(env: Mapping[str, str] = os.environ) -> tuple[Optional[dict[str, Any]], Optional[str], dict]:
    """(DeepSpeed config with accelerate's ZeRO settings merged in, its JSON path or None, the accelerate
    settings given), or (None, None, {}) without DeepSpeed. A setting that contradicts an explicit value
    of the JSON is an error naming both."""
    check_launcher(env)
    if not uses_deepspeed(env):
        return None, None, {}
    path = env.get(ENV_CONFIG_FILE, "none")
    path = None if not path or path.lower() == "none" else path
    cfg = load_json(path) if path else _minimal_config()
    settings = {name: _setting_value(name, env[var]) for name, (var, _) in ZERO_SETTINGS.items() if var in env}
    if ENV_ZERO3_INIT in env:
        settings["zero3_init_flag"] = env[ENV_ZERO3_INIT].lower() == "true"
    for name, value in settings.items():
        if name not in ZERO_SETTINGS or (name.endswith("nvme_path") and value == "none"):
            continue
        key = ZERO_SETTINGS[name][1]
        current = _get_path(cfg, key)
        if current in (None, "auto") or current == value:
            if not (name.endswith("_device") and value == "none" and current is None):
                _set_path(cfg, key, value)
        else:
            raise UserError(f"DeepSpeed config {path}: {key}={current!r} conflicts with accelerate's "
                            f"{name}={value!r} (from `accelerate config` or `accelerate launch --{name}`); "
                            "keep one of the two")
    zero = cfg.get("zero_optimization")
    if path is None:
        zero.setdefault("stage", 2)  # accelerate's default for `--use_deepspeed` without --zero_stage
        # Bucket sizes from the hidden size, as accelerate fills them for its own YAML-only configs.
        zero["reduce_bucket_size"] = "auto"
        if zero["stage"] == 3:
            zero.update(stage3_prefetch_bucket_size="auto", stage3_param_persistence_threshold="auto")
    if not isinstance(zero, dict) or "stage" not in zero:
        raise UserError(f"DeepSpeed config {path}: needs a zero_optimization section with a stage "
                        "(e.g. {\"zero_optimization\": {\"stage\": 2}})")
    if _get_path(cfg, "zero_optimization.offload_optimizer.device") not in (None, "none"):
        # Our torch AdamW steps the offloaded fp32 partitions; DeepSpeed would otherwise insist on its own.
        cfg.setdefault("zero_force_ds_cpu_optimizer", False)
    return cfg, path, settings
