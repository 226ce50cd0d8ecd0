"""`finetune.py [run.yaml] --flag value ...` → a validated FinetuneConfig.

The YAML (open_sft's or an open-instruct train config) gives defaults and flags override them. Flags are read
whole, never as a prefix of another (open_sft.config.whole_flags, as every command line of open_sft);
open-instruct's own command lines write every flag whole. Every mistake (unknown flag, bad
value, unknown YAML key) is a UserError naming the flag and the fix, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
from pathlib import Path
from typing import Any, NoReturn

import yaml
from transformers import HfArgumentParser
from transformers.hf_argparser import string_to_bool

from open_sft.config import olmo_core
from open_sft.config import open_instruct as compat
from open_sft.config.argv import RUN_CONFIG_SUFFIXES, late_run_config, refuse_repeated_lists
from open_sft.config.args import (CheckpointArguments, DataArguments, FinetuneConfig, HubArguments, LoraArguments,
                             ModelArguments, TrainingArguments)
from open_sft.config.checks import validate
from open_sft.config.companions import companion_warnings
from open_sft.config.whole_flags import WholeFlagParser, flag_hint
from open_sft.errors import ConfigError, UserError

DATACLASSES = (ModelArguments, DataArguments, TrainingArguments, LoraArguments, CheckpointArguments,
               HubArguments, compat.OpenInstructArguments, olmo_core.OlmoCoreArguments)


class _Parser(WholeFlagParser, HfArgumentParser):
    """argparse reports mistakes by printing usage and exiting; here they become one `error:` line. Flags are read
    whole (WholeFlagParser); an unknown one that another trainer has gets open_sft's way to say the same."""

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{message}; see python finetune.py --help")

    def flag_hint(self, flag: str) -> str:
        return flag_hint(self, flag, FOREIGN_FLAGS.get(flag.replace("-", "_").lstrip("_")))


def _make_parser() -> _Parser:
    """HfArgumentParser turns each field's Literal type into argparse choices, so --help lists them; argparse
    would then refuse a bad value alone, before the other flags are read. The choices stay in the help and are
    judged in open_sft.config.checks with every other problem, all reported at once."""
    parser = _Parser(DATACLASSES)
    for action in list(parser._actions):
        if action.choices:
            action.metavar = "{" + ",".join(map(str, action.choices)) + "}"
            action.choices = None
        _say_what_the_negation_does(action)
        _add_negation(parser, action)
    return parser


def _add_negation(parser: _Parser, action: argparse.Action) -> None:
    """`--no_X` for an on/off flag X that is off by default, as HfArgumentParser gives open-instruct's flags that
    are on by default: its `--no_clean_checkpoints_at_end`, older `--no_use_flash_attn`, `--no_verbose` (ours are
    off by default, so the parser made none). Kept out of --help (`--X false` says the same). A flag whose default
    is decided later (Optional[bool], None: --load_balancing_loss, --balance_micro_batches) gets one too, and
    `--X` alone means true, as for the others (HfArgumentParser asks such a flag for a value)."""
    flag = next((name for name in action.option_strings if name.startswith("--")), None)
    if flag is not None and action.type is string_to_bool and action.default is None and action.nargs is None:
        action.nargs, action.const = "?", True
    if flag is None or action.nargs != "?" or action.const is not True or action.default not in (False, None):
        return
    negation = "--no_" + flag[2:]
    if negation not in parser._option_string_actions:
        parser.add_argument(negation, action="store_false", dest=action.dest, default=argparse.SUPPRESS,
                            help=argparse.SUPPRESS)


def _say_what_the_negation_does(action: argparse.Action) -> None:
    """HfArgumentParser gives a flag that defaults to on a `--no_X` spelling carrying X's own help and "(default:
    False)", so `--no_hub_private` read "Create the Hub repository as private." Its help says what it does."""
    names = [name for name in action.option_strings if name.startswith("--no_")]
    if not names or not isinstance(action, argparse._StoreFalseAction) or action.help in (None, argparse.SUPPRESS):
        return
    flag = "--" + names[0].removeprefix("--no_")
    action.help = f"Turn {flag} off (it is on by default): {flag} means: {action.help}"
    action.default = argparse.SUPPRESS  # (the parse takes the default from the flag itself)


