"""The tool schemas `open_sft compare` renders in its prompts (--tools FILE's, and a task row's own `tools`), checked
against the chat template each model is asked with before either model loads: a template that writes no tools, or
fails on them, is an error naming the file (and line) and the model, as `generate --tools` says it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from open_sft.export.compare import Tasks


def checked_tools(args: argparse.Namespace, rows: Tasks, directories, tokenizers, formats) -> tuple[
        list[dict] | None, str | None]:
    """(--tools's schemas, None), or (None, why they or a task row's own tools cannot be used), checked against the
    template each model is asked with. A model asked with the other's template (it has none) is named so: a
    template that fails on its tokenizer (a `bos_token` it lacks) is then said to be the other model's."""
    names = [str(directory) if tokenizer.chat_template else f"{directory}, asked with {directories[1 - i]}'s chat "
             "template: it has none" for i, (directory, tokenizer) in enumerate(zip(directories, tokenizers))]
    tools, problem = _tools_for_both(args.tools, names, tokenizers, formats)
    return tools, problem or row_tools_problem(args.tasks, rows, names, tokenizers, formats)


def _tools_for_both(path: Path | None, directories, tokenizers, formats) -> tuple[list[dict] | None, str | None]:
    """(--tools's schemas, None), checked against the template each model is asked with before either model
    loads, or (None, why they cannot be used)."""
    from open_sft.errors import UserError
    from open_sft.export.tool_schemas import read_tools

    if path is None:
        return None, None
    if not any(formats):
        return None, f"--tools {path}: neither model has a chat template to write them"
    try:
        tools = read_tools(path)
    except UserError as exc:
        return None, str(exc)
    problem = _unwritten(tools, f"--tools {path}", directories, tokenizers, formats)
    return (None, problem) if problem else (tools, None)


def _unwritten(tools: list, where: str, directories, tokenizers, formats) -> str | None:
    """Why a model's template (each as it is asked with) cannot write `tools`, naming `where` and the model; None
    when both can."""
    from open_sft.errors import UserError
    from open_sft.export.tool_schemas import check_written

    for directory, tokenizer, template in zip(directories, tokenizers, formats):
        tokenizer.chat_template = template
        try:
            check_written(tokenizer, tools, f"{where} ({directory})")
        except UserError as exc:
            return str(exc)
    return None


def row_tools_problem(path: Path, rows: Tasks, directories, tokenizers, formats) -> str | None:
    """Why a task row's own `tools` cannot be rendered in its prompt (a template that writes no tools or fails on
    them, no template at all), naming the tasks file and the row's line, as --tools FILE's are checked; None when
    they can."""
    from open_sft.export.tool_calls import task_tools

    seen = set()
    for number, row in zip(rows.lines, rows):
        if not (tools := task_tools(row)) or json.dumps(tools, sort_keys=True) in seen:
            continue
        seen.add(json.dumps(tools, sort_keys=True))
        if not any(formats):
            return f"--tasks {path} line {number}: the row's tools need a chat template to write them, and neither " \
                   "model has one"
        if problem := _unwritten(tools, f"--tasks {path} line {number}: the row's tools", directories, tokenizers,
                                 formats):
            return problem
    return None
