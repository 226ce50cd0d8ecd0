"""Score two models on the same held-out tasks and show their answers side by side (`open_sft compare`).

    open_sft compare BEFORE_DIR AFTER_DIR --tasks held_out.jsonl

BEFORE_DIR is typically the base model and AFTER_DIR the run's --output_dir (anything `open_sft generate`
loads). Each task is a row of a JSON-lines file in the bundled sample's format: `messages` whose last message
is the assistant's expected reply, and `answer`, that reply; a row's own `tools` (as training reads them, else
--tools FILE's) are rendered in its prompt, and an expected reply that calls tools (`tool_calls`) is scored by
its calls: a hit when the reply calls the same tools with the same arguments as JSON values (open_sft.export.
tool_calls), whatever text comes with them. Each model answers the messages before the last
(greedy, with its own chat template) and scores a hit when its reply equals `answer` exactly, up to runs of
whitespace (:func:`exact_match`): no partial credit, case and punctuation count. A reasoning model's reply is
scored by its answer alone, the reasoning its template writes before it set aside (Qwen3's and GLM's think block,
gpt-oss's analysis channel: open_sft.export.reply), and such a model gets room for its reasoning
(REASONING_MAX_NEW_TOKENS unless --max_new_tokens says otherwise); a reply cut off inside its reasoning, before
any answer, scores a miss and is counted apart, with the fix.

A model without a chat template (a base model, or one trained on plain text) is asked with the other model's
template, so that both answer the same prompts and only the weights differ (a base model fine-tuned with
--chat_template_name against its fine-tune); where neither has one, each task's prompt is continued as plain text,
its messages' contents one per line, as `open_sft generate --raw` continues a prompt. Either is said on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from open_sft.config.whole_flags import WholeFlagParser
from open_sft.export.compare_tools import checked_tools
from open_sft.export.template_kwargs import add_template_kwargs_argument, template_kwargs_or_exit
from open_sft.export.tool_calls import scores_calls
from open_sft.export.tool_schemas import add_tools_argument
from open_sft.file_modes import output_file_problem

CELL = 26  # characters of a table cell; longer answers end in "…"
MAX_NEW_TOKENS, REASONING_MAX_NEW_TOKENS = 16, 256  # a reasoning template's answer follows its trace
CALL_MAX_NEW_TOKENS = 128  # a call's markup, name and JSON arguments: more than a short answer
CUT = "(stopped in its reasoning)"  # no answer came
NO_ANSWER_NEEDED = "or no 'answer' where that reply has 'tool_calls': an expected call is scored by its calls"
UNREADABLE = "(unreadable)"  # before a call written that does not read as one (cut off, not JSON), as written


def exact_match(expected: str, generated: str) -> bool:
    """True when `generated` equals `expected` word for word (whitespace runs aside; case and punctuation count)."""
    return generated.split() == expected.split()


@dataclass
class TaskScore:
    """One model's replies to a list of tasks and whether each is exactly the expected answer; `reasoning`: the
    trace set aside before each answer (None: the reply had no reasoning part), `cut`: whether the reply stopped
    inside its reasoning, before an answer, and `limited` whether --max_new_tokens stopped it."""

    answers: list[str]
    correct: list[bool]
    reasoning: list[str | None] = field(default_factory=list)
    cut: list[bool] = field(default_factory=list)
    limited: list[bool] = field(default_factory=list)
    unreadable: list[str | None] = field(default_factory=list)  # a call written that does not read, as written
    calls: list[list[dict]] = field(default_factory=list)  # each reply's calls, {name, arguments}

    @property
    def hits(self) -> int:
        return sum(self.correct)

    @property
    def accuracy(self) -> float:
        """Share of tasks answered exactly (0.0 for no tasks)."""
        return self.hits / len(self.correct) if self.correct else 0.0


def score_tasks(model, tokenizer, rows: list[dict], max_new_tokens: int | list[int] = MAX_NEW_TOKENS,
                raw: bool = False, tools: list[dict] | None = None) -> TaskScore:
    """Greedy replies of `model` to each row's messages but the last (with the row's own `tools`, else `tools`, in
    the prompt; `max_new_tokens` one limit, or each row's), their answers (a reasoning model's without its
    reasoning) scored with exact_match against `answer`, an expected tool call by its name and arguments
    (tool_calls.same_calls); `raw`: to those messages' contents, one per line, continued as plain text."""
    from open_sft.export.generate import TOKEN_LIMIT, generate_reply
    from open_sft.export.tool_calls import task_tools, was_right

    limits = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(rows)
    replies = [generate_reply(model, tokenizer, _plain(row["messages"][:-1]) if raw else row["messages"][:-1],
                              limit, raw=raw, tools=None if raw else task_tools(row) or tools)
               for row, limit in zip(rows, limits)]
    return TaskScore([_shown(reply) for reply in replies],
                     [was_right(row, reply, exact_match) for row, reply in zip(rows, replies)],
                     [reply.reasoning for reply in replies], [not reply.answered for reply in replies],
                     [reply.stop_reason == TOKEN_LIMIT for reply in replies],
                     [reply.unreadable_call for reply in replies],
                     [list(reply.tool_calls) for reply in replies])


