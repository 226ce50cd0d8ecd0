"""open-instruct's finetune.py flags that are not open_sft's own: translations onto our flags, and the
ones accepted and ignored (each named once in the log, with the reason).

An open-instruct command line or train-config YAML must run unchanged (CONTRACT.md). Flags with a
meaning of their own live in open_sft.config.args; this module holds the rest, so that config.py stays the
one description of what open_sft does and this one the map from open-instruct's vocabulary onto it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Optional

import yaml

from open_sft.config.fields import help_field as _help
from open_sft.errors import UserError


@dataclass
class OpenInstructArguments:
    """Flags of allenai/open-instruct's finetune.py (and older versions of it) that map onto ours."""

    use_flash_attn: bool = _help("open-instruct: true = --attn_implementation flash_attention_2; false (its eager "
                                 "attention) = --attn_implementation sdpa.", default=False)
    reduce_loss: Optional[str] = _help(
        "open-instruct: mean = --loss_normalization mean (mean of micro-batch means); sum = --loss_normalization "
        "sum (the step's sum of token losses; open-instruct's sum is that divided by accumulation × ranks: the same "
        "direction, so the same Adam update but for --clip_grad_norm and epsilon; open_sft's default 'token' "
        "divides the sum by the global batch's trained tokens).",
        default=None)
    run_name: Optional[str] = _help("Older open-instruct: = --exp_name.", default=None)
    train_file: Optional[str] = _help("Older open-instruct: = --dataset_mixer_list FILE 1.0.", default=None)
    dataset_name: Optional[str] = _help("open-instruct: = --dataset_mixer_list NAME 1.0.", default=None)
    dataset_mixer: Optional[str] = _help(
        "open-instruct: a mapping of dataset → amount (YAML mapping or a JSON object string) = "
        "--dataset_mixer_list NAME AMOUNT ...", default=None)
    dataset_transform_fn: Optional[list[str]] = _help(
        "open-instruct: sft_tulu_tokenize_and_truncate_v1 (+ sft_tulu_filter_v1) = open_sft's pipeline "
        "(--train_on all_assistant); last_turn_tulu_tokenize_and_truncate_v1 = --train_on last_assistant; "
        "sft_tokenize_v1 = --train_on all; sft_tokenize_mask_out_prompt_v1 = --train_on last_assistant.",
        default=None)
    dataset_target_columns: Optional[list[str]] = _help(
        "open-instruct: the tokenized columns; open_sft's cache always has input_ids and labels.", default=None)
    hf_entity: Optional[str] = _help("open-instruct: the Hub user or org: --hub_model_id ENTITY/NAME.", default=None)
    hf_repo_id: Optional[str] = _help("open-instruct: = --hub_model_id (prefixed by --hf_entity if it has no '/').",
                                      default=None)
    hf_repo_revision: Optional[str] = _help("open-instruct: = --hub_revision.", default=None)
    no_push_to_hub: bool = _help("open-instruct's form of --push_to_hub false (open_sft does not push by default).",
                                 default=False)
    # Accepted and ignored: AI2's own infrastructure, or settings open-instruct itself ignores.
    do_not_randomize_output_dir: bool = _help("Ignored (open_sft never changes --output_dir).", default=False)
    low_cpu_mem_usage: bool = _help("Ignored (transformers 5 always loads that way).", default=False)
    dataset_cache_mode: Optional[str] = _help("Ignored (open_sft's cache is local: --dataset_local_cache_dir).",
                                              default=None)
    dataset_config_hash: Optional[str] = _help("Ignored (open_sft computes its cache key).", default=None)
    dataset_mix_dir: Optional[str] = _help("Ignored (the mixture is in the cache; data_report.json describes it).",
                                           default=None)
    max_train_samples: Optional[int] = _help("Ignored, as open-instruct does (use an amount in "
                                             "--dataset_mixer_list).", default=None)
    overwrite_cache: bool = _help("Ignored (a changed input changes the cache key; "
                                            "--dataset_skip_cache skips the cache).", default=False)
    load_balancing_weight: Optional[float] = _help(
        "Ignored, as open-instruct does (its loss weighs the router loss by the model's router_aux_loss_coef; "
        "set that with --additional_model_arguments).", default=None)
    save_to_hub: Optional[str] = _help("Ignored (deprecated in open-instruct; use --push_to_hub).", default=None)
    hf_repo_url: Optional[str] = _help("Ignored (derived from --hub_model_id).", default=None)
    try_launch_beaker_eval_jobs: bool = _help("Ignored (AI2's Beaker).", default=True)
    hf_metadata_dataset: Optional[str] = _help("Ignored (AI2's evaluation metadata).", default=None)
    try_auto_save_to_beaker: bool = _help("Ignored (AI2's Beaker).", default=True)
    gs_bucket_path: Optional[str] = _help("Ignored (AI2's Google Cloud upload).", default=None)
    oe_eval_tasks: Optional[list[str]] = _help("Ignored (AI2's evaluation jobs).", default=None)
    oe_eval_max_length: Optional[int] = _help("Ignored (AI2's evaluation jobs).", default=None)
    sync_each_batch: bool = _help("Ignored (gradients are synchronised once per optimizer step).",
                                            default=False)
    verbose: bool = _help("Ignored.", default=False)
    use_fast: bool = _help("Ignored (open_sft uses the fast tokenizer).", default=True)
    use_slow_tokenizer: bool = _help("Ignored, as open-instruct does.", default=False)
    get_tokenizer_fn: Optional[str] = _help("Ignored (open_sft loads the tokenizer one way).", default=None)
    tokenizer_files_hash: Optional[list[str]] = _help("Ignored (the cache key hashes the tokenizer files).",
                                                      default=None)
    ground_truths_key: Optional[str] = _help("Ignored (RL only).", default=None)
    add_seed_and_date_to_exp_name: bool = _help("Ignored (older open-instruct).", default=False)


