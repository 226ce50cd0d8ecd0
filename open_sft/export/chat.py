"""Chat with a run's model: `open_sft chat OUTPUT_DIR`.

Each line read is a user turn; the reply is generated (greedy) from the whole conversation so far, rendered
with the run's chat template (the tokenizer saved in OUTPUT_DIR carries it), and followed by a line saying why
it stopped; a reasoning model's trace (a think block, gpt-oss's analysis channel) is shown apart, between
`[reasoning]` and `[/reasoning]`, and kept in the conversation as the template reads it (open_sft.export.reply),
so later turns render as training did. With --tools FILE the prompt holds the tool schemas (as a training row's
`tools`), a reply that calls a tool shows each call as `[tool call] NAME {ARGUMENTS}` and is kept with its
`tool_calls` (a call that does not read as one, cut off or not JSON, is shown as `[tool call, unreadable] RAW` and
neither it nor the message it answered is kept, since no message renders it as written: ask again, or send the
/tool result again), and `/tool TEXT` answers the next call with TEXT (a `tool` message, or an entry of the
field the template writes results in where the reply stopped at its opening: Gemma 4's `tool_responses`,
open_sft.export.tool_results); once every call of the
reply has its result the model goes on from them (a reply that made two calls takes two /tool lines, the first
answered by `[result kept; 1 more call awaits /tool]`), and a message typed before then is refused with a line
naming the call that awaits its result (the calls stay; /reset drops them). `/reset` starts the conversation over (a
--system message stays), `/exit` (or end of input, Ctrl-D) quits. On a terminal the turns are read with line
editing after a `you> ` prompt; from a pipe (`printf 'Hi\\n/exit\\n' | open_sft chat DIR`) the lines are read as they come and stdout
holds only the replies and their stop lines. OUTPUT_DIR may hold a full export, a LoRA/QLoRA adapter or be a merged/
directory, as for `open_sft generate`. A model without a chat template (trained on plain text), or --raw: each
line, with its newline, is appended to the text so far and the model continues it.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional, TextIO

from open_sft.config.whole_flags import WholeFlagParser
from open_sft.export.generate import (CONTEXT_FULL, END_OF_TURN, Generation, add_model_arguments, context_length,
                                      generate_reply, load_or_exit, plain_continuation,
                                      tools_before_loading)
from open_sft.export.template_kwargs import bind_template_kwargs, template_kwargs_or_exit

EXIT, RESET, TOOL = ("/exit", "/quit"), "/reset", "/tool"
PROMPT = "you> "
COMMANDS = f"{RESET} clears the conversation, {TOOL} TEXT answers a tool call, {EXIT[0]} quits"


def _tokens(n: int) -> str:
    return f"{n} token" if n == 1 else f"{n} tokens"


def _reasoning_block(reply: Generation) -> str:
    """A reasoning model's trace, shown apart from the answer that follows it ("" when none was written)."""
    if not reply.reasoning:
        return ""
    return f"[reasoning]\n{reply.reasoning}\n[/reasoning]\n" if reply.answered else \
        f"[reasoning, stopped before any answer]\n{reply.reasoning}\n"


def _calls_block(reply: Generation, turn: dict) -> str:
    """The reply's calls, one a line; an unreadable call as written, with what was left out of the conversation
    (`turn`, the message it answered, as well as the reply) and how to go on."""
    from open_sft.export.tool_calls import call_line

    if reply.unreadable_call is not None:
        left, again = ("the tool result", f"send it again with {TOOL}") if turn["role"] == "tool" else (
            "your message", "ask again")
        return (f"{reply.unreadable_line()}\n[the call does not read as one: {left} and this reply are both left "
                f"out of the conversation; {again}]\n")
    return "".join(f"{call_line(call)}\n" for call in reply.tool_calls)


def tool_result(messages: list[dict], text: str) -> dict | str:
    """The tool message answering the next call of the last reply that called tools (its id, and its name, which
    gpt-oss's template writes), or why there is none to answer."""
    from open_sft.export.reply import call_id

    calls, answered = _open_calls(messages)
    if answered >= len(calls):
        return f"[no tool call awaits a result: {TOOL} TEXT answers the calls of the model's last reply]"
    if not text:
        return f"[{TOOL} TEXT: give the result of {calls[answered]['function']['name']}]"
    return {"role": "tool", "content": text, "tool_call_id": calls[answered].get("id") or call_id(answered + 1),
            "name": calls[answered]["function"]["name"]}


def _open_calls(messages: list[dict]) -> tuple[list[dict], int]:
    """(the calls of the last reply that called tools, how many of them tool messages after it answer); ([], 0)
    where the last message that is not a tool result made no calls."""
    last = next((i for i in range(len(messages) - 1, -1, -1) if messages[i]["role"] != "tool"), None)
    calls = (messages[last].get("tool_calls") or []) if last is not None else []
    return calls, (len(messages) - 1 - last if calls else 0)


def awaiting(messages: list[dict]) -> int:
    """How many calls of the last reply that called tools have no result yet."""
    calls, answered = _open_calls(messages)
    return len(calls) - answered


