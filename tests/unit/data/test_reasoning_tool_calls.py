"""Reasoning and tool-calling conversations under the chat templates their model repositories ship (Qwen3,
gpt-oss, GLM-4.5: tests/data/chat_templates): every assistant turn is trained as the model will generate it.

The check is independent of open_sft's locating code: for assistant turn k, transformers' apply_chat_template
renders the context (the messages before it, with the generation prompt) and the turn as the last message;
the cached example that trains turn k must hold exactly that context before its trained run, and the run must
be what the template writes after the generation prompt (its reasoning, content and calls), through the token
the model stops at."""

from __future__ import annotations

import json
import re
from itertools import repeat
from pathlib import Path

import pytest
from tokenizers import AddedToken
from transformers import AutoTokenizer

from open_sft.config.args import DataArguments
from open_sft.data.formats import to_messages
from open_sft.data.labels import IGNORE_INDEX, trained_token_runs
from open_sft.data.build import build_examples
from open_sft.errors import UserError

TEMPLATES = Path(__file__).parents[2] / "data" / "chat_templates"
# per family: the template, its special tokens, tags its tokenizer adds (special or not), eos
FAMILIES = {
    "qwen3": ("qwen3.jinja", ["<|im_start|>", "<|im_end|>", "<|endoftext|>"], (["<think>", "</think>", "<tool_call>",
              "</tool_call>", "<tool_response>", "</tool_response>"], False), "<|im_end|>"),
    "gpt_oss": ("gpt_oss.jinja", ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|call|>", "<|return|>",
                "<|constrain|>", "<|endoftext|>"], ([], False), "<|return|>"),
    # GLM's tags special here: a tag like </tool_call> must not be taken for the end of a turn
    "glm": ("glm_4_5.jinja", ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
            "<|endoftext|>"], (["<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>",
                               "<arg_value>", "</arg_value>"], True), "<|endoftext|>"),
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "convert", "description": "Celsius to Fahrenheit.",
          "parameters": {"type": "object", "properties": {"celsius": {"type": "number"}}, "required": ["celsius"]}}}]


def call(name: str, arguments: dict, n: int) -> dict:
    return {"id": f"call_{n}", "type": "function", "function": {"name": name, "arguments": arguments}}


def tool(content: str, n: int) -> dict:
    return {"role": "tool", "content": content, "tool_call_id": f"call_{n}"}


SEVERAL_USERS = {"tools": TOOLS, "messages": [  # several user messages, a tool chain after each
    {"role": "system", "content": "You answer weather questions."},
    {"role": "user", "content": "How cold is Oslo?"},
    {"role": "assistant", "content": "", "reasoning_content": "I need the weather in Oslo first.",
     "tool_calls": [call("get_weather", {"city": "Oslo"}, 1)]},
    tool('{"temp_c": -3}', 1),
    {"role": "assistant", "content": "Oslo is at -3 degrees.", "reasoning_content": "The tool said -3."},
    {"role": "user", "content": "And in Fahrenheit?"},
    {"role": "assistant", "content": "", "reasoning_content": "Convert -3 C.",
     "tool_calls": [call("convert", {"celsius": -3}, 2)]},
    tool('{"fahrenheit": 26.6}', 2),
    {"role": "assistant", "content": "That is 26.6 F.", "reasoning_content": "26.6 it is."}]}