def _unknown_flag_error(parser: _Parser, leftover: list[str], argv: list[str]) -> UserError:
    flags = [arg.split("=", 1)[0] for arg in leftover if arg.startswith("-")]
    configs = [arg for arg in leftover if arg.endswith(RUN_CONFIG_SUFFIXES)]
    if not flags and configs:  # (the first argument, a run config, was read: this is another, or one given late)
        return UserError(late_run_config(configs[0], "a second one" if configs[0] == argv[0] else "one given after "
                                         "a flag"))
    if not flags and argv and leftover[0] == argv[0] and "." in Path(argv[0]).name:  # a run config, not YAML
        return UserError(f"{argv[0]}: a run config is a YAML file (.yaml or .yml), given first; "
                         f"{Path(argv[0]).suffix or 'this'} files are not read (a JSON object is YAML: rename it to "
                         f"{Path(argv[0]).stem}.yaml), or pass the settings as flags")
    if not flags:
        after = _flag_before(argv, leftover)
        action = next((a for a in parser._actions if after in a.option_strings), None) if after else None
        counts = {None: "one value", "?": "at most one value", 0: "no value"}
        takes = f" (after {after}, which takes {counts[action.nargs]})" if action and action.nargs in counts else ""
        return UserError(f"unexpected argument(s) {' '.join(leftover)}{takes}: every value follows a --flag "
                         "(see python finetune.py --help)")
    # (a --flag the parser lacks was refused before any value was read, by WholeFlagParser: the flags left here
    # are single-dash ones, -x, and words argparse took for values, a space before any '=')
    return UserError(f"unknown flag {', '.join(map(parser.flag_hint, flags))}; see python finetune.py --help")


def _flag_before(argv: list[str], leftover: list[str]) -> str | None:
    """The --flag the stray values `leftover` came after in `argv` (`--add_tokens def self return`: --add_tokens),
    found where they stand together, the last such place (a value like 1.0 may also be an earlier flag's)."""
    starts = [i for i in range(len(argv) - len(leftover), -1, -1) if argv[i:i + len(leftover)] == leftover]
    flags = [arg for arg in argv[:starts[0]] if arg.startswith("--")] if starts else []
    return flags[-1].split("=", 1)[0] if flags else None


# Flags of HF's Trainer, TRL and axolotl that users bring, with open_sft's way to say the same (difflib's nearest
# name is often another thing: --save_steps → --save_dtype, --deepspeed → --seed).
_DEEPSPEED = ("DeepSpeed is the launcher's: accelerate launch --use_deepspeed --deepspeed_config_file "
              "configs/ds/zero2.json finetune.py ...")
# `deepspeed finetune.py` and `python -m torch.distributed.launch` hand each rank --local_rank (--local-rank)
_LOCAL_RANK = ("passed by the `deepspeed` launcher or torch.distributed.launch; launch with accelerate: accelerate "
               "launch --num_processes N finetune.py ... (for DeepSpeed ZeRO add --use_deepspeed "
               "--deepspeed_config_file configs/ds/zero2.json)")