def _shown(reply) -> str:
    """A reply as the table (shortened) and --json show it: its text, its calls (`get_weather {"city": "Oslo"}`), a
    call that does not read as written after UNREADABLE (its words, not a bare label)."""
    from open_sft.export.tool_calls import call_text

    shown = [reply.text] * bool(reply.text) + [call_text(call) for call in reply.tool_calls]
    return " ".join(shown + [f"{UNREADABLE} {reply.unreadable_call}"] * (reply.unreadable_call is not None))


def reasoning_lines(name: str, score: TaskScore, max_new_tokens: int) -> list[str]:
    """What the scores do not show: how many replies had their reasoning set aside, and how many were cut off
    inside it (scored as misses, not as wrong answers)."""
    n, lines = len(score.correct), []
    set_aside = sum(reasoning is not None for reasoning in score.reasoning)
    if set_aside:
        lines.append(f"{name}: {set_aside} of {n} replies began with the reasoning their chat template writes (a think "
                     "block, an analysis channel): it was set aside and the answer after it scored")
    if cut := sum(score.cut):
        limited = sum(c and limit for c, limit in zip(score.cut, score.limited))
        lines.append(f"{name}: {cut} of {n} replies stopped inside their reasoning, before any answer (scored as "
                     "misses)" + (f"; {limited} of them cut off at --max_new_tokens {max_new_tokens}: raise it"
                                   if limited else ""))
    if unreadable := sum(call is not None for call in score.unreadable):
        lines.append(f"{name}: {unreadable} of {n} replies wrote an unreadable tool call (cut off, not JSON, arguments "
                     "not an object: scored as misses)")
    return lines


def calls_lines(rows: list[dict]) -> list[str]:
    """How many tasks were scored by their tool calls, and how, when any."""
    if not (calls := sum(map(scores_calls, rows))):
        return []
    return [f"{calls} of {len(rows)} tasks expect a tool call: scored by the call (the same tool names and the same "
            "arguments as JSON values, key order and spacing aside), not by its text"]


def _plain(messages: list[dict]) -> list[dict]:
    return [{"role": "user", "content": "\n".join(str(m.get("content") or "") for m in messages)}]


def prompt_formats(directories: tuple[Path, Path], templates: tuple[str | None, str | None]) -> list[str | None]:
    """The chat template each model is asked with: its own; the other's where it has none (both then answer the same
    prompts); None (plain text) where neither has one. Each borrowing or plain continuation is said on stderr."""
    if not any(templates):
        print("neither model has a chat template: each task's prompt is continued as plain text (its messages' "
              "contents, one per line), as `open_sft generate --raw` does", file=sys.stderr, flush=True)
        return [None, None]
    formats = []
    for i, (directory, template) in enumerate(zip(directories, templates)):
        if not template:
            other = directories[1 - i]
            print(f"{directory}: its tokenizer has no chat template: it is asked with {other}'s, so that both models "
                  "answer the same prompts", file=sys.stderr, flush=True)
        formats.append(template or templates[1 - i])
    return formats


class Tasks(list):
    """A tasks file's rows, with the line each was read from (`lines`, for messages about a row). A list, so it goes
    wherever rows go; slices and copies are plain lists."""

    lines: list[int]


