"""Tool schemas for `generate`, `chat` and `compare` (`--tools FILE`): the prompt a tool-calling model answers holds
the tools block its training rows had, rendered by the chat template's own `tools=`.

The file holds the schemas the way training data carries them (open_sft.data.formats.row_tools reads it, as it reads
a row's `tools` column): a list of OpenAI tool objects `{"type": "function", "function": {...}}`, a list of bare
function schemas `{"name", "description", "parameters"}`, or an object with a `tools` (or legacy `functions`) key.
A chat template that writes no tools (the prompt is the same with and without them) is an error, not a prompt
without them: the model would answer a context it never saw (the data side's `tools_not_rendered`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional

from open_sft.errors import UserError

EXPECTED = ('a JSON list of tool schemas ({"type": "function", "function": {"name": ..., "parameters": ...}} or bare '
            '{"name": ..., "parameters": ...}), or an object with a "tools" key holding that list')


def add_tools_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tools", type=Path, default=None, metavar="FILE",
                        help="a JSON file of tool schemas (as a training row's `tools` column): the prompt is rendered "
                             "with them by the chat template, and replies that call a tool are shown as calls")


def read_tools(path: Path) -> list[dict]:
    """The schemas of a --tools file, as the data layer normalises a row's `tools`; a UserError naming the file
    and what it should hold."""
    from open_sft.data.formats import RowError, row_tools

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise UserError(f"--tools {path}: {exc.strerror or exc}; give {EXPECTED}") from None
    except ValueError as exc:
        raise UserError(f"--tools {path}: not JSON ({exc}); give {EXPECTED}") from None
    if isinstance(data, dict) and not ({"tools", "functions"} & set(data)):
        data = [data] if {"name", "function"} & set(data) else None  # one schema alone
    row = data if isinstance(data, dict) else {"tools": data}
    try:
        tools = row_tools(row) if data is not None else None
    except RowError as exc:
        raise UserError(f"--tools {path}: {str(exc).split('; give ')[0]}; give {EXPECTED}") from None
    if not tools:
        raise UserError(f"--tools {path}: holds no tool schemas; give {EXPECTED}")
    for number, tool in enumerate(tools, 1):
        if not isinstance(tool.get("function"), dict) or not isinstance(tool["function"].get("name"), str) or \
                not tool["function"]["name"]:
            raise UserError(f"--tools {path}: tool {number} has no function name ({json.dumps(tool)[:80]}); "
                            f"give {EXPECTED}")
    return tools


def check_written(tokenizer, tools: list[dict], where: str) -> None:
    """A UserError where the chat template cannot render `tools` or writes none of them (its prompt is the same
    without them): the model would be asked without the tools block it was trained with."""
    question = [{"role": "user", "content": "Q"}]
    try:
        with_tools = tokenizer.apply_chat_template(question, tools=tools, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # noqa: BLE001  (a template error is the user's template or schema, said as such)
        from open_sft.data.chat.render import schema_key_hint

        hint = schema_key_hint(str(exc), tools)
        raise UserError(f"{where}: the chat template fails to render the tools ({type(exc).__name__}: {exc}{hint})") \
            from None
    try:
        without = tokenizer.apply_chat_template(question, add_generation_prompt=True, tokenize=False)
    except Exception:  # noqa: BLE001  (llama.cpp's Phi-4-mini template loops over tools=None: it needs them)
        return
    if with_tools == without:
        raise UserError(f"{where}: the chat template does not write tool schemas (its prompt is the same with and "
                        "without them), so the model would be asked without the tools it was trained with; use a "
                        "model whose template writes tools (Qwen3, GLM-4.5, gpt-oss, Llama 3.1, Mistral with "
                        "[AVAILABLE_TOOLS]) or give one with a `tools` block (the run's --chat_template_path)")


def tools_or_exit(path: Optional[Path], tokenizer, where: str) -> tuple[Optional[list[dict]], Optional[str]]:
    """(the schemas of --tools, None) or (None, the error to print); (None, None) without --tools."""
    if path is None:
        return None, None
    try:
        tools = read_tools(path)
        check_written(tokenizer, tools, where)
    except UserError as exc:
        return None, str(exc)
    return tools, None
