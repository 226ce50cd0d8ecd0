"""Flags that do something only beside another flag, given without it (`--lora_rank 8` alone was a full fine-tune
without a word). open_sft's own such flags are refused, as --merge_lora_on_save and --fp8_recipe are; open-instruct's
(--lora_rank, --lora_alpha, --lora_dropout: open-instruct ignores them so too) are warned about, since an
open-instruct command line must run unchanged; so is --hub_model_id without --push_to_hub (it names the model card,
uploads nothing; open-instruct pushes by default). --eval_steps without evaluation data is refused."""

from __future__ import annotations

from typing import Any

from open_sft.config.args import FinetuneConfig, LoraArguments
from open_sft.config.fields import field_default

OPEN_INSTRUCT_LORA_SETTINGS = ("lora_rank", "lora_alpha", "lora_dropout")  # open-instruct's flags
OWN_LORA_SETTINGS = ("lora_target_modules",)
HUB_SETTINGS = ("hub_model_id", "hub_revision", "hub_private")
OPEN_INSTRUCT_HUB_NAMING = ("hf_entity", "hf_repo_id")  # open-instruct's flags that make --hub_model_id


def _lora_given(config: FinetuneConfig, names: tuple[str, ...]) -> list[str]:
    """`--flag value` for each of `names` given with a value other than its default, when no LoRA is trained.
    (open-instruct's dumped train configs carry every LoRA setting at its default, the same as ours, with use_lora
    false: they must run unchanged.)"""
    lora = config.lora
    if lora.use_lora or lora.use_qlora:
        return []
    return [f"--{name} {_shown(getattr(lora, name))}" for name in names
            if name in config.explicit and getattr(lora, name) != field_default(name, LoraArguments)]


def companion_problems(config: FinetuneConfig) -> list[str]:
    problems, data = [], config.data
    given = _lora_given(config, OWN_LORA_SETTINGS)
    if given:
        problems.append(f"{', '.join(given)} chooses what LoRA adapts, but neither --use_lora nor --use_qlora is "
                        "given: the run would fine-tune the whole model. Add --use_lora (or --use_qlora), or drop "
                        "--lora_target_modules")
    if config.train.eval_steps is not None and not data.eval_dataset_mixer_list and not data.eval_split_ratio:
        problems.append(f"--eval_steps {config.train.eval_steps} evaluates held-out data, and there is none: add "
                        "--eval_dataset_mixer_list NAME AMOUNT or --eval_split_ratio R (e.g. 0.02), or drop "
                        "--eval_steps")
    return problems


def companion_warnings(config: FinetuneConfig) -> list[str]:
    warnings, hub = [], config.hub
    given = _lora_given(config, OPEN_INSTRUCT_LORA_SETTINGS)
    if given:  # open-instruct ignores them so too, and its command lines run unchanged: said, not refused
        flags = " ".join(text.split()[0] for text in given)
        warnings.append(f"{', '.join(given)} set up LoRA, but neither --use_lora nor --use_qlora is given: this run "
                        f"fine-tunes the whole model and ignores {flags}. Add --use_lora (or --use_qlora) to train "
                        "LoRA adapters")
    named = [f"--{name}" for name in HUB_SETTINGS if name in config.explicit]
    if hub.hub_model_id and "hub_model_id" not in config.explicit:  # open-instruct's flags named it: say those
        given = [f"--{name}" for name in OPEN_INSTRUCT_HUB_NAMING if name in config.explicit]
        named.insert(0, f"{'/'.join(given)} (naming --hub_model_id {hub.hub_model_id})" if given else "--hub_model_id")
    if named and not hub.push_to_hub and "no_push_to_hub" not in config.explicit:  # open-instruct's explicit "don't"
        warnings.append(f"{', '.join(named)} without --push_to_hub: nothing is uploaded (the "
                        "id names the model card). Add --push_to_hub to upload at the end, or upload the export later "
                        f"with python -m open_sft push OUTPUT_DIR --hub_model_id {hub.hub_model_id or 'ID'}")
    return warnings


def _shown(value: Any) -> str:
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)