def stop_line(reply: Generation, max_new_tokens: int, context: int) -> str:
    """Why the reply stopped, in words, with its length and the conversation's (which grows turn by turn)."""
    size = f"{_tokens(reply.new_tokens)}; conversation {reply.prompt_tokens + reply.new_tokens} of {context} tokens"
    if reply.text and not reply.text.strip():
        size += f"; only whitespace ({len(reply.text)} characters)"
    if reply.stop_reason == END_OF_TURN:
        return f"[end of turn ({reply.stop_token}): {size}]"
    if reply.stop_reason == CONTEXT_FULL:
        return f"[stopped: the model's context is full ({size}); {RESET} to start over]"
    return f"[cut off at --max_new_tokens {max_new_tokens}: {size}]"


def line_reader(stdin: TextIO, stdout: TextIO) -> Callable[[], Optional[str]]:
    """A function returning the next user line (None at end of input): with a prompt and line editing on a
    terminal, plain reads from a pipe or file."""
    if stdin.isatty() and stdin is sys.stdin and stdout is sys.stdout:
        try:
            import readline  # noqa: F401  (input() gets line editing and history)
        except ImportError:
            pass

        def read_tty() -> Optional[str]:
            try:
                return input(PROMPT)
            except EOFError:
                stdout.write("\n")
                return None

        return read_tty

    def read_pipe() -> Optional[str]:
        line = stdin.readline()
        return None if line == "" else line.rstrip("\n")

    return read_pipe


def chat(model, tokenizer, read: Callable[[], Optional[str]], out: TextIO, system: Optional[str] = None,
         max_new_tokens: int = 256, raw: bool = False, tools: Optional[list[dict]] = None) -> int:
    """The loop: read a turn, reply from the conversation so far (with `tools` in the prompt), until /exit or end
    of input (`raw`: plain text continued, each line appended with its newline). Returns the number of replies."""
    from open_sft.export.tool_results import folded, result_field

    start = [{"role": "system", "content": system}] if system else []
    messages, replies, context = list(start), 0, context_length(model)
    fields: dict[int, str] = {}  # a calling reply's index: the field its results go in (open_sft.export.tool_results)
    while (line := read()) is not None:
        text = line.strip()
        if not text:
            continue
        if text in EXIT:
            break
        turn = _turn(messages, text, raw)
        if isinstance(turn, str):
            if turn == RESET:
                messages, turn, fields = list(start), "[conversation reset]", {}
            out.write(f"{turn}\n")
            out.flush()
            continue
        messages.append(turn)
        if turn["role"] == "tool" and (left := awaiting(messages)):  # the reply answers every call's result at once
            out.write(f"[result kept; {left} more {'call awaits' if left == 1 else 'calls await'} {TOOL}]\n")
            out.flush()
            continue
        reply = generate_reply(model, tokenizer, folded(messages, fields), max_new_tokens, raw=raw, tools=tools)
        if reply.stop_reason == CONTEXT_FULL and reply.new_tokens == 0:
            messages.pop()  # the turn did not fit: not kept, so the next one can be tried after /reset
        elif reply.unreadable_call is not None:  # no message renders it as written: neither it nor its turn kept
            messages.pop()
            replies += 1
        else:
            messages.append(reply.message())  # its reasoning and calls as the template reads them, not flattened
            replies += 1
            if reply.tool_calls and (field := result_field(tokenizer, reply.stop_token)):
                fields[len(messages) - 1] = field
        called = reply.tool_calls or reply.unreadable_call is not None
        answer = f"{reply.text}\n" if reply.text or not called else ""  # a bare call: its lines alone
        stop = stop_line(reply, max_new_tokens, context)
        out.write(f"{_reasoning_block(reply)}{answer}{_calls_block(reply, turn)}{stop}\n")
        out.flush()
    return replies


def _turn(messages: list[dict], text: str, raw: bool) -> dict | str:
    """The message a line adds (a user turn, a /tool result), or RESET, or what to say instead of replying."""
    if text == RESET:
        return RESET
    command, _, rest = text.partition(" ")
    if command == TOOL and not raw:
        return tool_result(messages, rest.strip())
    if text.startswith("/") and " " not in text:
        return f"[unknown command {text}: {COMMANDS}]"
    if left := awaiting(messages):  # a message after a call without its result: no template renders it as trained
        calls, answered = _open_calls(messages)
        return (f"[{'a tool call awaits its result' if left == 1 else f'{left} tool calls await their results'}: "
                f"give {calls[answered]['function']['name']}'s with {TOOL} TEXT (an error message is a result too), "
                f"or {RESET} to start over]")
    return {"role": "user", "content": text + "\n" if raw else text}


def main(argv: Optional[list[str]] = None, prog: str = "open_sft chat") -> int:
    parser = WholeFlagParser(prog=prog, description=__doc__,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser, max_new_tokens=256)
    parser.add_argument("--system", default=None, help="a system message that starts every conversation")
    args = parser.parse_args(argv)
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
    bind_template_kwargs(loaded.tokenizer, kwargs)
    print(f"chatting with {loaded.description}; {COMMANDS} (or Ctrl-D)", file=sys.stderr, flush=True)
    raw = plain_continuation(args, loaded.tokenizer)
    if raw and args.system:
        print("error: --system needs a chat template; plain continuation (--raw, or a tokenizer without one) "
              "continues the text typed", file=sys.stderr)
        return 2
    try:
        chat(loaded.model, loaded.tokenizer, line_reader(sys.stdin, sys.stdout), sys.stdout, args.system,
             args.max_new_tokens, raw, tools)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