FOREIGN_FLAGS = {
    "deepspeed": _DEEPSPEED, "zero_stage": _DEEPSPEED, "local_rank": _LOCAL_RANK,
    "save_steps": "use --checkpointing_steps N", "save_strategy": "use --checkpointing_steps N or epoch",
    "save_total_limit": "use --keep_last_n_checkpoints", "max_steps": "use --max_train_steps",
    "bf16": "use --torch_dtype bfloat16 (auto picks it where it is fast)", "fp16": "use --torch_dtype float16",
    "mixed_precision": "use --torch_dtype (bfloat16, float16, float32 or auto)",
    "max_length": "use --max_seq_length", "max_seq_len": "use --max_seq_length", "sequence_len": "use --max_seq_length",
    "micro_batch_size": "use --per_device_train_batch_size", "lr_scheduler": "use --lr_scheduler_type",
    "evaluation_strategy": "use --eval_steps N", "eval_strategy": "use --eval_steps N",
    "lora_r": "use --lora_rank", "lora_target_linear": "use --lora_target_modules all-linear",
    "use_peft": "use --use_lora", "adapter": "use --use_lora or --use_qlora", "load_in_4bit": "use --use_qlora",
    "base_model": "use --model_name_or_path", "padding_free": "--packing is padding-free already",
    "assistant_only_loss": "use --train_on all_assistant (the default)",
    "completion_only_loss": "use --train_on all_assistant (the default) or last_assistant",
    "logging_dir": "tracker logs go under --output_dir (tensorboard/)",
    "lr": "for the learning rate, use --learning_rate",
    "config": "a run config is a YAML file given first: python finetune.py run.yaml --flag value ...",
    "dataset_train_split": "use --dataset_mixer_list_splits: one split per source, e.g. train",
    "dataset_test_split": "use --eval_dataset_mixer_list NAME AMOUNT with --eval_dataset_mixer_list_splits: e.g. test",
}


class _RepeatedKey(Exception):
    """A key a YAML mapping gives twice (`key`, 1-based `lines`)."""

    def __init__(self, key: Any, lines: tuple[int, int]) -> None:
        super().__init__(key, lines)
        self.key, self.lines = key, lines


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML keeps the last of a key given twice in one mapping, without a word: a run config with two
    learning_rate lines trained with the second. A repeated key is refused (a merge key `<<`'s keys may be
    overridden, as YAML means them to be)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in seen:
                    raise _RepeatedKey(key, (seen[key], line))
                seen[key] = line
            except TypeError:  # an unhashable key: SafeLoader's own error names it
                break
        return super().construct_mapping(node, deep=deep)


def _yaml_defaults(path: Path) -> dict[str, Any]:
    try:
        loaded = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: not valid YAML ({exc}); fix the file or pass the settings as flags") from exc
    except _RepeatedKey as repeated:
        first, second = repeated.lines
        raise UserError(f"{path} line {second}: {repeated.key} is given again (first on line {first}); YAML would keep "
                        "the last without a word: keep one") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise UserError(f"{path}: expected a mapping of flag names to values, got {type(loaded).__name__}")
    loaded = {compat.YAML_ALIASES.get(key, key): value for key, value in loaded.items()}
    # open-instruct's dumped arguments write its unset settings as null (max_seq_length, logging_steps, report_to,
    # resume_from_checkpoint): a null is "the default", so the key is left to ours
    loaded = {key: value for key, value in loaded.items() if value is not None}
    known = {f.name for cls in DATACLASSES for f in dataclasses.fields(cls)}
    unknown = sorted(set(loaded) - known)
    if unknown:
        hints = [f"{name} ({FOREIGN_FLAGS[name]})" if name in FOREIGN_FLAGS else f"{name} (did you mean {close[0]}?)"
                 if (close := difflib.get_close_matches(name, known, n=1)) else name for name in unknown]
        raise UserError(f"{path}: unknown setting(s) {', '.join(hints)}; see `python finetune.py --help`")
    if isinstance(loaded.get("report_to"), str):
        loaded["report_to"] = [loaded["report_to"]]
    for key in ("dataset_mixer", "additional_model_arguments"):  # mappings in YAML, JSON strings on the CLI
        if isinstance(loaded.get(key), dict):
            loaded[key] = yaml.safe_dump(loaded[key])
    if isinstance(loaded.get("chat_template_kwargs"), dict):
        loaded["chat_template_kwargs"] = json.dumps(loaded["chat_template_kwargs"])
    for key in ("dataset_mixer_list", "eval_dataset_mixer_list"):  # open-instruct's dataset_mixer form
        if isinstance(loaded.get(key), dict):
            loaded[key] = compat.mapping_pairs(f"{path}: {key}", loaded[key])
    if isinstance(loaded.get("dataset_mixer_list"), list) and any(isinstance(e, dict) for e in loaded["dataset_mixer_list"]):
        loaded.update(_mixer_entries(path, loaded["dataset_mixer_list"]))
    return loaded