NO_REASONING = {"messages": [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello!"}]}
MIXED = {"messages": [  # a turn with reasoning, then one without
    {"role": "user", "content": "What is 6 times 7?"},
    {"role": "assistant", "content": "42.", "reasoning_content": "Six sevens are forty-two."},
    {"role": "user", "content": "Thanks!"}, {"role": "assistant", "content": "You are welcome."}]}
CALL_WITHOUT_CONTENT = {"tools": TOOLS, "messages": [  # OpenAI style: content null beside the call, no reasoning
    {"role": "user", "content": "Weather in Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [call("get_weather", {"city": "Rome"}, 3)]},
    tool('{"temp_c": 21}', 3), {"role": "assistant", "content": "Rome has 21 degrees."}]}
PARALLEL = {"tools": TOOLS, "messages": [  # two calls of one function in one turn
    {"role": "user", "content": "Weather in Paris and Lyon?"},
    {"role": "assistant", "content": "", "reasoning_content": "Two cities, two calls.",
     "tool_calls": [call("get_weather", {"city": "Paris"}, 4), call("get_weather", {"city": "Lyon"}, 5)]},
    tool('{"temp_c": 12}', 4), tool('{"temp_c": 15}', 5),
    {"role": "assistant", "content": "Paris 12, Lyon 15.", "reasoning_content": "Both answered."}]}
PLAIN_THEN_REASONING = {"messages": [  # an earlier answer without reasoning: gpt-oss writes <|end|> after it in
    {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},  # history, the model
    {"role": "user", "content": "Another?"},  # generated <|return|>
    {"role": "assistant", "content": "Green.", "reasoning_content": "Not blue again."}]}
ROWS = [SEVERAL_USERS, NO_REASONING, MIXED, CALL_WITHOUT_CONTENT, PLAIN_THEN_REASONING, PARALLEL]


def family_tokenizer(tiny_model_dir, family: str):
    template, specials, (tags, tags_special), eos = FAMILIES[family]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    tokenizer.add_tokens([AddedToken(tag, special=tags_special, normalized=False) for tag in tags],
                         special_tokens=tags_special)
    tokenizer.eos_token = eos
    tokenizer.chat_template = (TEMPLATES / template).read_text()
    return tokenizer


def build(tokenizer, tmp_path: Path, rows: list[dict], **flags):
    data = tmp_path / "conversations.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = DataArguments(dataset_mixer_list=[str(data), "1.0"], max_seq_length=4096, **flags)
    return build_examples(args, tokenizer, 0)


def trained_runs(tokenizer, examples) -> list[tuple[str, str]]:
    """(the text before it, the run's text) of every run of trained tokens, example after example."""
    runs = []
    for example in examples:
        assert all(label in (IGNORE_INDEX, token) for token, label in zip(example.input_ids, example.labels))
        position = 0
        for run in trained_token_runs(example.input_ids, example.labels):
            while example.labels[position] == IGNORE_INDEX or example.input_ids[position: position + len(run)] != run:
                position += 1
            runs.append((tokenizer.decode(example.input_ids[:position]), tokenizer.decode(run)))
            position += len(run)
    return runs


def stop_of(family: str, messages: list[dict], k: int) -> str:
    """The token the model generates to end assistant turn k under this family's template."""
    calls = bool(messages[k].get("tool_calls"))
    if family == "qwen3":
        return "<|im_end|>"
    if family == "gpt_oss":
        return "<|call|>" if calls else "<|return|>"
    following = messages[k + 1]["role"] if k + 1 < len(messages) else "user"  # GLM: the next turn's tag, a tool
    return "<|observation|>" if following == "tool" or calls else "<|user|>"  # result's after a call


def expected_turns(tokenizer, family: str, row: dict) -> list[tuple[str, str, str, dict]]:
    """Per assistant turn, from apply_chat_template alone: (its context, its rendering as the last message,
    the generation prompt's own text, the message). The messages as the row's conversion gives them (a null
    content beside tool calls is "")."""
    messages = to_messages(row, "messages")
    tools = messages.tools
    out = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        context = tokenizer.apply_chat_template(messages[:k], tools=tools, add_generation_prompt=True, tokenize=False)
        bare = tokenizer.apply_chat_template(messages[:k], tools=tools, tokenize=False)
        through = tokenizer.apply_chat_template(messages[: k + 1], tools=tools, tokenize=False)
        assert context.startswith(bare)
        out.append((context, through, context[len(bare):], dict(message, stop=stop_of(family, messages, k))))
    return out


def assert_trained_as_generated(tokenizer, family: str, rows: list[dict], runs: list[tuple[str, str]]) -> None:
    """Each assistant turn of `rows` is trained by exactly one run, after exactly its context, and the run is
    what the template writes after the generation prompt for the turn as the last message, through its stop
    token (GLM: the next turn's tag, which follows it); nothing else is trained."""
    turns = [turn for row in rows for turn in expected_turns(tokenizer, family, row)]
    assert len(runs) == len(turns)
    for context, through, opening, message in turns:
        matching = [run for before, run in runs if before == context]
        assert len(matching) == 1, (family, context[-200:])
        run, stop = matching[0], message["stop"]
        assert run.endswith(stop)
        body = run[: len(run) - len(stop)] if family == "glm" else run
        written = through.rstrip()
        assert written.endswith(body.rstrip()) and written[: len(written) - len(body.rstrip())].endswith(opening)
        for piece in [message.get("content") or "", message.get("reasoning_content") or ""] + [
                c["function"]["name"] for c in message.get("tool_calls") or []]:
            assert piece.strip() in run


@pytest.mark.parametrize("family", ["qwen3", "glm", "gpt_oss"])
def test_every_assistant_turn_trains_as_the_model_generates_it(tiny_model_dir, tmp_path, family) -> None:
    tokenizer = family_tokenizer(tiny_model_dir, family)
    rows = ROWS if family != "gpt_oss" else ROWS[:-1]  # its template writes one call a turn: see below
    examples, (report,) = build(tokenizer, tmp_path, rows)
    assert_trained_as_generated(tokenizer, family, rows, trained_runs(tokenizer, examples))
    assert report.rows_kept == len(rows) and not report.dropped
    assert report.examples == len(examples)
    # Qwen3 and GLM drop the reasoning of turns before the last user message: one example per user message
    # with assistant turns after it (and Qwen3 writes a think block before a last turn only); gpt-oss drops a
    # call's analysis once a final answer follows, so each answer after calls makes an example of its own
    expected = {"qwen3": [2, 1, 2, 2, 2, 1], "glm": [2, 1, 2, 1, 1, 1], "gpt_oss": [2, 1, 2, 1, 2]}[family]
    assert report.examples == sum(expected)
    assert report.rows_split == sum(count > 1 for count in expected)
    # what the split costs: the tokens of the examples before each split conversation's last (the context they
    # repeat); under Qwen3 and GLM the last is the one rendering of the whole conversation (GLM's examples end
    # with the tag of the turn that follows, one token more)
    lengths = iter(len(example.input_ids) for example in examples)
    per_row = [[next(lengths) for _ in range(count)] for count in expected]
    assert report.split_extra_tokens == sum(sum(row[:-1]) for row in per_row) > 0
    if family != "gpt_oss":  # (gpt-oss's last example keeps the analysis of calls its one rendering drops)
        one_rendering = sum(len(tokenizer(tokenizer.apply_chat_template(m, tools=m.tools, tokenize=False),
                                          add_special_tokens=False)["input_ids"])
                            for m in map(to_messages, rows, repeat("messages")))
        assert report.split_extra_tokens == report.tokens - one_rendering - (len(rows) if family == "glm" else 0)


def test_glm_a_tool_call_that_ends_the_row_stops_at_the_observation_tag(tiny_model_dir, tmp_path) -> None:
    """GLM-4.5's template writes no end-of-turn token: a turn trains through the tag of the turn that follows, which
    the model generates to stop, and after a tool call that is <|observation|>. A call that ends the row (single-turn
    function-calling sets, truncated agent traces), or whose result is the row's last message (left out: it trains
    nothing), trained <|user|> instead, and one dataset taught both after calls."""
    tokenizer = family_tokenizer(tiny_model_dir, "glm")
    def asked(city: str) -> list[dict]:
        calling = [call("get_weather", {"city": city}, 6)]
        return [{"role": "user", "content": f"Weather in {city}?"},
                {"role": "assistant", "content": None, "tool_calls": calling}]

    rows = [{"tools": TOOLS, "messages": asked("Bern")}, {"tools": TOOLS, "messages": asked("Chur") + [tool("5", 6)]},
            {"tools": TOOLS, "messages": asked("Sion") + [tool("5", 6), {"role": "assistant", "content": "5 C."}]}]
    examples, _ = build(tokenizer, tmp_path, rows)
    runs = trained_runs(tokenizer, examples)
    assert_trained_as_generated(tokenizer, "glm", rows, runs)
    assert [run.endswith("</tool_call><|observation|>") for _, run in runs] == [True, True, True, False]
    assert runs[3][1].endswith("5 C.<|user|>")


def test_parallel_calls_a_template_writes_only_the_first_of_are_a_named_bad_row(tiny_model_dir, tmp_path) -> None:
    """gpt-oss's template writes the first of a turn's tool calls only: such a row is refused with its line
    and reason, or dropped and counted; the others train."""
    tokenizer = family_tokenizer(tiny_model_dir, "gpt_oss")
    with pytest.raises(UserError, match=r"conversations.jsonl line 6: message 2 \(assistant, with tool calls\): the "
                                        r"chat template does not write its tool calls \(get_weather"):
        build(tokenizer, tmp_path, ROWS)
    examples, (report,) = build(tokenizer, tmp_path, ROWS, on_bad_row="drop")
    assert dict(report.dropped) == {"tool_calls_not_rendered": 1} and report.rows_kept == 5
    assert_trained_as_generated(tokenizer, "gpt_oss", ROWS[:-1], trained_runs(tokenizer, examples))


@pytest.mark.parametrize("family", ["qwen3", "glm"])
def test_reasoning_loss_mask_keeps_the_trace_in_the_context(tiny_model_dir, tmp_path, family) -> None:
    """--reasoning_loss mask: the same examples, the reasoning text untrained, everything else as before."""
    tokenizer = family_tokenizer(tiny_model_dir, family)
    trained, (_,) = build(tokenizer, tmp_path, [SEVERAL_USERS])
    masked, (_,) = build(tokenizer, tmp_path, [SEVERAL_USERS], reasoning_loss="mask")
    assert [e.input_ids for e in masked] == [e.input_ids for e in trained]
    whole = "".join(run for _, run in trained_runs(tokenizer, trained))
    less = "".join(run for _, run in trained_runs(tokenizer, masked))
    traces = [m["reasoning_content"].strip() for m in SEVERAL_USERS["messages"] if m.get("reasoning_content")]
    assert all(trace in whole and trace not in less for trace in traces)
    for trace in traces:
        whole = whole.replace(trace, "", 1)
    assert whole == less


def test_enable_thinking_false_puts_the_empty_think_block_in_the_context(tiny_model_dir, tmp_path) -> None:
    """--chat_template_kwargs reach every render: Qwen3 with enable_thinking false writes the empty think block
    into the generation prompt, so it is context and the answer alone trains (with the template's default the
    model writes the block: it trains)."""
    tokenizer = family_tokenizer(tiny_model_dir, "qwen3")
    default, _ = build(tokenizer, tmp_path, [NO_REASONING])
    off, _ = build(tokenizer, tmp_path, [NO_REASONING], chat_template_kwargs='{"enable_thinking": false}')
    assert [run for _, run in trained_runs(tokenizer, default)] == ["<think>\n\n</think>\n\nHello!<|im_end|>"]
    ((before, run),) = trained_runs(tokenizer, off)
    assert run == "Hello!<|im_end|>" and before.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert before == tokenizer.apply_chat_template(NO_REASONING["messages"][:1], add_generation_prompt=True,
                                                   tokenize=False, enable_thinking=False)


@pytest.mark.parametrize("family", ["qwen3", "glm"])
def test_reasoning_on_a_turn_whose_generation_prompt_closes_the_think_block(tiny_model_dir, tmp_path, caplog,
                                                                             family) -> None:
    """enable_thinking false puts an empty think block into the generation prompt (Qwen3's, GLM-4.5's templates), yet
    the templates write a row's reasoning: trained after the part of that prompt they share, it had a context the
    model never sees. The turn trains as the model generates it there, its answer after that very prompt, and such
    rows are counted and warned about (not as reasoning the template does not write)."""
    tokenizer = family_tokenizer(tiny_model_dir, family)
    row = {"messages": MIXED["messages"][:2]}
    with caplog.at_level("WARNING"):
        examples, (report,) = build(tokenizer, tmp_path, [NO_REASONING, row],
                                    chat_template_kwargs='{"enable_thinking": false}')
    (_, (before, run)) = trained_runs(tokenizer, examples)
    assert before == tokenizer.apply_chat_template(row["messages"][:1], add_generation_prompt=True, tokenize=False,
                                                   enable_thinking=False)
    assert run.strip() == "42." + stop_of(family, row["messages"], 1)
    assert report.reasoning_closed_by_prompt == 1 and report.reasoning_not_rendered == 0
    assert "Six sevens" not in "".join(tokenizer.decode(e.input_ids) for e in examples)
    warned = [r.getMessage() for r in caplog.records if "empty think block" in r.getMessage()]
    assert len(warned) == 1 and "1 row(s)" in warned[0] and "line 2" in warned[0]
    _, (report,) = build(tokenizer, tmp_path, [row])  # the template's default: the reasoning trains
    assert report.reasoning_closed_by_prompt == 0 and report.reasoning_not_rendered == 0


def test_reasoning_a_template_does_not_write_is_counted_and_named(tiny_model_dir, tmp_path, caplog) -> None:
    """An instruct-only template (chatml) writes no reasoning: the rows train without it, counted per source
    in the data report and warned about once with the first rows named, never dropped without a word."""
    from open_sft.data.chat.templates import apply_chat_template_choice

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    apply_chat_template_choice(tokenizer, "chatml", None)
    with caplog.at_level("WARNING"):
        examples, (report,) = build(tokenizer, tmp_path, [NO_REASONING, MIXED, MIXED])
    assert report.reasoning_not_rendered == 2 and report.to_dict()["reasoning_not_rendered"] == 2
    warned = [r.getMessage() for r in caplog.records if "reasoning" in r.getMessage()]
    assert len(warned) == 1 and "2 row(s)" in warned[0] and "line 2; " in warned[0] and "line 3" in warned[0]
    assert "Six sevens" not in "".join(tokenizer.decode(e.input_ids) for e in examples)


# DeepSeek-R1 distills' construct (written here): every assistant content is kept only after its `</think>`
R1_STYLE = ("{{- bos_token }}{%- for m in messages %}{%- if m.role == 'user' %}{{- '<|user|>' + m.content }}"
            "{%- elif m.role == 'assistant' %}{%- set content = m.content %}{%- if '</think>' in content %}"
            "{%- set content = content.split('</think>')[-1] %}{%- endif %}{{- '<|assistant|>' + content + eos_token }}"
            "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|assistant|><think>\\n' }}{%- endif %}")


def test_reasoning_in_the_content_that_the_template_drops_trains_after_the_opened_block(tiny_model_dir, tmp_path,
                                                                                       caplog) -> None:
    """A trace written in the content (`<think>trace</think>answer`, as R1 distills' data carries it) under a template
    that keeps only the answer after `</think>` (R1 distills' own construct) and opens `<think>` in its generation
    prompt: the turn trains its trace, `</think>` and the answer after that prompt (chat/opened_trace.py; it trained
    the answer alone, and the rows were counted as reasoning the template does not write), counted and named as
    such; under a template that writes it (chatml), neither."""
    from open_sft.data.chat.templates import apply_chat_template_choice

    inline = {"messages": [{"role": "user", "content": "What is 6 times 7?"},
                           {"role": "assistant", "content": "<think>\nSix sevens are forty-two.\n</think>\n\n42."}]}
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = R1_STYLE
    with caplog.at_level("WARNING"):
        examples, (report,) = build(tokenizer, tmp_path, [NO_REASONING, inline, inline])
    assert (report.reasoning_not_rendered, report.reasoning_opened_by_prompt) == (0, 3)
    runs = trained_runs(tokenizer, examples)
    assert runs[1] == (tokenizer.bos_token + "<|user|>What is 6 times 7?<|assistant|><think>\n",
                       "Six sevens are forty-two.\n</think>\n\n42." + tokenizer.eos_token)
    warned = [r.getMessage() for r in caplog.records if "line 2; " in r.getMessage() and "<think>" in r.getMessage()]
    assert len(warned) == 1 and "generation prompt opens a think block" in warned[0]
    apply_chat_template_choice(tokenizer, "chatml", None)
    _, (report,) = build(tokenizer, tmp_path, [NO_REASONING, inline])
    assert (report.reasoning_not_rendered, report.reasoning_opened_by_prompt) == (0, 0)


def test_think_tags_a_template_writes_as_the_answers_text_are_counted(tiny_model_dir, tmp_path, caplog) -> None:
    """An R1-style row (`<think>trace</think>answer` in the content) under gpt-oss's template, which writes reasoning
    in its analysis channel, not with think tags: the content trains as it is in the final channel, so the model
    learns literal think tags in its answers. Counted per source and warned with the fix; not under Qwen3's (think
    tags are its own), nor for the trace given as reasoning_content."""
    inline = {"messages": [{"role": "user", "content": "What is 3+3?"},
                           {"role": "assistant", "content": "<think>\nThree and three: six.\n</think>\n\n6."}]}
    field = {"messages": [{"role": "user", "content": "What is 3+3?"},
                          {"role": "assistant", "content": "6.", "reasoning_content": "Three and three: six."}]}
    with caplog.at_level("WARNING"):
        examples, (report,) = build(family_tokenizer(tiny_model_dir, "gpt_oss"), tmp_path, [field, inline, inline])
    assert report.reasoning_tags_as_text == 2 and report.to_dict()["reasoning_tags_as_text"] == 2
    assert report.reasoning_not_rendered == 0
    warned = [r.getMessage() for r in caplog.records if "think tags in its answer" in r.getMessage()]
    assert len(warned) == 1 and "2 row(s)" in warned[0] and "line 2; " in warned[0] \
        and "give the trace as reasoning_content" in warned[0]
    _, (report,) = build(family_tokenizer(tiny_model_dir, "qwen3"), tmp_path, [field, inline])
    assert report.reasoning_tags_as_text == 0


# A training template in TRL's manner: Qwen3's turns with every turn's reasoning kept and `{% generation %}`
# around what the assistant writes (written here).
GENERATION_TAGS = (
    "{%- for m in messages %}{%- if m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}{%- generation %}"
    "{%- if m.reasoning_content %}{{- '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- m.content + '<|im_end|>' }}{%- endgeneration %}{{- '\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def test_generation_tags_are_accepted_and_a_second_opinion(tiny_model_dir, tmp_path, caplog) -> None:
    """`{% generation %}` passes the template check and renders as transformers renders it; where the spans it
    marks are the labels, nothing is reported; where they differ (here: a block that leaves the end-of-turn
    token out), the rows are counted in the data report and named."""
    from open_sft.data.chat.templates import apply_chat_template_choice

    tokenizer = family_tokenizer(tiny_model_dir, "qwen3")
    path = tmp_path / "tagged.jinja"
    path.write_text(GENERATION_TAGS)
    apply_chat_template_choice(tokenizer, None, str(path))  # a syntax error would raise here
    examples, (report,) = build(tokenizer, tmp_path, [MIXED, NO_REASONING])
    assert report.generation_tags_disagree == 0 and len(examples) == 2  # the reasoning is kept: one example a row
    assert [run for _, run in trained_runs(tokenizer, examples)] == [
        "<think>\nSix sevens are forty-two.\n</think>\n\n42.<|im_end|>", "You are welcome.<|im_end|>",
        "Hello!<|im_end|>"]
    path.write_text(GENERATION_TAGS.replace("{{- m.content + '<|im_end|>' }}{%- endgeneration %}",
                                            "{{- m.content }}{%- endgeneration %}{{- '<|im_end|>' }}"))
    apply_chat_template_choice(tokenizer, None, str(path))
    with caplog.at_level("WARNING"):
        _, (report,) = build(tokenizer, tmp_path, [MIXED, NO_REASONING])
    assert report.generation_tags_disagree == 2
    assert any("{% generation %}" in r.getMessage() and "line 1; " in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("family", ["qwen3", "glm", "gpt_oss"])
def test_exported_generation_config_stops_where_training_ended_turns(tiny_model_dir, family) -> None:
    """generation_config.json's eos ids are what the trained turns end with, so generate/chat stop there."""
    from open_sft.export.save import end_of_turn_ids

    tokenizer = family_tokenizer(tiny_model_dir, family)
    stops = {"qwen3": ["<|im_end|>"], "glm": ["<|endoftext|>", "<|user|>", "<|observation|>"],
             "gpt_oss": ["<|return|>", "<|call|>"]}[family]
    assert end_of_turn_ids(tokenizer) == tokenizer.convert_tokens_to_ids(stops)


@pytest.mark.parametrize("family", ["qwen3", "glm", "gpt_oss"])
def test_reasoning_history_keep_makes_one_example_a_conversation(tiny_model_dir, tmp_path, family) -> None:
    """--reasoning_history keep: each conversation is one example; every turn trains exactly as under the
    template's own history (the same runs), and the turns of the first example keep their exact context; later
    turns see the earlier ones as generated (their reasoning kept), and the whole costs fewer tokens."""
    tokenizer = family_tokenizer(tiny_model_dir, family)
    rows = [SEVERAL_USERS, MIXED]
    default, (split,) = build(tokenizer, tmp_path, rows)
    kept, (report,) = build(tokenizer, tmp_path, rows, reasoning_history="keep")
    assert len(kept) == len(rows) and report.rows_split == 0 and report.reasoning_history_not_kept == 0
    assert sorted(run for _, run in trained_runs(tokenizer, kept)) == sorted(run for _, run in trained_runs(tokenizer, default))
    assert report.tokens < split.tokens
    text = tokenizer.decode(kept[0].input_ids)
    first_turn = SEVERAL_USERS["messages"][2]
    assert text.startswith(expected_turns(tokenizer, family, SEVERAL_USERS)[0][0])  # its context, as rendered
    # the earlier segment's reasoning stays in the context of the later turns
    assert first_turn["reasoning_content"] in text and text.index(first_turn["reasoning_content"]) < text.index(
        "And in Fahrenheit?")


@pytest.mark.parametrize("family", ["qwen3", "glm"])
def test_reasoning_history_keep_joins_turns_whose_trace_is_written_in_the_content(tiny_model_dir, tmp_path,
                                                                                   family) -> None:
    """--reasoning_history keep with traces written in the content (`<think>trace</think>answer`, as R1-style
    datasets carry them), which the template reads as reasoning and keeps only the answer of in history: the
    conversation is one example too (the earlier turn's end was looked for by its whole content, trace and all,
    and the rows were counted reasoning_history_not_kept), training the same runs as the template's examples."""
    tokenizer = family_tokenizer(tiny_model_dir, family)
    inline = {"messages": [dict(message) for message in MIXED["messages"]]}
    first = inline["messages"][1]
    first["content"] = f"<think>\n{first.pop('reasoning_content')}\n</think>\n\n{first['content']}"
    default, _ = build(tokenizer, tmp_path, [inline])
    kept, (report,) = build(tokenizer, tmp_path, [inline], reasoning_history="keep")
    assert report.reasoning_history_not_kept == 0 and len(default) == 2 and len(kept) == 1
    runs = (sorted(run for _, run in trained_runs(tokenizer, examples)) for examples in (kept, default))
    assert next(runs) == next(runs)
    assert "Six sevens are forty-two." in tokenizer.decode(kept[0].input_ids)


def test_chat_template_kwargs_per_source_for_a_hybrid_mixture(tiny_model_dir, tmp_path) -> None:
    """A YAML mixer entry may carry its own chat_template_kwargs: thinking and non-thinking sources in one mixture,
    each rendered as the template renders it (Qwen3 with enable_thinking false: the empty think block is in the
    generation prompt, context); the variables enter the cache key per source."""
    from open_sft.config.parse import parse_config
    from open_sft.data.cache_inputs import key_inputs

    tokenizer = family_tokenizer(tiny_model_dir, "qwen3")
    thinking, plain = tmp_path / "thinking.jsonl", tmp_path / "plain.jsonl"
    thinking.write_text(json.dumps(MIXED) + "\n")
    plain.write_text(json.dumps(NO_REASONING) + "\n")
    config = tmp_path / "mix.yaml"
    config.write_text(f"model_name_or_path: {tiny_model_dir}\nmax_seq_length: 4096\ndataset_mixer_list:\n"
                      f"  - {{name: {thinking}, amount: 1.0}}\n"
                      f"  - {{name: {plain}, amount: 1.0, chat_template_kwargs: {{enable_thinking: false}}}}\n")
    data = parse_config([str(config)]).data
    assert data.dataset_mixer_list == [str(thinking), "1.0", str(plain), "1.0"]
    examples, reports = build_examples(data, tokenizer, 0)
    runs = trained_runs(tokenizer, examples)
    assert [report.examples for report in reports] == [2, 1]
    assert runs[-1][1] == "Hello!<|im_end|>" and runs[-1][0].endswith("assistant\n<think>\n\n</think>\n\n")
    assert runs[0][1].startswith("<think>\nSix sevens")  # the thinking source as the template's default renders it
    sources = key_inputs(data, tokenizer, 0)["sources"]
    assert [s.get("chat_template_kwargs") for s in sources] == [None, '{"enable_thinking": false}']


def test_a_tool_schema_without_the_key_the_template_writes_is_named(tiny_model_dir, tmp_path) -> None:
    """gpt-oss's template writes each schema's description: a schema without one fails inside the template with
    `'dict object' has no attribute 'description'`; the error says which key each schema needs, and which lack it."""
    from open_sft.export.tool_schemas import check_written

    tokenizer = family_tokenizer(tiny_model_dir, "gpt_oss")
    bare = [{"type": "function", "function": {k: v for k, v in TOOLS[0]["function"].items() if k != "description"}}]
    row = {"tools": bare, "messages": [{"role": "user", "content": "How cold is Oslo?"},
                                       {"role": "assistant", "content": "Cold."}]}
    hint = "each tool schema needs 'description' under this template (without it: get_weather)"
    with pytest.raises(UserError, match=r"conversations.jsonl line 1: the chat template rejects this conversation "
                                        r"\('dict object' has no attribute 'description'; " + re.escape(hint)):
        build(tokenizer, tmp_path, [row])
    with pytest.raises(UserError, match=re.escape(f"no attribute 'description'; {hint})")):
        check_written(tokenizer, bare, "--tools t.json")
    check_written(tokenizer, TOOLS, "--tools t.json")
