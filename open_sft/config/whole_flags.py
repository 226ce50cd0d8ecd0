"""Every command line of open_sft reads its flags whole, never as a prefix of another (argparse's allow_abbrev).

A prefix that named one flag would name another, or none, once a flag is added (the OLMo-core flags made finetune's
--config and --loss ambiguous; `--lr 1e-4` was read as --lr_scheduler_type), and the same prefix meant different
flags in different tools (`--model`). Each command line's parser is a `WholeFlagParser`: a `--flag` it does not have
is refused before argparse reads the arguments (so before it complains of a missing required one, or takes the
value after the unknown flag for a positional), all of them in one error that names the flags a prefix begins (or
the nearest flag), as finetune.py, the `open_sft <command>` tools and the user-facing scripts/ say alike. What a
command does with its arguments comes after; finetune.py reads its run YAML and refuses a repeated list flag first.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from typing import Optional, Sequence


def flags_beginning(parser: argparse.ArgumentParser, prefix: str) -> list[str]:
    """The flags `prefix` begins, one name each (a flag's spellings --learning_rate, --learning-rate are one),
    those --help shows: what a flag given shortened may have meant."""
    return [next(name for name in action.option_strings if name.startswith("--"))
            for action in parser._actions if action.help != argparse.SUPPRESS
            and any(name.startswith(prefix) for name in action.option_strings if name.startswith("--"))]


def flag_hint(parser: argparse.ArgumentParser, flag: str, hint: Optional[str] = None) -> str:
    """`flag`, unknown to `parser`, with what it may have meant: the flags it begins (given shortened), after
    `hint` (the caller's own word for it) when there is one, else the nearest flag's name."""
    whole = flags_beginning(parser, flag) if flag.startswith("--") and len(flag) > 3 else []
    if whole:
        meant = " or ".join(whole[:6]) + (f" (or {len(whole) - 6} more)" if len(whole) > 6 else "")
        hint = f"{hint + '; ' if hint else ''}flags are not shortened: did you mean {meant}?"
    elif hint is None:
        names = [name for action in parser._actions for name in action.option_strings if name.startswith("--")]
        close = difflib.get_close_matches(flag, names, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}?" if close else None
    return f"{flag} ({hint})" if hint else flag


def unknown_flags(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """The `--flag` (or `--flag=value`) arguments of `argv` that argparse reads as flags and `parser` does not
    have: up to `--` (what follows is positional) or a sub-command's name (its flags are its parser's)."""
    commands = {name for action in parser._actions if isinstance(action, argparse._SubParsersAction)
                for name in action.choices}
    unknown = []
    for arg in argv:
        if arg == "--" or arg in commands:
            break
        name = arg.split("=", 1)[0]
        if arg.startswith("--") and " " not in name and name not in parser._option_string_actions:
            unknown.append(name)  # a word with a space is a value (`--prompt "--a b"`), not --flag="a b"
    return unknown


class WholeFlagParser(argparse.ArgumentParser):
    """An ArgumentParser whose flags are read whole: an unknown flag, a shortened one included, is one error
    naming each (with `flag_hint`) before any value is read; argparse alone would first complain of a missing
    required argument, or read the value after an unknown flag as a positional one."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, "allow_abbrev": False})

    def flag_hint(self, flag: str) -> str:
        """`flag` as the unknown-flag error names it (a parser may add its own word for flags users bring)."""
        return flag_hint(self, flag)

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        unknown = unknown_flags(self, args)
        if unknown:
            self.error(f"unknown flag {', '.join(self.flag_hint(flag) for flag in unknown)}")
        return super().parse_known_args(args, namespace)
