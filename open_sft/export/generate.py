"""Generate from a run's output directory with its chat template, and score it on the embedded sample tasks.

    open_sft generate OUTPUT_DIR --prompt "What is 7 plus 5?"
    open_sft generate OUTPUT_DIR --score_sample 50     # exact-answer accuracy on sample rows
    open_sft generate OUTPUT_DIR --raw --prompt "def read_file(path):"   # continue plain text

A model trained on plain text (continual pretraining) has no chat template: its prompts are continued as plain
text, as --raw asks for any model. The generation is printed as generated, whitespace included
(`only_whitespace` says when that is all it is). A reasoning model's reply is split as its chat template writes
it (open_sft.export.reply): `generation` is the answer and `reasoning` the trace before it (Qwen3's and GLM's
think block, gpt-oss's analysis channel); `cut_before_answer` says the reply stopped inside its reasoning. The
--score_sample scores the answer alone. With --tools FILE (open_sft.export.tool_schemas) the prompt holds the tool
schemas the chat template writes, and a reply's calls are `tool_calls` ({name, arguments}: open_sft.export.
tool_calls), read after its reasoning only; a call that does not read as one (cut off, not JSON, arguments not
an object) is `unreadable_tool_call`, as written. --tools is for the --prompt replies: --score_sample asks the
bundled sample's tasks, which have no tools and expect no calls.

OUTPUT_DIR is what the run wrote, whatever it holds: a full export, a LoRA/QLoRA adapter (its base model is
the one adapter_config.json names, or --base_model), or a LoRA run's merged/ directory. Each generation says
why it stopped: `end_of_turn` (the model ended its turn: an end-of-turn or eos token), `max_new_tokens` (the
--max_new_tokens limit cut it off) or `max_length` (the model's context was full).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from open_sft.config.whole_flags import WholeFlagParser
from open_sft.export.template_kwargs import add_template_kwargs_argument, bind_template_kwargs, template_kwargs_or_exit
from open_sft.export.tool_schemas import add_tools_argument

HELD_OUT_SEED = 20261122  # the bundled sample is generated with seed 0
END_OF_TURN, TOKEN_LIMIT, CONTEXT_FULL = "end_of_turn", "max_new_tokens", "max_length"


@dataclass
class Generation:
    """One reply: its text, why it stopped (END_OF_TURN, TOKEN_LIMIT or CONTEXT_FULL), the tokens of the prompt it
    answered and its new tokens, when the model ended its turn the token that ended it, and the special tokens it
    generated before that (the text leaves them out). A reasoning model's text is its answer alone, and
    `reasoning` the trace written before it (open_sft.export.reply; None: no reasoning part); `answered` is False
    when the reply stopped inside its reasoning, before any answer."""

    text: str
    stop_reason: str
    prompt_tokens: int
    new_tokens: int
    stop_token: str | None = None
    special_tokens: list[str] = field(default_factory=list)
    reasoning: str | None = None
    answered: bool = True
    verbatim: str | None = None  # the reply as written, where the template reads its trace from the content
    tool_calls: tuple[dict, ...] = ()  # each {name, arguments} (open_sft.export.tool_calls)
    unreadable_call: str | None = None  # a call written that does not read as one, as written (from its marker)
    call_ids: tuple[str, ...] = ()  # ReplyParts': the ids the reply wrote, where its template writes them as names
    text_arguments: bool = False  # ReplyParts': the template takes arguments as JSON text
    thinking_chunk: bool = False  # ReplyParts': the template takes the trace as a `thinking` chunk of the content

    def message(self) -> dict:
        """The reply as the assistant message a chat history keeps (its trace as the template reads it, its calls
        as `tool_calls`)."""
        from open_sft.export.reply import ReplyParts

        return ReplyParts(self.text, self.reasoning, self.answered, self.verbatim, self.tool_calls,
                          call_ids=self.call_ids, text_arguments=self.text_arguments,
                          thinking_chunk=self.thinking_chunk).message()

    def unreadable_line(self) -> str:
        """`[tool call, unreadable] to=functions.get_weather<|channel|>...{"city": "Oslo"` ("" when none)."""
        return f"[tool call, unreadable] {self.unreadable_call}" if self.unreadable_call is not None else ""


def stop_token_ids(model, tokenizer) -> set[int]:
    """The ids that end a turn: the generation config's eos ids (the export writes the template's end-of-turn
    markers there) and the tokenizer's eos."""
    configured = getattr(model.generation_config, "eos_token_id", None)
    ids = set(configured if isinstance(configured, list) else [] if configured is None else [configured])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def context_length(model) -> int:
    """The positions the model was trained for (max_position_embeddings), or no limit where it names none."""
    from open_sft.model.anatomy import text_config

    return getattr(text_config(model.config), "max_position_embeddings", None) or sys.maxsize