IGNORED = ("do_not_randomize_output_dir", "low_cpu_mem_usage", "dataset_cache_mode", "dataset_config_hash",
           "dataset_mix_dir", "max_train_samples", "overwrite_cache", "load_balancing_weight", "save_to_hub",
           "hf_repo_url", "try_launch_beaker_eval_jobs", "hf_metadata_dataset", "try_auto_save_to_beaker",
           "gs_bucket_path", "oe_eval_tasks", "oe_eval_max_length", "sync_each_batch", "verbose", "use_fast",
           "use_slow_tokenizer", "get_tokenizer_fn", "tokenizer_files_hash", "ground_truths_key",
           "add_seed_and_date_to_exp_name")
TRANSFORMS = {  # open-instruct dataset_transform_fn → --train_on (None: a filter, nothing to map)
    "sft_tulu_tokenize_and_truncate_v1": "all_assistant", "sft_tulu_tokenize_without_truncation_v1": "all_assistant",
    "last_turn_tulu_tokenize_and_truncate_v1": "last_assistant", "sft_tokenize_v1": "all",
    "sft_tokenize_mask_out_prompt_v1": "last_assistant", "sft_tulu_filter_v1": None, "sft_filter_v1": None,
}
TARGET_COLUMNS = {"input_ids", "attention_mask", "labels", "dataset_source", "position_ids"}
# YAML keys of open-instruct that are aliases of ours (the command-line aliases are argparse's).
YAML_ALIASES = {"tokenizer_name": "tokenizer_name_or_path", "chat_template": "chat_template_name"}


def _mixer_pairs(value: Any) -> list[str]:
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip().startswith("{") else yaml.safe_load(value)
        except (json.JSONDecodeError, yaml.YAMLError) as exc:
            raise UserError(f"--dataset_mixer {value!r}: expected a mapping of dataset to amount, e.g. "
                            "'{\"data.jsonl\": 1.0}' ({exc})") from exc
    return mapping_pairs("--dataset_mixer", value)


def mapping_pairs(where: str, value: Any) -> list[str]:
    """open-instruct's `dataset_mixer` mapping {dataset: amount} (`where` names it in errors) → the NAME AMOUNT
    list of --dataset_mixer_list; a YAML dataset_mixer_list written as such a mapping is read the same way."""
    if not isinstance(value, dict) or not value:
        raise UserError(f"{where}: expected a mapping of dataset to amount, got {value!r}")
    return [x for name, amount in value.items() for x in (str(name), _mapping_amount(where, name, amount))]


def _mapping_amount(where: str, name: Any, amount: Any) -> str:
    """An amount of open-instruct's `dataset_mixer` mapping as --dataset_mixer_list writes it: there a number
    above 1 is a count of rows (int(), so 2.5 is 2 rows) and one up to 1 a fraction (so `1` is every row, not one
    row as `1` is in --dataset_mixer_list)."""
    try:
        number = float(amount)
    except (TypeError, ValueError):
        raise UserError(f"{where}: the amount of {name} is {amount!r}; give a fraction up to 1 or a row "
                        "count, e.g. {\"data.jsonl\": 1.0}") from None
    return str(int(number)) if number > 1 else repr(number)


