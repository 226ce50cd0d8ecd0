"""The data report: what happened to each source's rows (SourceReport), its table, and examples with trained tokens
marked."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
import logging
from typing import Any, Optional

import numpy as np

from open_sft.data.chat.examples import RENDER_NOTES
from open_sft.data.chat.render import FOUND_NOTE
from open_sft.data.labels import IGNORE_INDEX
from open_sft.data.mixer import source_names

logger = logging.getLogger(__name__)
BOLD_GREEN, RESET = "\033[1;32m", "\033[0m"


_NOTES = {
    "reasoning_not_rendered": "carry reasoning (reasoning_content, thinking or reasoning, or <think>…</think> in "
                              "the content) that the chat template "
                              "does not write, so it is not trained; choose a template that writes it: the model's "
                              "own where it does, else --chat_template_path FILE",
    "generation_tags_disagree": "are labelled otherwise than the chat template's {% generation %} tags mark (the "
                                "labels are each assistant turn as the template writes it after its generation "
                                "prompt; check the tags, or the template)",
    "reasoning_history_not_kept": "could not be made one example under --reasoning_history keep (where an earlier "
                                  "turn ends in the template's history was not found) and make the template's "
                                  "examples instead",
    "tools_not_rendered": "have tool schemas (a tools column) that the chat template does not write, so they train "
                          "without them in the context; choose a template that writes tools (the model's own, or "
                          "--chat_template_path FILE)",
    "tool_arguments_not_json": "have tool calls whose arguments are a string that is not a JSON object (a Python "
                               "dict's repr, cut-off JSON), trained as written, so the model learns to call tools "
                               "so; fix the arguments, or drop the rows",
    "reasoning_closed_by_prompt": "carry reasoning on turns whose generation prompt already closes an empty think "
                                  "block (--chat_template_kwargs '{\"enable_thinking\": false}'), so the model "
                                  "generates no reasoning there: those turns train their answer after that block, "
                                  "without the reasoning; to train it, leave enable_thinking false out for this "
                                  "source (a source's own chat_template_kwargs)",
    "turns_in_one_rendering": "have assistant turns the chat template does not write after their own context (under "
                              "Mistral v0.3's template, a turn answering an empty user message, which the system "
                              "prompt then precedes), trained where the whole conversation's rendering writes them, "
                              "as open-instruct trains them: the model sees them there without what the template "
                              "gives a generated turn (Mistral's system prompt); fill or drop the empty user turns",
    "reasoning_tags_as_text": "carry a trace written in the content (<think>…</think>) that the chat template writes "
                              "as the answer's text, tags and all, where it writes reasoning its own way (gpt-oss's "
                              "analysis channel), so the model learns to write think tags in its answer; give the "
                              "trace as reasoning_content (or thinking) and the answer alone as the content",
    "tools_listed_twice": "list their tool schemas in a system message (Hermes-style rows: <tools>…</tools>) and in a "
                          "tools column too, which the chat template writes again, so the context shows every tool "
                          "twice, as the model never sees it at inference; drop the tools column (or the list in "
                          "the system message)",
    "tool_results_wrapped_twice": "have tool results that carry their own tags (<tool_response>…</tool_response>, as "
                                  "Hermes-style rows give them) which the chat template writes around every tool "
                                  "result again, so the context doubles them, as the model never sees it at "
                                  "inference; remove those tags from the tool messages' content",
    "reasoning_opened_by_prompt": "have assistant turns whose generation prompt opens a think block (<think>), or "
                                  "the trace with words (Apriel-1.6's 'Here are my reasoning steps:'), that the chat "
                                  "template leaves out of what it writes for the turn (DeepSeek-R1 distills', QwQ's): "
                                  "each trains what the model writes there, its trace (an empty one where the row has "
                                  "none), its closer (</think>), the answer and the end of the turn, after "
                                  "that prompt; the earlier turns stay in its context as the template writes history "
                                  "(without their traces), as the model sees them at inference",
    "reasoning_block_filled": "have assistant turns whose trace the chat template leaves out of the think block it "
                              "writes for them as the last message, though it writes other turns' traces there "
                              "(Kimi-K2-Thinking's final answers, <think></think>answer): each trains its trace in "
                              "that block (<think>trace</think>answer), as the model writes it at inference",
    "content_not_rendered": "have tool-call turns whose content (the text beside the calls) the chat template does "
                            "not write (Hermes 2 Pro's and 3's, Mistral's write the calls alone), so that text is not "
                            "trained: the model learns the calls alone, as its template writes them; to train it, "
                            "choose a template that writes it (--chat_template_path FILE)",
    "special_tokens_in_text": "hold the literal text of a special token ({found}), which "
                              "the tokenizer encodes as that control token, so the model learns a fake end of turn or "
                              "of document there; remove or rewrite that text in the data",
}


@dataclass
class SourceReport:
    name: str
    format: str
    rows_in: int
    rows_selected: int = 0
    rows_kept: int = 0
    dropped: Counter = field(default_factory=Counter)
    truncated: int = 0
    tokens: int = 0
    trained_tokens: int = 0
    examples: int = 0  # training examples made (text sources: blocks)
    upsample_factor: float = 1.0  # times each selected row is taken, on average (> 1: the amount upsamples)
    # conversations a template that rewrites earlier turns made into several examples (chat/turn_render.py),
    # and the tokens their earlier examples add (the context they repeat)
    rows_split: int = 0
    split_extra_tokens: int = 0
    reasoning_not_rendered: int = 0  # rows whose reasoning the template does not write (chat/reasoning.py)
    generation_tags_disagree: int = 0  # rows whose labels are not what the template's {% generation %} marks
    reasoning_history_not_kept: int = 0  # --reasoning_history keep rows left as the template's examples
    tools_not_rendered: int = 0  # rows whose tool schemas the template does not write
    tool_arguments_not_json: int = 0  # rows with a tool call whose arguments are not a JSON object
    special_tokens_in_text: int = 0  # rows (documents) holding a special token's literal text
    special_tokens_in_text_by_token: Counter = field(default_factory=Counter)  # token → the rows holding its text
    reasoning_closed_by_prompt: int = 0  # rows with reasoning on a turn whose generation prompt closes it empty
    turns_in_one_rendering: int = 0  # rows with a turn trained in the one rendering (chat/examples._partly_per_turn)
    reasoning_tags_as_text: int = 0  # rows whose inline <think> trace a tagless template writes as the answer's text
    tool_results_wrapped_twice: int = 0  # rows with a tool result whose own tags the template writes around it again
    reasoning_opened_by_prompt: int = 0  # rows with a turn trained after a think block its prompt opens
    reasoning_block_filled: int = 0  # rows with a turn's trace trained in a think block its template writes empty
    tools_listed_twice: int = 0  # rows whose tools a system message lists and the template writes again
    content_not_rendered: int = 0  # rows with a call turn whose content the template leaves out
    row_template_kwargs: int = 0  # rows rendered with their own chat_template_kwargs (smoltalk2's): no warning
    tool_types_mapped: int = 0  # rows whose tool schemas' Python type names were read as JSON Schema's (xLAM's)
    hub_dataset: bool = False  # read from the Hub by its id (not a local file or directory): the card names it

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "format": self.format, "rows_in": self.rows_in,
            "rows_selected": self.rows_selected, "rows_kept": self.rows_kept,
            "rows_dropped": dict(self.dropped), "truncated": self.truncated,
            "examples": self.examples, "tokens": self.tokens, "trained_tokens": self.trained_tokens,
            "upsample_factor": self.upsample_factor, "rows_split": self.rows_split,
            "split_extra_tokens": self.split_extra_tokens, "reasoning_not_rendered": self.reasoning_not_rendered,
            "generation_tags_disagree": self.generation_tags_disagree,
            "reasoning_history_not_kept": self.reasoning_history_not_kept,
            "tools_not_rendered": self.tools_not_rendered,
            "tool_arguments_not_json": self.tool_arguments_not_json,
            "special_tokens_in_text": self.special_tokens_in_text,
            "special_tokens_in_text_by_token": dict(commonest(self.special_tokens_in_text_by_token)),
            "reasoning_closed_by_prompt": self.reasoning_closed_by_prompt,
            "turns_in_one_rendering": self.turns_in_one_rendering,
            "reasoning_tags_as_text": self.reasoning_tags_as_text,
            "tool_results_wrapped_twice": self.tool_results_wrapped_twice,
            "reasoning_opened_by_prompt": self.reasoning_opened_by_prompt,
            "reasoning_block_filled": self.reasoning_block_filled, "tools_listed_twice": self.tools_listed_twice,
            "content_not_rendered": self.content_not_rendered, "row_template_kwargs": self.row_template_kwargs,
            "tool_types_mapped": self.tool_types_mapped,
            "hub_dataset": self.hub_dataset,
        }

    def add_notes(self, notes: Counter, flagged: dict[str, list[int]], where: Any) -> None:
        """Count the rows the render step noted, and warn once for each kind, naming the first rows (and the
        special tokens whose text they hold, FOUND_NOTE's keys)."""
        found = Counter({key[len(FOUND_NOTE):]: n for key, n in notes.items() if key.startswith(FOUND_NOTE)})
        self.special_tokens_in_text_by_token.update(found)
        self.row_template_kwargs += notes.get("row_template_kwargs", 0)
        self.tool_types_mapped += notes.get("tool_types_mapped", 0)
        for note, what in _NOTES.items():
            if notes.get(note):
                setattr(self, note, getattr(self, note) + notes[note])
                what = what.replace("{found}", found_tokens(found))
                rows = "; ".join(where(row) for row in flagged.get(note, []))
                logger.warning("%s: %d row(s) %s (first: %s)", self.name, notes[note], what, rows)


def commonest(found: Counter) -> list[tuple[str, int]]:
    """The tokens and their rows, the commonest first, ties by name (the same order however the rows were split)."""
    return sorted(found.items(), key=lambda item: (-item[1], item[0]))


def found_tokens(found: Counter, shown: int = 10) -> str:
    """`<|im_end|> in 12 rows, <|endoftext|> in 3 rows`: the special tokens found in the rows' text, the commonest
    first."""
    named = [f"{token} in {n} row{'s' if n > 1 else ''}" for token, n in commonest(found)[:shown]]
    return ", ".join(named) + (f", and {len(found) - shown} more" if len(found) > shown else "")


def length_percentiles(lengths: Any) -> dict[str, int]:
    """p50/p90/p99/max of the examples' lengths (a list or an array)."""
    if not len(lengths):
        return {}
    ordered = np.sort(np.asarray(lengths))

    def at(q: float) -> int:
        return int(ordered[min(len(ordered) - 1, int(q * len(ordered)))])

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": int(ordered[-1])}


# what each drop reason asks of the user, for the error of a mixture left with no example
DROP_FIXES = {
    "too_long": "raise --max_seq_length, or keep long rows cut with --truncation truncate",
    "no_trained_tokens_after_truncation": "raise --max_seq_length: truncation cut every trained token of these rows",
    "no_trained_tokens": "these rows have nothing to train under --train_on (an empty or missing assistant turn?)",
    "empty_text": "these text rows are empty",
}


def nothing_left_message(reports: list[Any], max_seq_length: int) -> str:
    """The error of a mixture that leaves no training example: each source's drops by reason, with the fix."""
    lines, fixes = [], {}
    for report in reports:
        reasons = ", ".join(f"{reason} {count}" for reason, count in report.dropped.most_common() if count)
        lines.append(f"  {report.name} ({report.format}): {report.rows_in} rows, {report.rows_selected} selected, "
                     f"{report.examples} kept" + (f"; dropped: {reasons}" if reasons else ""))
        fixes.update({r: DROP_FIXES[r] for r, count in report.dropped.items() if count and r in DROP_FIXES})
    hint = "\n".join(f"  {reason}: {fix}" for reason, fix in fixes.items())
    return (f"no training examples are left after mixing, truncation and filtering (--max_seq_length "
            f"{max_seq_length}):\n" + "\n".join(lines) + (f"\n{hint}" if hint else ""))


def no_usable_rows_message(report: Any) -> str:
    """The error of a source whose rows were all dropped before its amount is taken (--on_bad_row drop), by reason:
    "1.0 of x.jsonl (0 rows) selects no rows; raise the amount" named neither the rows nor why."""
    reasons = ", ".join(f"{reason} {count}" for reason, count in report.dropped.most_common() if count)
    return (f"--dataset_mixer_list: {report.name} has no usable row to take its amount from: its {report.rows_in} "
            f"row(s) were all dropped under --on_bad_row drop ({reasons or 'no reason recorded'}); fix its rows (run "
            "without --on_bad_row drop to have the first bad one named), or leave the source out of the mixture")


def mixture_shares(report: dict[str, Any], source: dict[str, Any]) -> tuple[float, float]:
    """A source's share of the mixture's examples and of its tokens."""
    return source["examples"] / max(report["examples"], 1), source["tokens"] / max(report["tokens"], 1)


def shares_note(report: dict[str, Any], data: Any) -> Optional[str]:
    """One line when the --dataset_mixer_list amounts (of `data`, the DataArguments) look like shares of the mixture
    (fractions of two or more sources summing to about 1): they are fractions of each source's rows (open-instruct's
    meaning), so 0.7 and 0.3 of two sources of unequal size are not a 70/30 mixture. Says what the mixture holds and
    how to ask for shares."""
    from open_sft.data.sources import parse_mixer_list

    if data.dataset_mixer_unit == "share":  # the amounts are the shares
        return None
    specs = parse_mixer_list(data.dataset_mixer_list, data.dataset_mixer_list_splits,
                             config_name=data.dataset_config_name)
    if len(specs) < 2 or not all(s.is_fraction for s in specs) or not 0.9 <= sum(s.amount for s in specs) <= 1.1:
        return None
    got = ", ".join(f"{source['name']} {source['examples']} examples ({ex:.0%} of them, {tok:.0%} of the tokens)"
                    for source in report["sources"] for ex, tok in [mixture_shares(report, source)])
    amounts = " and ".join(f"{s.amount:g}" for s in specs)
    unit = "tokens" if data.dataset_mixer_unit == "tokens" else "rows"
    return (f"--dataset_mixer_list amounts {amounts} are fractions of each source's {unit} (open-instruct's meaning), "
            f"not shares of the mixture: it holds {got}. For shares of the mixture's examples, give "
            "--dataset_mixer_unit share (the amounts are then shares: 0.7 and 0.3 is 70/30 by examples); for shares of "
            "its tokens, give each source a count of tokens with --dataset_mixer_unit tokens (e.g. 700000 and 300000)")


def eval_split_note(train: dict[str, Any], held_out: dict[str, Any], ratio: float) -> Optional[str]:
    """One line comparing the --eval_split_ratio evaluation mixture's shares of examples with the training
    mixture's (reports of the two sides): each held-out row is evaluated once, so the evaluation mixture follows the
    sources' sizes, not the amounts. None for one source."""
    if len(train["sources"]) < 2:
        return None
    names = source_names([source["name"] for source in train["sources"]])

    def shares(report: dict[str, Any]) -> str:
        return ", ".join(f"{name} {mixture_shares(report, source)[0]:.1%}" for name, source in
                         zip(names, report["sources"]))

    return (f"eval split (--eval_split_ratio {ratio:g} of each source's rows, each evaluated once): {shares(held_out)} "
            f"of examples; the training mixture: {shares(train)}")


def format_data_report(report: dict[str, Any]) -> str:
    """The data report as a fixed-width table, one line per source plus the mixture total."""
    # as wide as the longest format name (question_answer, messages:conversation), so the columns stay aligned
    width = max([9] + [len(source["format"]) for source in report["sources"]])
    header = f"{'source':<40} {'format':<{width}} {'rows in':>8} {'kept':>8} {'dropped':>8} {'trunc':>6} " \
             f"{'examples':>9} {'tokens':>11} {'trained':>7} {'% ex':>6} {'% tok':>6}"
    lines = ["data report", header, "-" * len(header)]
    for source in report["sources"]:
        name = source["name"] if len(source["name"]) <= 40 else "…" + source["name"][-39:]
        dropped = sum(source["rows_dropped"].values())
        share = source["trained_tokens"] / max(source["tokens"], 1)
        of_examples, of_tokens = mixture_shares(report, source)  # the source's share of the mixture
        lines.append(f"{name:<40} {source['format']:<{width}} {source['rows_in']:>8} {source['rows_kept']:>8} "
                     f"{dropped:>8} {source['truncated']:>6} {source['examples']:>9} {source['tokens']:>11} "
                     f"{share:>7.1%} {of_examples:>6.1%} {of_tokens:>6.1%}")
        if source.get("upsample_factor", 1.0) > 1.0:
            lines.append(f"{'':<4}upsampled ×{source['upsample_factor']:.2f} (rows repeated to reach the amount)")
        if source.get("rows_split"):
            lines.append(f"{'':<4}{source['rows_split']} conversation(s) made several examples (the template rewrites "
                         f"earlier turns): +{source['split_extra_tokens']} tokens of repeated context")
        for note in RENDER_NOTES:
            if source.get(note):
                found = source.get(f"{note}_by_token")  # special_tokens_in_text's tokens
                lines.append(f"{'':<4}{note}: {source[note]} row(s)" + (
                    f" ({found_tokens(Counter(found))})" if found else ""))
        for reason, count in sorted(source["rows_dropped"].items()):
            lines.append(f"{'':<4}dropped {count} row(s): {reason}")
    share = report["trained_tokens"] / max(report["tokens"], 1)
    lines.append("-" * len(header))
    lines.append(f"{'mixture':<40} {'':<{width}} {'':>8} {'':>8} {'':>8} {'':>6} "
                 f"{report['examples']:>9} {report['tokens']:>11} {share:>7.1%} {1:>6.1%} {1:>6.1%}")
    if report.get("length_percentiles"):
        percentiles = report["length_percentiles"]
        lines.append("example length (tokens): " + ", ".join(f"{k} {percentiles[k]}" for k in ("p50", "p90", "p99", "max")))
    return "\n".join(lines)


def mark_trained(tokenizer: Any, input_ids: list[int], labels: list[int], color: bool) -> str:
    """Decode an example with its trained spans highlighted (colour on a terminal, [[brackets]] otherwise)."""
    open_, close = (BOLD_GREEN, RESET) if color else ("[[", "]]")
    parts, run, trained = [], [], None
    for token, label in zip(input_ids, labels):
        is_trained = label != IGNORE_INDEX
        if trained is not None and is_trained != trained:
            text = tokenizer.decode(run)
            parts.append(f"{open_}{text}{close}" if trained else text)
            run = []
        run.append(token)
        trained = is_trained
    if run:
        text = tokenizer.decode(run)
        parts.append(f"{open_}{text}{close}" if trained else text)
    return "".join(parts)


def print_examples(data: Any, tokenizer: Any, color: bool, count: int = 3) -> None:
    """--dry_run: the first examples as the model will see them, trained tokens marked."""
    for index in range(min(count, len(data))):
        example = data.example(index)
        print(f"\n--- example {index} ({len(example.input_ids)} tokens; trained tokens marked) ---")
        print(mark_trained(tokenizer, example.input_ids, example.labels, color))


def report_data(data: Any, eval_data: Any, args: Any, tokenizer: Any, examples: bool = False,
                table: bool = True) -> None:
    """What the main process says of the prepared data (`data`, `eval_data`: PreparedData; `args`: DataArguments):
    the data report, the mixture-shares and eval-split notes, and (`examples`: --dry_run) the examples as trained.
    `table` False (--cache_dataset_only, whose cache_only_summary prints the report last): the notes alone."""
    import sys

    if table:
        print(format_data_report(data.report), flush=True)
    if note := shares_note(data.report, args):
        logger.warning("%s", note)
    ratio = args.eval_split_ratio
    if ratio and eval_data is not None and (note := eval_split_note(data.report, eval_data.report, ratio)):
        logger.info("%s", note)
    if examples:
        print_examples(data, tokenizer, color=sys.stdout.isatty())


def cache_only_summary(data: Any, eval_data: Any) -> str:
    """What --cache_dataset_only prints: the data report, the evaluation entry's path (where there is one), and
    the training entry's path on the last line (scripts/prepare_data.sh and the contract read it there)."""
    lines = [format_data_report(data.report)]
    if eval_data is not None:
        lines.append(f"evaluation cache: {eval_data.cache_path}")
    return "\n".join([*lines, str(data.cache_path)])
