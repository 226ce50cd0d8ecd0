"""What the command line's flags resolve to before argparse reads their values: a list flag given twice (argparse
keeps the last list and drops the first without a word)."""

from __future__ import annotations

import argparse
from typing import Optional

from open_sft.errors import UserError


RUN_CONFIG_SUFFIXES = (".yaml", ".yml")


def late_run_config(path: str, which: str) -> str:
    """What to say of the run config `path` found where no run config is read (`which`: where it was)."""
    return (f"{path}: a run config is read only as the first argument (python finetune.py run.yaml --flag value "
            f"...), and this is {which}; give it first, and one only (merge the settings of two into one file, or "
            "pass them as flags)")


def _action(parser: argparse.ArgumentParser, arg: str) -> tuple[Optional[argparse.Action], str]:
    """The action a `--flag` (or `--flag=value`) argument is read as (flags are read whole), and the name as given."""
    name = arg.split("=", 1)[0]
    return parser._option_string_actions.get(name), name


def refuse_repeated_lists(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """A list flag given more than once is refused naming each list: open-instruct's parser (argparse, nargs='+')
    keeps the last one, so `--dataset_mixer_list a 0.5 --dataset_mixer_list b 0.5` trained on b alone; combining
    them would train what open-instruct does not, on the same command line. One flag holds the whole list."""
    seen: dict[str, list[list[str]]] = {}
    current: Optional[list[str]] = None
    for arg in argv:
        if arg.startswith("--"):
            action, name = _action(parser, arg)
            current = None
            if action is not None and action.nargs in ("+", "*"):
                current = [arg.split("=", 1)[1]] if "=" in arg else []
                seen.setdefault(action.option_strings[0], []).append(current)
        elif current is not None:
            if arg.endswith(RUN_CONFIG_SUFFIXES):  # argparse would take it as one of the list's values
                raise UserError(late_run_config(arg, f"one given after a flag: it was read as a value of {name}"))
            current.append(arg)
    repeated = {flag: lists for flag, lists in seen.items() if len(lists) > 1}
    if repeated:
        parts = [f"{flag} is given {len(lists)} times ({'; then '.join(' '.join(v) for v in lists)})"
                 for flag, lists in repeated.items()]
        raise UserError(f"{', '.join(parts)}: only the last would count; give each list flag once, with all its "
                        "values after it (e.g. --dataset_mixer_list a.jsonl 0.5 b.jsonl 0.5)")