def _mixer_entries(path: Path, entries: list) -> dict[str, list[str]]:
    """A YAML dataset_mixer_list whose entries may be mappings {name, amount, chat_template_kwargs} (or NAME,
    AMOUNT items, as on the command line) → the flat NAME AMOUNT list and one JSON object of template variables
    per source (dataset_mixer_list_chat_template_kwargs)."""
    flat, kwargs, pending = [], [], []
    for entry in entries:
        if isinstance(entry, dict):
            unknown = sorted(set(entry) - {"name", "amount", "chat_template_kwargs"})
            if pending or "name" not in entry or "amount" not in entry or unknown:
                raise UserError(f"{path}: dataset_mixer_list entry {entry!r}: give a mapping of name, amount and "
                                "(optionally) chat_template_kwargs, after whole NAME AMOUNT pairs")
            variables = entry.get("chat_template_kwargs") or {}
            if not isinstance(variables, dict):
                raise UserError(f"{path}: dataset_mixer_list entry {entry['name']}: chat_template_kwargs must be a "
                                "mapping of template variables, such as {enable_thinking: false}")
            flat += [str(entry["name"]), str(entry["amount"])]
            kwargs.append(json.dumps(variables))
        else:
            pending.append(str(entry))
            if len(pending) == 2:
                flat += pending
                kwargs.append("{}")
                pending = []
    return {"dataset_mixer_list": flat + pending, "dataset_mixer_list_chat_template_kwargs": kwargs}


def _coerce(parser: _Parser, path: Path, values: dict[str, Any]) -> dict[str, Any]:
    """YAML values as the flag's type would read them: `checkpointing_steps: 1000` is an int to YAML and a
    string to us, and YAML 1.1 reads `learning_rate: 5e-06` (no dot) as a string. A value of the wrong shape (a
    string where the flag takes a list, a list or mapping where it takes one value) is a problem, all of them
    reported at once (a string kept where a list belongs was read character by character: one was '/')."""
    actions: dict[str, argparse.Action] = {}
    for action in parser._actions:  # the flag's own action, not its --no_X negation (no type: nothing converted)
        actions.setdefault(action.dest, action)
    out, problems = {}, []
    for name, value in values.items():
        action = actions.get(name)
        convert = action.type if action is not None and callable(action.type) else None
        ignored = action is not None and (action.help or "").startswith("Ignored")  # open-instruct's, unread
        shape = None if ignored else _shape_problem(name, value, action is not None and action.nargs in ("+", "*"))
        if shape:
            problems.append(f"{path}: {shape}")
            continue
        try:
            if convert is None or value is None or ignored:
                out[name] = value
            elif isinstance(value, list) or (action is not None and action.nargs in ("+", "*")):
                out[name] = [convert(v if convert is not str else str(v)) for v in _as_list(value)]
            else:
                out[name] = convert(str(value) if not isinstance(value, bool) or convert is str else value)
        except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
            problems.append(f"{path}: {name}: {value!r} is not a valid value ({exc})")
    if problems:
        raise ConfigError(problems)
    return out


PAIR_LISTS = ("dataset_mixer_list", "eval_dataset_mixer_list")


def _as_list(value: Any) -> list:
    return value if isinstance(value, list) else [value]