def read_tasks(path: Path) -> Tasks:
    """The rows of a tasks file; a ValueError naming the file and line of the first row that is not a task."""
    rows = Tasks()
    rows.lines = []
    with path.open(encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{path} line {number}: not JSON ({exc}); each line is one task") from None
            messages = row.get("messages") if isinstance(row, dict) else None
            if (not isinstance(messages, list) or len(messages) < 2 or not isinstance(messages[-1], dict)
                    or messages[-1].get("role") != "assistant"):
                raise ValueError(f"{path} line {number}: a task needs 'messages' ending with the assistant's "
                                 f"reply and 'answer', that reply ({NO_ANSWER_NEEDED})")
            rows.append(_task(row, f"{path} line {number}"))
            rows.lines.append(number)
    if not rows:
        raise ValueError(f"{path} holds no tasks")
    return rows


def _task(row: dict, where: str) -> dict:
    """A task row checked: its `answer` (a reply that calls tools is scored by its calls: the answer is optional,
    shown as the calls), its `tools` readable as training reads them."""
    from open_sft.data.formats import RowError
    from open_sft.export.tool_calls import call_text, expected_calls, scores_calls, task_tools

    try:
        task_tools(row)
    except RowError as exc:
        raise ValueError(f"{where}: {exc}") from None
    if scores_calls(row) and not isinstance(row.get("answer"), str):
        row = {**row, "answer": " ".join(call_text(call) for call in expected_calls(row["messages"][-1]))}
    if not isinstance(row.get("answer"), str):
        raise ValueError(f"{where}: a task needs 'messages' ending with the assistant's reply and 'answer', that "
                         f"reply ({NO_ANSWER_NEEDED})")
    return row


EXPECTED_CELL = 60  # the expected answer's column, last: wider than the answers', still one line


def _cell(text: str, width: int = CELL) -> str:
    flat = " ".join(text.split()) or "(nothing)"
    return flat if len(flat) <= width else flat[:width - 1] + "…"


def format_table(rows: list[dict], before: TaskScore, after: TaskScore, show: int) -> str:
    """The first `show` tasks: the prompt, each model's answer marked ✓ (exact) or ✗, and the expected answer."""
    prompt_width = max(len(_cell(row["messages"][-2]["content"], 48)) for row in rows[:show] or rows)
    lines = [f"{'held-out task (never in training)':<{prompt_width}}  {'before fine-tuning':<{CELL + 2}}  "
             f"{'after fine-tuning':<{CELL + 2}}  expected"]
    for i, row in enumerate(rows[:show]):
        marks = ["✓" if score.correct[i] else "✗" for score in (before, after)]
        cells = [_cell(CUT if score.cut and score.cut[i] else score.answers[i]) for score in (before, after)]
        lines.append(f"{_cell(row['messages'][-2]['content'], 48):<{prompt_width}}  "
                     f"{marks[0]} {cells[0]:<{CELL}}  {marks[1]} {cells[1]:<{CELL}}  "
                     f"{_cell(row['answer'], EXPECTED_CELL)}")  # one line: a multi-line answer broke the table
    return "\n".join(lines)


def accuracy_line(before: TaskScore, after: TaskScore) -> str:
    """`exact-answer accuracy on N held-out tasks: before 0.00 (0/N) -> after 0.95 (38/N)`."""
    n = len(before.correct)
    return (f"exact-answer accuracy on {n} held-out tasks: before {before.accuracy:.2f} ({before.hits}/{n}) -> "
            f"after {after.accuracy:.2f} ({after.hits}/{n})")


def write_scores(path: Path, rows: list[dict], dirs: tuple[Path, Path], before: TaskScore, after: TaskScore) -> None:
    """Every task with both answers and both accuracies, as one JSON document."""
    tasks = [{"id": row.get("id"), "task": row.get("task"), "prompt": row["messages"][-2]["content"],
              "expected": row["answer"], "before": b, "after": a, "before_correct": bc, "after_correct": ac,
              **{f"{name}_reasoning": score.reasoning[i] for name, score in (("before", before), ("after", after))
                 if score.reasoning and score.reasoning[i] is not None},
              **_calls_fields(row, i, before, after)}
             for i, (row, b, a, bc, ac) in enumerate(zip(rows, before.answers, after.answers, before.correct,
                                                          after.correct))]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"tasks": len(rows), "before": {"model": str(dirs[0]), "accuracy": before.accuracy},
                                "after": {"model": str(dirs[1]), "accuracy": after.accuracy}, "rows": tasks},
                               indent=1) + "\n")


def _calls_fields(row: dict, i: int, before: TaskScore, after: TaskScore) -> dict:
    """A task's calls in --json, structured beside the display strings: `expected_tool_calls` and each model's
    `before_tool_calls`/`after_tool_calls` ({name, arguments}), where the task expects a call or a reply made one,
    and `before_unreadable_call`/`after_unreadable_call`: a call written that does not read, whole as written."""
    from open_sft.export.tool_calls import expected_calls

    fields = {"expected_tool_calls": expected_calls(row["messages"][-1])} if scores_calls(row) else {}
    for name, score in (("before", before), ("after", after)):
        if (score.calls and score.calls[i]) or fields:
            fields[f"{name}_tool_calls"] = score.calls[i] if score.calls else []
        if score.unreadable and score.unreadable[i] is not None:
            fields[f"{name}_unreadable_call"] = score.unreadable[i]
    return fields


def _load(directory: Path, kwargs: dict, tokenizer_only: bool = False):
    """(model, tokenizer) of a model directory or a run's output (`tokenizer_only`: its tokenizer), its template
    rendering with the chat template variables `kwargs`, or None after printing the error."""
    from open_sft.errors import UserError
    from open_sft.export.run_dir import load_run_model, load_saved_tokenizer, model_kind
    from open_sft.export.template_kwargs import bind_template_kwargs

    try:
        if tokenizer_only:
            model_kind(directory)  # a directory with no model is named as such, before its tokenizer is looked for
            return bind_template_kwargs(load_saved_tokenizer(directory), kwargs)
        loaded = load_run_model(directory)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None
    return loaded.model, bind_template_kwargs(loaded.tokenizer, kwargs)


