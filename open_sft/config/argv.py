"""What the command line's flags resolve to before argparse reads their values: a list flag given twice (argparse
keeps the last list and drops the first without a word) and flags shortened to a prefix (`--lr` is taken as
--lr_scheduler_type, the one flag it begins; an error about that flag then names --lr too)."""

from __future__ import annotations

import argparse
from typing import Optional

from open_sft.errors import ConfigError, UserError


def _action(parser: argparse.ArgumentParser, arg: str) -> tuple[Optional[argparse.Action], str]:
    """The action a `--flag` (or `--flag=value`) argument is read as, and the name as given."""
    name = arg.split("=", 1)[0]
    if name in parser._option_string_actions:
        return parser._option_string_actions[name], name
    matches = parser._get_option_tuples(name) if name.startswith("--") else []
    return (matches[0][0] if len(matches) == 1 else None), name


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
            current.append(arg)
    repeated = {flag: lists for flag, lists in seen.items() if len(lists) > 1}
    if repeated:
        parts = [f"{flag} is given {len(lists)} times ({'; then '.join(' '.join(v) for v in lists)})"
                 for flag, lists in repeated.items()]
        raise UserError(f"{', '.join(parts)}: only the last would count; give each list flag once, with all its "
                        "values after it (e.g. --dataset_mixer_list a.jsonl 0.5 b.jsonl 0.5)")


def abbreviations(parser: argparse.ArgumentParser, argv: list[str]) -> dict[str, str]:
    """Each shortened flag of `argv` and the whole flag argparse reads it as (`--lr` → --lr_scheduler_type)."""
    found = {}
    for arg in argv:
        if arg.startswith("--"):
            action, name = _action(parser, arg)
            if action is not None and name not in action.option_strings:
                found[name] = next(o for o in action.option_strings if o.startswith("--"))
    return found


def explain_abbreviations(error: UserError, shortened: dict[str, str], hints: dict[str, str]) -> UserError:
    """`error` with each problem that names a flag given shortened saying so (`--lr_scheduler_type '1e-4' is not
    one of ...` did not say that it came from --lr), and what the short name means elsewhere (`hints`, by name
    without dashes: lr → use --learning_rate)."""
    def explained(text: str) -> str:
        notes = [f"{given} was read as {whole}: a flag may be shortened to a prefix of one flag only; write the whole "
                 f"name{'; ' + hints[given[2:]] if given[2:] in hints else ''}"
                 for given, whole in shortened.items() if whole in text]
        return f"{text} ({'; '.join(notes)})" if notes else text

    if isinstance(error, ConfigError):
        return ConfigError([explained(problem) for problem in error.problems])
    return UserError(explained(str(error)))