def _shape_problem(name: str, value: Any, takes_list: bool) -> str | None:
    """What is wrong with the shape of YAML `value` for flag `name` (None when nothing): a list flag takes a YAML
    list of plain values (one word may stand alone: `report_to: tensorboard`); any other flag one plain value."""
    if not takes_list:
        if isinstance(value, (list, dict)):
            return (f"{name} takes one value, got a {'list' if isinstance(value, list) else 'mapping'} {value!r}; "
                    f"write it as `{name}: VALUE`")
        return None
    if isinstance(value, list):
        nested = [item for item in value if isinstance(item, (list, dict))]
        return (f"{name}: the item {nested[0]!r} is not a plain value; write a flat list, such as "
                f"`{name}: [a, b]`") if nested else None
    words = str(value).replace(",", " ").split()
    if name in PAIR_LISTS:
        example = ", ".join(f'"{w}"' if _is_number(w) else w for w in words) if len(words) > 1 else 'data.jsonl, "1.0"'
        return (f"{name} is the {type(value).__name__} {value!r}, not a list; write the NAME AMOUNT pairs as a YAML "
                f"list, `{name}: [{example}]`, or as a mapping, `{name}: {{data.jsonl: 1.0}}`")
    if isinstance(value, dict) or len(words) > 1:
        return (f"{name} is the {type(value).__name__} {value!r}, not a list; write a YAML list, "
                f"`{name}: [{', '.join(words) if len(words) > 1 and not isinstance(value, dict) else 'a, b'}]`")
    return None


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


def _split_comma_lists(parser: _Parser, argv: list[str]) -> list[str]:
    """After a YAML config, open-instruct's parser (alignment-handbook's) reads a list flag's `--name=a,b` as the
    list [a, b] (it takes only `--name=value` forms there); argparse would read one value "a,b". Split so, for
    list flags only, so a recipe's `--dataset_mixer_list_splits=train,test` or `--report_to=tensorboard,wandb`
    means what it meant there."""
    out = []
    for arg in argv:
        name, equals, value = arg.partition("=")
        action = parser._option_string_actions.get(name) if equals and name.startswith("--") else None
        if action is not None and action.nargs in ("+", "*") and "," in value:
            out += [name, *value.split(",")]
        else:
            out.append(arg)
    return out


def _given_on_command_line(argv: list[str]) -> set[str]:
    """The fields the command line sets: parsed once more with every default replaced by a marker
    (argparse resolves aliases and `--no_x` forms itself, so this agrees with the real parse)."""
    parser, unset = _make_parser(), object()
    parser.set_defaults(**{action.dest: unset for action in parser._actions if action.dest != "help"})
    namespace, _ = parser.parse_known_args(argv)
    return {name for name, value in vars(namespace).items() if value is not unset}


def parse_config(argv: list[str], check_data_files: bool = False) -> FinetuneConfig:
    """Parse `[config.yaml] --flag value ...` into a validated FinetuneConfig; `check_data_files` (the command
    line's parse) names a local data file that does not exist with the other problems."""
    parser = _make_parser()
    refuse_repeated_lists(parser, argv)
    return _parse(parser, argv, check_data_files)


def _parse(parser: _Parser, argv: list[str], check_data_files: bool = False) -> FinetuneConfig:
    """The parse itself: the YAML config's settings as defaults, the flags over them, validated."""
    explicit: set[str] = set()
    if argv and argv[0].endswith(RUN_CONFIG_SUFFIXES):
        path = Path(argv[0])
        if not path.is_file():
            raise UserError(f"config file {path} does not exist; pass an existing YAML file or only flags")
        defaults = _coerce(parser, path, _yaml_defaults(path))
        parser.set_defaults(**defaults)
        explicit |= set(defaults)
        argv = _split_comma_lists(parser, argv[1:])
    *parsed, leftover = parser.parse_args_into_dataclasses(args=argv, look_for_args_file=False,
                                                           return_remaining_strings=True)
    if leftover:
        raise _unknown_flag_error(parser, leftover, argv)
    model, data, train, lora, checkpoint, hub, open_instruct, oc = parsed
    explicit |= _given_on_command_line(argv)
    config = FinetuneConfig(model=model, data=data, train=train, lora=lora, checkpoint=checkpoint, hub=hub,
                            explicit=frozenset(explicit))
    config, open_instruct, refused = olmo_core.fold(config, oc, open_instruct)
    config = compat.translate(config, open_instruct)
    try:
        validate(config, check_data_files)
    except ConfigError as exc:
        raise ConfigError(refused + exc.problems) from None
    if refused:
        raise ConfigError(refused)
    return dataclasses.replace(config, warnings=config.warnings + tuple(companion_warnings(config)))