class Translation:
    """Collects the replacements per config section and one note per decision (after the config's own)."""

    def __init__(self, config: Any):
        self.config, self.notes, self.warnings = config, list(config.notes), list(config.warnings)
        self.changes: dict[str, dict[str, Any]] = {}

    def given(self, name: str) -> bool:
        return name in self.config.explicit

    def set(self, section: str, name: str, value: Any, because: str) -> None:
        current = getattr(getattr(self.config, section), name)
        if self.given(name) and current != value:
            raise UserError(f"{because} contradicts --{name} {current}; give one of the two")
        self.changes.setdefault(section, {})[name] = value

    def result(self) -> Any:
        replaced = {s: dataclasses.replace(getattr(self.config, s), **v) for s, v in self.changes.items()}
        return dataclasses.replace(self.config, **replaced, notes=tuple(self.notes), warnings=tuple(self.warnings))


def translate(config: Any, oi: OpenInstructArguments) -> Any:
    """The config with open-instruct's flags applied onto ours; `config.notes` names what was ignored."""
    t = Translation(config)
    if oi.use_flash_attn:
        t.set("model", "attn_implementation", "flash_attention_2", "--use_flash_attn")
    elif t.given("use_flash_attn"):  # false: open-instruct then ran eager attention; sdpa computes the same, faster
        if config.model.attn_implementation == "flash_attention_2":
            raise UserError("--use_flash_attn false contradicts --attn_implementation flash_attention_2; give one of "
                            "the two")
        if not t.given("attn_implementation"):
            t.set("model", "attn_implementation", "sdpa", "--use_flash_attn false")
    if oi.reduce_loss is not None:
        if oi.reduce_loss not in ("mean", "sum"):
            raise UserError(f"--reduce_loss {oi.reduce_loss!r}: expected mean or sum")
        t.set("train", "loss_normalization", oi.reduce_loss, f"--reduce_loss {oi.reduce_loss}")
    if oi.run_name:
        t.set("train", "exp_name", oi.run_name, f"--run_name {oi.run_name}")
    sources = [(flag, value) for flag, value in (("--train_file", oi.train_file), ("--dataset_name", oi.dataset_name))
               if value]
    pairs = [x for _, value in sources for x in (value, "1.0")]
    if oi.dataset_mixer is not None:
        sources.append(("--dataset_mixer", oi.dataset_mixer))
        pairs += _mixer_pairs(oi.dataset_mixer)
    if pairs:
        described = " and ".join(flag for flag, _ in sources)
        if config.data.dataset_mixer_list and "dataset_mixer_list" in config.explicit:
            raise UserError(f"{described} and --dataset_mixer_list both name the training data; give one of them")
        t.changes.setdefault("data", {})["dataset_mixer_list"] = pairs
    for fn in oi.dataset_transform_fn or []:
        if fn not in TRANSFORMS:
            raise UserError(f"--dataset_transform_fn {fn}: not an SFT transform open_sft can follow; use "
                            f"{', '.join(TRANSFORMS)} (or leave it out)")
        if TRANSFORMS[fn]:
            t.set("data", "train_on", TRANSFORMS[fn], f"--dataset_transform_fn {fn}")
    extra = sorted(set(oi.dataset_target_columns or []) - TARGET_COLUMNS)
    if extra:
        raise UserError(f"--dataset_target_columns {' '.join(extra)}: open_sft's cache has input_ids and labels; "
                        "leave the flag out")
    if oi.hf_repo_id or oi.hf_entity:
        name = oi.hf_repo_id or (config.train.exp_name or "open_sft")
        repo = name if "/" in name or not oi.hf_entity else f"{oi.hf_entity}/{name}"
        t.set("hub", "hub_model_id", repo, "--hf_repo_id/--hf_entity")
    if oi.hf_repo_revision:
        t.set("hub", "hub_revision", oi.hf_repo_revision, f"--hf_repo_revision {oi.hf_repo_revision}")
    elif config.train.exp_name and config.hub.push_to_hub and not t.given("hub_revision"):
        t.changes.setdefault("hub", {})["hub_revision"] = config.train.exp_name  # open-instruct's default
    if oi.no_push_to_hub:
        t.set("hub", "push_to_hub", False, "--no_push_to_hub")
    given = [name for name in IGNORED if name in config.explicit]
    if given:
        reasons = {f.name: f.metadata["help"] for f in dataclasses.fields(OpenInstructArguments)}
        t.notes.append("open-instruct flags accepted and ignored: " +
                       "; ".join(f"--{name} ({_reason(reasons[name])})" for name in given))
    return t.result()


def _reason(help_text: str) -> str:
    """An ignored flag's --help text as the reason in the log line: "Ignored, as open-instruct does (use
    X)." → "as open-instruct does (use X)"; "Ignored (AI2's Beaker)." → "AI2's Beaker"."""
    reason = help_text.removeprefix("Ignored").strip(" ,:").removesuffix(".")
    if reason.startswith("(") and reason.endswith(")") and reason.count("(") == 1:
        reason = reason[1:-1]
    return reason or "no effect"