def generate_reply(model, tokenizer, messages: list[dict], max_new_tokens: int = 32, raw: bool = False,
                   tools: list[dict] | None = None) -> Generation:
    """Greedy reply to `messages` rendered with the tokenizer's chat template (with `tools`, the schemas it writes
    in the prompt), and why it stopped; `raw`: the continuation of their contents joined as they are (plain text,
    no template)."""
    from open_sft.export.reply import ReplyParts, parse_reply

    if raw:
        encoded = tokenizer("".join(m["content"] for m in messages), return_tensors="pt")
        if encoded["input_ids"].shape[1] == 0:  # an empty prompt, and a tokenizer that adds no bos
            start = _start_token(tokenizer)
            encoded = {"input_ids": torch.tensor([[start]]), "attention_mask": torch.ones(1, 1, dtype=torch.long)}
        encoded = {name: tensor.to(model.device) for name, tensor in encoded.items()}
    else:
        encoded = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, return_tensors="pt",
                                                return_dict=True).to(model.device)
    prompt_tokens = encoded["input_ids"].shape[1]
    room = context_length(model) - prompt_tokens
    if room <= 0:
        return Generation("", CONTEXT_FULL, prompt_tokens, 0)
    stops = stop_token_ids(model, tokenizer)
    with torch.no_grad():
        out = model.generate(**encoded, max_new_tokens=min(max_new_tokens, room), do_sample=False,
                             eos_token_id=sorted(stops), pad_token_id=tokenizer.pad_token_id
                             if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
    new = out[0, prompt_tokens:].tolist()
    ended = bool(new) and new[-1] in stops
    body = new[:-1] if ended else new
    if raw:
        parts = ReplyParts(tokenizer.decode(new, skip_special_tokens=True))  # as generated: whitespace is part of it
    else:  # a reasoning model's trace apart from its answer, by the template's layout
        parts = parse_reply(tokenizer, body, encoded["input_ids"][0].tolist(), tools,  # a call's closing may end it
                            tokenizer.decode(new[len(body):], skip_special_tokens=False))
    special = set(tokenizer.all_special_ids)
    hidden = tokenizer.convert_ids_to_tokens([t for t in body if t in special])
    stop_reason = END_OF_TURN if ended else TOKEN_LIMIT if len(new) >= max_new_tokens else CONTEXT_FULL
    return Generation(parts.answer, stop_reason, prompt_tokens, len(new),
                      tokenizer.convert_ids_to_tokens(new[-1]) if ended else None, hidden, parts.reasoning,
                      parts.answered, parts.verbatim, parts.tool_calls, parts.unreadable_call, parts.call_ids,
                      parts.text_arguments, parts.thinking_chunk)


def _start_token(tokenizer) -> int:
    """What an empty plain-text prompt starts from: bos, else eos (GPT-2's and GPT-NeoX's unconditional start)."""
    from open_sft.errors import UserError

    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if start is None:
        raise UserError("an empty prompt has nothing to continue, and the tokenizer has neither a bos nor an eos token "
                        "to start from: give --prompt some text")
    return start


def generate(model, tokenizer, messages: list[dict], max_new_tokens: int = 32, raw: bool = False) -> str:
    """The reply's text alone (see generate_reply)."""
    return generate_reply(model, tokenizer, messages, max_new_tokens, raw=raw).text


def score_sample(model, tokenizer, rows: list[dict], max_new_tokens: int = 32) -> dict:
    """Share of rows whose generated final answer equals the expected one (the last turn is held out), a reasoning
    model's answer without its reasoning, an expected tool call by its name and arguments (a row's own `tools`
    rendered in its prompt); with how many replies had reasoning set aside, how many were cut off inside it
    (before an answer: misses) and how many rows were scored by their calls, when any."""
    from open_sft.embedded.sample_data import score_answer
    from open_sft.export.tool_calls import scores_calls, task_tools, was_right

    replies = [generate_reply(model, tokenizer, row["messages"][:-1], max_new_tokens, tools=task_tools(row))
               for row in rows]
    hits = sum(was_right(row, reply, score_answer) for row, reply in zip(rows, replies))
    scored = {"held_out_tasks": len(rows), "exact_answer_accuracy": hits / max(len(rows), 1)}
    if set_aside := sum(reply.reasoning is not None for reply in replies):
        scored["reasoning_set_aside"] = set_aside
    if cut := sum(not reply.answered for reply in replies):
        scored["cut_before_answer"] = cut  # raise --max_new_tokens
    if unreadable := sum(reply.unreadable_call is not None for reply in replies):
        scored["unreadable_tool_calls"] = unreadable  # a call written that does not read as one: misses
    if calls := sum(scores_calls(row) for row in rows):
        scored["scored_as_tool_calls"] = calls  # the same name and the same arguments as JSON values
    return scored


def add_model_arguments(parser: argparse.ArgumentParser, max_new_tokens: int) -> None:
    """The arguments `generate` and `chat` share: the directory, the base of an adapter, the token limit."""
    parser.add_argument("model_dir", type=Path,
                        help="a run's --output_dir (full export or LoRA/QLoRA adapter) or its merged/ directory")
    parser.add_argument("--base_model", default=None,
                        help="for an adapter directory: the base model to apply it to (default: "
                             "base_model_name_or_path of its adapter_config.json)")
    parser.add_argument("--max_new_tokens", type=int, default=max_new_tokens,
                        help="the most tokens one reply may have; a reply cut there says so")
    parser.add_argument("--raw", action="store_true",
                        help="plain continuation: the text typed is continued as it is, without the chat template "
                             "(a model trained on plain text); the default when the tokenizer has no chat template")
    add_tools_argument(parser)
    add_template_kwargs_argument(parser)


def tools_for(args: argparse.Namespace, tokenizer, raw: bool) -> tuple[list[dict] | None, str | None]:
    """(the --tools schemas, None), or (None, the error to print): a file that is not tool schemas, a template
    that does not write them, or plain continuation (no template to write them)."""
    from open_sft.export.tool_schemas import tools_or_exit

    if args.tools is not None and raw:
        return None, ("--tools needs a chat template that writes them; plain continuation (--raw, or a tokenizer "
                      "without a chat template) continues the text alone")
    return tools_or_exit(args.tools, tokenizer, f"--tools {args.tools}")


def tools_before_loading(args: argparse.Namespace, kwargs: dict | None = None) -> tuple[list[dict] | None, str | None]:
    """tools_for with the directory's tokenizer alone (rendering with the chat template variables `kwargs`), before
    any model loads: a --tools file that is missing, not tool schemas, or not written by the template costs no model
    load. (None, None) without --tools."""
    from open_sft.errors import UserError
    from open_sft.export.run_dir import load_saved_tokenizer, model_kind

    if args.tools is None:
        return None, None
    try:
        from open_sft.export.tool_schemas import read_tools

        read_tools(args.tools)  # the file first: it needs no tokenizer
        model_kind(args.model_dir)  # a directory with no model is named as such, before its tokenizer
        tokenizer = bind_template_kwargs(load_saved_tokenizer(args.model_dir), kwargs or {})
    except UserError as exc:
        return None, str(exc)
    return tools_for(args, tokenizer, args.raw or not tokenizer.chat_template)


def plain_continuation(args: argparse.Namespace, tokenizer) -> bool:
    """Whether to continue plain text (--raw, or a tokenizer without a chat template: said on stderr)."""
    if not args.raw and not tokenizer.chat_template:
        print(f"{args.model_dir}: its tokenizer has no chat template (a model trained on plain text): the text is "
              "continued as it is (--raw)", file=sys.stderr, flush=True)
    return args.raw or not tokenizer.chat_template


def load_or_exit(args: argparse.Namespace):
    """The run's model (open_sft.export.run_dir), or None after printing the error to stderr."""
    from open_sft.errors import UserError
    from open_sft.export.run_dir import load_run_model

    if args.max_new_tokens < 1:
        print(f"error: --max_new_tokens {args.max_new_tokens} must be at least 1", file=sys.stderr)
        return None
    if not sys.stderr.isatty():  # transformers' weight-loading bar: for a terminal, not a log or a pipe
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    try:
        return load_run_model(args.model_dir, args.base_model)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None


def main(argv: list[str] | None = None, prog: str = "open_sft generate") -> int:
    from open_sft.errors import UserError

    parser = WholeFlagParser(prog=prog, description=__doc__,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser, max_new_tokens=32)
    parser.add_argument("--prompt", action="append", default=[], help="a user message (repeatable)")
    parser.add_argument("--system", default=None, help="optional system message")
    parser.add_argument("--score_sample", type=int, default=0,
                        help="score exact answers on this many freshly generated sample tasks (held out: "
                             "a seed the bundled training sample does not use)")
    args = parser.parse_args(argv)
    if args.score_sample < 0:
        parser.error(f"--score_sample must be 0 or more (a number of sample tasks), got {args.score_sample}")
    kwargs = template_kwargs_or_exit(args, (args.model_dir,))
    if kwargs is None:
        return 2
    tools, problem = tools_before_loading(args, kwargs)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    loaded = load_or_exit(args)
    if loaded is None:
        return 2
    model, tokenizer = loaded.model, bind_template_kwargs(loaded.tokenizer, kwargs)
    raw = plain_continuation(args, tokenizer)
    if raw and (args.system or args.score_sample):
        print(f"error: {'--system' if args.system else '--score_sample'} needs a chat template; plain continuation "
              "(--raw, or a tokenizer without one) continues --prompt alone", file=sys.stderr)
        return 2
    for prompt in args.prompt:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": prompt})
        try:
            reply = generate_reply(model, tokenizer, messages, args.max_new_tokens, raw=raw, tools=tools)
        except UserError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(json.dumps({"prompt": prompt, "generation": reply.text,
                          **({"reasoning": reply.reasoning} if reply.reasoning is not None else {}),
                          **({"tool_calls": list(reply.tool_calls)} if reply.tool_calls else {}),
                          **({"unreadable_tool_call": reply.unreadable_call} if reply.unreadable_call else {}),
                          **({"cut_before_answer": True} if not reply.answered else {}),
                          "stop_reason": reply.stop_reason, "new_tokens": reply.new_tokens,
                          "stop_token": reply.stop_token,
                          **({"special_tokens": reply.special_tokens} if reply.special_tokens else {}),
                          **({"only_whitespace": True} if reply.text and not reply.text.strip() else {})}),
              flush=True)
    if args.score_sample:
        from open_sft.embedded.sample_data import generate_examples

        rows = generate_examples(args.score_sample, seed=HELD_OUT_SEED)
        print(json.dumps(score_sample(model, tokenizer, rows, args.max_new_tokens)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