def default_limits(directory: Path, tokenizer, template: str | None, rows: list[dict]) -> list[int]:
    """Each task's new tokens without --max_new_tokens: MAX_NEW_TOKENS, CALL_MAX_NEW_TOKENS for a task that expects
    a tool call, or REASONING_MAX_NEW_TOKENS for every task under a template that writes reasoning before the answer
    (said on stderr): MAX_NEW_TOKENS ends most reasoning replies inside their trace, and most calls inside their
    arguments."""
    from open_sft.export.trace_layout import writes_reasoning

    if not writes_reasoning(template, tokenizer):
        return [CALL_MAX_NEW_TOKENS if scores_calls(row) else MAX_NEW_TOKENS for row in rows]
    print(f"{directory}: its chat template writes reasoning before the answer: each reply may have "
          f"{REASONING_MAX_NEW_TOKENS} new tokens (--max_new_tokens)", file=sys.stderr, flush=True)
    return [REASONING_MAX_NEW_TOKENS] * len(rows)


def _parser(prog: str) -> WholeFlagParser:
    parser = WholeFlagParser(prog=prog, description=__doc__,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before", type=Path, help="the model before fine-tuning (a model directory)")
    parser.add_argument("after", type=Path, help="the model after: a run's --output_dir (or its merged/)")
    parser.add_argument("--tasks", type=Path, required=True, help="JSON-lines tasks (messages + answer)")
    parser.add_argument("--show", type=int, default=12, help="tasks shown in the table (all are scored)")
    parser.add_argument("--max_new_tokens", type=int, default=None,
                        help=f"the most tokens of one reply (default {MAX_NEW_TOKENS}, {CALL_MAX_NEW_TOKENS} where a "
                             f"task expects a tool call; {REASONING_MAX_NEW_TOKENS} "
                             "for a model whose chat template writes reasoning before the answer)")
    parser.add_argument("--json", type=Path, default=None, help="also write every answer and score here")
    add_tools_argument(parser)
    add_template_kwargs_argument(parser)
    return parser


def main(argv: list[str] | None = None, prog: str = "open_sft compare") -> int:
    parser = _parser(prog)
    args = parser.parse_args(argv)
    if (args.max_new_tokens is not None and args.max_new_tokens < 1) or args.show < 0:
        parser.error("--max_new_tokens must be at least 1 and --show at least 0")
    why = output_file_problem(args.json) if args.json is not None else None
    if why:  # said before the models load and score, not after
        print(f"error: --json {args.json}: {why}", file=sys.stderr)
        return 2
    kwargs = template_kwargs_or_exit(args, (args.after, args.before))  # the run's: both answer the same prompts
    if kwargs is None:
        return 2
    try:
        rows = read_tasks(args.tasks)
    except OSError as exc:
        print(f"error: --tasks {args.tasks}: {exc.strerror or exc}; give a JSON-lines file of held-out tasks "
              "(each line 'messages' ending with the assistant's reply, and 'answer')", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"error: --tasks {exc}", file=sys.stderr)
        return 2
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    directories = (args.before, args.after)
    tokenizers = [_load(directory, kwargs, tokenizer_only=True) for directory in directories]  # models one at a time
    if None in tokenizers:
        return 2
    formats = prompt_formats(directories, tuple(tokenizer.chat_template for tokenizer in tokenizers))
    tools, problem = checked_tools(args, rows, directories, tokenizers, formats)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    scores, notes = [], []
    for name, directory, template in zip(("before", "after"), directories, formats):
        loaded = _load(directory, kwargs)
        if loaded is None:
            return 2
        model, tokenizer = loaded
        if template is not None:
            tokenizer.chat_template = template
        limits = [args.max_new_tokens] * len(rows) if args.max_new_tokens else \
            default_limits(directory, tokenizer, template, rows)  # a task that expects a call gets room for it
        scores.append(score_tasks(model, tokenizer, rows, limits, raw=template is None, tools=tools))
        notes += reasoning_lines(f"{name} ({directory})", scores[-1], max(limits))
    print(format_table(rows, *scores, args.show))
    print(accuracy_line(*scores), flush=True)
    print("".join(f"{note}\n" for note in calls_lines(rows) + notes), end="", flush=True)
    if args.json is not None:
        write_scores(args.json, rows, (args.before, args.after), *scores)
    return 0


if __name__ == "__main__":
    sys.exit(main())
