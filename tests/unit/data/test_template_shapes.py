"""Labels under chat-template shapes found in real models' templates (each written here in a few lines,
in the style of the original): a final turn written after an empty think block (Qwen3), eos only after
the final turn (Phi-3), a conversation that opens with the assistant, a tool-use template that
assumes a `tools` list, and one that assigns to a message's attribute (llama.cpp's MiroThinker-v1 form). Trained
tokens are checked by decoding them, on the layout path (the row's shape rendered once with placeholders) and on the per-row path (a row with tools, which has no layout)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from open_sft.config.args import DataArguments
from open_sft.data.formats import Conversation
from open_sft.data.build import build_examples
from open_sft.data.chat.examples import row_examples
from open_sft.data.chat.render import special_markers
from open_sft.data.labels import IGNORE_INDEX, label_and_check, trained_token_runs
from open_sft.errors import UserError

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]

# Qwen3: the answer after the last user turn is written after an empty think block (earlier ones are not).
THINK_LAST = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n' }}{%- for t in tools %}{{- t | tojson }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}{%- if m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if loop.last %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{{- m.content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Phi-3: every turn ends with <|end|>; eos follows only when no generation prompt is asked for.
EOS_AT_THE_END = (
    "{% for m in messages %}{{ '<|' + m.role + '|>\\n' + m.content + '<|end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"
)
# Hermes-style tool-use template: iterates `tools` without asking whether there are any.
NEEDS_TOOLS = "{%- for t in tools %}{{- t.function.name }}{%- endfor %}" + EOS_AT_THE_END


@pytest.fixture()
def tokenizer(tiny_model_dir):
    """A fresh copy of the tiny tokenizer with the special tokens these templates use (<think> is not
    one of them: the think block is spelled with ordinary tokens, so a misplaced span could decode right)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|end|>"]})
    return tokenizer


def trained(tokenizer, rows: list, train_on: str = "all_assistant") -> list[list[str]]:
    """Per row, the decoded runs of trained tokens of its examples, in order; the labels must pass open_sft's
    own check."""
    markers = special_markers(tokenizer)
    rendered = [row_examples(tokenizer, r, train_on, markers).examples for r in rows]
    examples, right = label_and_check(tokenizer, [example for row in rendered for example in row])
    assert all(right)
    for example in examples:
        assert all(label in (IGNORE_INDEX, token) for token, label in zip(example.input_ids, example.labels))
    runs = iter([tokenizer.decode(run) for run in trained_token_runs(e.input_ids, e.labels)] for e in examples)
    return [[run for _ in row for run in next(runs)] for row in rendered]


def example_count(tokenizer, row: list, train_on: str = "all_assistant") -> int:
    return len(row_examples(tokenizer, row, train_on, special_markers(tokenizer)).examples)


def with_tools(messages: list) -> Conversation:
    conversation = Conversation(messages)
    conversation.tools = TOOLS
    return conversation


def chat(*turns: str, system: str | None = None) -> list[dict]:
    """user, assistant, user, assistant, ... (with a system prompt first, if given)."""
    roles = ["user", "assistant"] * len(turns)
    messages = [{"role": role, "content": text} for role, text in zip(roles, turns)]
    return ([{"role": "system", "content": system}] if system else []) + messages


@pytest.mark.parametrize("answer", ["think", "n", "k", "<think>", "4", "thinking about it"])
def test_an_empty_think_block_the_template_writes_before_a_final_answer_is_trained_with_it(tokenizer,
                                                                                          answer) -> None:
    """Qwen3's template writes an empty think block before the answer after the last user message, and none
    before earlier answers: the model generates that block after the generation prompt, so it trains with the
    answer, and a two-turn conversation makes two examples, each answer after the context the template gives
    it at that point (the earlier one without the block before it in history)."""
    tokenizer.chat_template = THINK_LAST
    rows = [chat("Say it.", answer), chat("Say it.", answer, "Again.", answer)]
    block = "<think>\n\n</think>\n\n"
    expected = [[block + answer + "<|im_end|>"], [block + answer + "<|im_end|>", block + answer + "<|im_end|>"]]
    assert trained(tokenizer, rows) == expected  # layout path
    assert trained(tokenizer, [with_tools(r) for r in rows]) == expected  # per-row path
    assert trained(tokenizer, [with_tools(r) for r in rows], "last_assistant") == [[e[-1]] for e in expected]
    assert [example_count(tokenizer, r) for r in rows] == [1, 2]
    (first, _), (second, _) = row_examples(tokenizer, rows[1], "all_assistant", special_markers(tokenizer)).examples
    assert first == tokenizer.apply_chat_template(rows[1][:2], tokenize=False)
    assert second == tokenizer.apply_chat_template(rows[1], tokenize=False)  # the first answer as in history
    assert "<|im_start|>assistant\n" + answer + "<|im_end|>" in second


def test_eos_written_only_after_the_final_turn(tokenizer) -> None:
    """Phi-3's template is not prefix-stable (rendering the first turn alone ends it with eos): every
    assistant turn trains its content and <|end|>, the final one also the eos the template closes with."""
    tokenizer.chat_template = EOS_AT_THE_END
    eos = tokenizer.eos_token
    rows = [chat("Hi", "Hello!", "2+2?", "4", system="Be brief."), chat("Hi", "Hello!")]
    expected = [["Hello!<|end|>", f"4<|end|>\n{eos}"], [f"Hello!<|end|>\n{eos}"]]
    assert trained(tokenizer, rows) == expected
    assert trained(tokenizer, [with_tools(r) for r in rows]) == expected
    assert trained(tokenizer, rows, "last_assistant") == [[f"4<|end|>\n{eos}"], [f"Hello!<|end|>\n{eos}"]]


# ChatML as Qwen2.5's and Hermes' templates write it: each content as it is, leading whitespace too.
AS_IS = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"
         "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# DeepSeek-V3.1's: the generation prompt closes the think block, and a turn keeps what follows the `</think>` of a
# trace written in its content, as it is (R1-style data: the "\\n\\n" before the answer).
AFTER_THINK = ("{% for m in messages %}{% if m.role == 'user' %}{{ '<|im_start|>' + m.content }}{% else %}"
               "{% set c = m.content %}{% if '</think>' in c %}{% set c = c.split('</think>', 1)[1] %}{% endif %}"
               "{{ '<|end|></think>' + c + '<|im_end|>' }}{% endif %}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|end|></think>' }}{% endif %}")


@pytest.mark.parametrize(("template", "content", "written"), [
    ("as_is", "\n\nHello there.", "\n\nHello there.<|im_end|>"),
    ("as_is", " Hello there.", " Hello there.<|im_end|>"),
    ("after_think", "<think>\nThree and three.\n</think>\n\n6.", "\n\n6.<|im_end|>"),
    ("mistral_v0_3", "\n\nHello there.", " \n\nHello there.</s>"),  # its space after [/INST] too
    ("mistral_v0_3", "Hello there.", " Hello there.</s>")])
def test_whitespace_the_template_writes_after_the_generation_prompt_is_trained(tokenizer, template, content,
                                                                               written) -> None:
    """Everything the template writes after the generation prompt is what the model generates, whitespace
    opening a content too (a scraped answer's leading newline, R1-style data's "\\n\\n" after `</think>`):
    it trained as context in a row's one rendering (the model never learned to write it), though a turn
    trained turn by turn had it. Now both paths train it, as apply_chat_template writes it."""
    from tests.unit.data.test_reasoning_tool_calls import TEMPLATES

    if template == "mistral_v0_3":
        tokenizer.add_special_tokens({"bos_token": "<s>", "eos_token": "</s>",
                                      "additional_special_tokens": ["[INST]", "[/INST]"]})
    tokenizer.chat_template = {"as_is": AS_IS, "after_think": AFTER_THINK}.get(template) or (
        TEMPLATES / "mistral_v0_3.jinja").read_text()
    rows = [chat("Hi", content), chat("Hi", content, "Again.", content)]
    for row in rows:  # the oracle: the text after the generation prompt, as transformers renders it
        for k in range(1, len(row), 2):
            prompt = tokenizer.apply_chat_template(row[:k], tokenize=False, add_generation_prompt=True)
            through = tokenizer.apply_chat_template(row[: k + 1], tokenize=False)
            assert through.startswith(prompt + written)
    assert trained(tokenizer, rows) == [[written], [written, written]]  # one rendering
    assert trained(tokenizer, [with_tools(row) for row in rows]) == [[written], [written, written]]  # turn by turn


@pytest.mark.parametrize("template", ["embedded", "think_last", "eos_at_the_end"])
def test_a_conversation_may_open_with_the_assistant(tokenizer, template, monkeypatch) -> None:
    """An assistant turn with nothing before it (a greeting) is located without rendering an empty
    conversation, which apply_chat_template refuses; also with the public renderer."""
    from open_sft.data.chat import render as render_module

    if template != "embedded":
        tokenizer.chat_template = THINK_LAST if template == "think_last" else EOS_AT_THE_END
    row = [{"role": "assistant", "content": "Hello, how can I help?"}, {"role": "user", "content": "2+2?"},
           {"role": "assistant", "content": "4"}]
    runs = trained(tokenizer, [row])[0]
    answer = "<think>\n\n</think>\n\n4" if template == "think_last" else "4"  # the block the model writes too
    assert [run.startswith(content) for run, content in zip(runs, ["Hello, how can I help?", answer])] == [True, True]
    state = render_module.template_state(tokenizer)
    monkeypatch.setattr(state, "draw", render_module._guarded(render_module._public_renderer(tokenizer)))
    monkeypatch.setattr(render_module, "text_and_ends", lambda state, m: (state.draw(m, False, None), None))
    assert trained(tokenizer, [row]) == [runs]


def test_a_template_that_fails_on_a_row_makes_it_a_bad_row(tokenizer, tmp_path) -> None:
    """A template error that is not Jinja's own (a TypeError iterating tools the row does not have) stops
    the run with the row's line, the template's message and what the template needs (it renders the row given a
    tools list: the row is fine), or drops and counts the row: never a crash."""
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(json.dumps(row) for row in [
        {"messages": chat("Hi", "Hello!"), "tools": TOOLS}, {"messages": chat("Hi", "Hello!")},
        {"messages": chat("2+2?", "4"), "tools": TOOLS}]) + "\n")
    tokenizer.chat_template = NEEDS_TOOLS
    args = dict(dataset_mixer_list=[str(data), "1.0"])
    with pytest.raises(UserError, match=r"rows.jsonl line 2: the chat template cannot render a conversation without "
                                        r"tools \(TypeError: 'NoneType' object is not iterable; .*the template "
                                        r"needs a tools list"):
        build_examples(DataArguments(**args), tokenizer, 0)
    examples, reports = build_examples(DataArguments(**args, on_bad_row="drop"), tokenizer, 0)
    assert len(examples) == 2 and dict(reports[0].dropped) == {"template_needs_tools": 1}


ASSIGNS_ATTRIBUTE = (  # the shape of llama.cpp's MiroThinker-v1.jinja: it sets attributes of messages
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}\n{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}\n"
    "{%- set ns = namespace(seen=0) %}{%- set ns.seen = 1 %}\n"
    "{%- for message in messages %}{%- if message.role == 'assistant' %}{%- set message.tool_calls = [] %}"
    "{%- endif %}{%- endfor %}")


def test_a_template_that_assigns_to_a_message_attribute_names_the_statement(tokenizer, tmp_path) -> None:
    """Jinja2 (transformers) refuses `{% set message.x = … %}`, which llama.cpp's engine runs: every row failed with
    'fix the row'. The error names the statement and its line, says the row is fine and how to give a Jinja2 form;
    under --on_bad_row drop such rows count as template_not_jinja2."""
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"messages": chat("Hi", "Hello!")}) + "\n")
    tokenizer.chat_template = ASSIGNS_ATTRIBUTE
    args = dict(dataset_mixer_list=[str(data), "1.0"])
    with pytest.raises(UserError) as raised:
        build_examples(DataArguments(**args), tokenizer, 0)
    message = str(raised.value)
    assert "rows.jsonl line 1: the chat template assigns to an attribute" in message
    assert "{% set message.tool_calls = … %} (line 4)" in message and "the row is fine" in message
    assert "ns.seen" not in message and "--chat_template_path" in message
    assert "--on_bad_row" not in message  # a way on that drops every row is none
    with pytest.raises(UserError, match="template_not_jinja2 1"):
        build_examples(DataArguments(**args, on_bad_row="drop"), tokenizer, 0)


def test_a_content_written_twice_by_a_content_reading_template_trains_all_it_writes(tokenizer) -> None:
    """A template that reads the content and writes more for some (here, the content twice): the turn is
    everything the template writes after the generation prompt, which is what the model will generate."""
    tokenizer.chat_template = EOS_AT_THE_END.replace("m.content + '<|end|>", "m.content + (' / ' + m.content "
                                                     "if m.content == 'twice' else '') + '<|end|>")
    assert trained(tokenizer, [with_tools(chat("Say it twice.", "twice"))]) == [[f"twice / twice<|end|>\n{tokenizer.eos_token}"]]


# Qwen-style tool calls (and a reasoning trace) written from the message's own fields, not its content.
TOOL_CALLING = (
    "{%- for m in messages %}{%- if m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if loop.last and THINK %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- if m.reasoning_content %}{{- '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- m.content }}{%- for call in m.tool_calls or [] %}{{- '\\n<tool_call>\\n' + {'name': call.function.name, "
    "'arguments': call.function.arguments} | tojson + '\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + "
    "'\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
CALLING_ROW = {"messages": [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},  # OpenAI style: no content
    {"role": "tool", "content": '{"temp_c": -3}', "tool_call_id": "call_1"},
    {"role": "assistant", "content": "It is -3 °C in Oslo."}], "tools": TOOLS}


@pytest.mark.parametrize("think", [False, True])
def test_tool_calls_are_trained_as_the_template_writes_them(tokenizer, think) -> None:
    """An assistant turn with tool calls trains what the template writes of them and its end of turn
    (the content is empty, so it cannot locate the turn); the tool's answer is not trained. Also when
    the final turn is written differently from the same turn further back (think=True: not prefix-stable)."""
    from open_sft.data.formats import to_messages

    tokenizer.chat_template = TOOL_CALLING.replace("THINK", "true" if think else "false")
    call_text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>'
    messages = to_messages(CALLING_ROW, "messages")
    assert messages[1] == {"role": "assistant", "content": "", "tool_calls": [CALL]}
    assert messages[2]["tool_call_id"] == "call_1"
    block = "<think>\n\n</think>\n\n" if think else ""  # written before the turn after the last user message
    # (the template's newline before a call: the model writes it too)
    assert trained(tokenizer, [messages]) == [[block + "\n" + call_text, block + "It is -3 °C in Oslo.<|im_end|>"]]
    assert example_count(tokenizer, messages) == (2 if think else 1)
    last_call = to_messages({"messages": CALLING_ROW["messages"][:2]}, "messages")  # a row may end with a call
    assert trained(tokenizer, [last_call]) == [[block + "\n" + call_text]]
    reasoning = to_messages({"messages": [{"role": "user", "content": "2+2?"}, {
        "role": "assistant", "content": "4", "reasoning_content": "Two and two make four."}]}, "messages")
    assert trained(tokenizer, [reasoning]) == [[block + "<think>\nTwo and two make four.\n</think>\n\n4<|im_end|>"]]


def test_null_message_fields_are_left_out(tokenizer) -> None:
    """A column read with Arrow gives every message every key, most of them null or empty: such a row
    is the row without them (the template is not asked about tool calls that are null)."""
    from open_sft.data.formats import to_messages

    tokenizer.chat_template = TOOL_CALLING.replace("THINK", "false")
    padded = [dict(m, tool_calls=m.get("tool_calls", []), tool_call_id=m.get("tool_call_id"), name=None)
              for m in CALLING_ROW["messages"]]
    assert to_messages({"messages": padded}, "messages") == to_messages(CALLING_ROW, "messages")


def test_tool_calls_a_template_does_not_write_are_not_silently_lost(tokenizer, tmp_path) -> None:
    """The tiny model's template writes contents only: a row with tool calls is a bad row (the calls
    would not be trained), with the line and the fix, or dropped and counted; bad tool_calls are named."""
    data = tmp_path / "calls.jsonl"
    rows = [{"messages": CALLING_ROW["messages"][:2]}, {"messages": chat("Hi", "Hello!")},
            {"messages": [{"role": "user", "content": "x", "tool_calls": [CALL]}, {"role": "assistant", "content": "y"}]},
            {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": "f()"}]}]
    args = dict(dataset_mixer_list=[str(data), "1.0"])
    for lines, message in [
        (rows[:2], r"calls.jsonl line 1: message 2 \(assistant, with tool calls\): the chat template does not write "
                   r"its tool calls \(get_weather: some or all of them, or their arguments\); use a template "
                   r"that renders them"),
        (rows[1:], r"calls.jsonl line 2: message 1 \(user\) has tool_calls of type list; only assistant messages "
                   r"have tool_calls, a list of"),
        (rows[3:], r"calls.jsonl line 1: message 2 \(assistant\) has tool_calls of type str")]:
        data.write_text("\n".join(json.dumps(row) for row in lines) + "\n")
        with pytest.raises(UserError, match=message):
            build_examples(DataArguments(**args), tokenizer, 0)
    data.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    examples, reports = build_examples(DataArguments(**args, on_bad_row="drop"), tokenizer, 0)
    assert len(examples) == 1
    assert dict(reports[0].dropped) == {"tool_calls_not_rendered": 1, "bad_tool_calls": 2}


def test_a_turn_closer_that_is_not_one_token_is_warned_about_with_the_fix(tiny_model_dir, caplog) -> None:
    """A tokenizer's own chatml-like template whose <|turn_over|> is not in the vocabulary: it trains as pieces and
    generation cannot stop at it, so a warning names it, its pieces and the flags that fix it; none once the token
    is added, nor for a template that adds its tokens (chatml)."""
    from open_sft.data.chat.render import warn_split_turn_closers
    from open_sft.data.chat.templates import apply_chat_template_choice

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|turn_over|>\n"
                               "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with caplog.at_level("WARNING"):
        warn_split_turn_closers(tokenizer)
    warned = [r.getMessage() for r in caplog.records if "<|turn_over|>" in r.getMessage()]
    pieces = " ".join(tokenizer.tokenize("<|turn_over|>"))
    assert len(warned) == 1 and pieces in warned[0] and "--chat_template_name" in warned[0] \
        and "--add_special_tokens" in warned[0]
    caplog.clear()
    tokenizer.add_tokens(["<|turn_over|>"], special_tokens=True)
    with caplog.at_level("WARNING"):
        warn_split_turn_closers(tokenizer)
        apply_chat_template_choice(tokenizer, "chatml", None)
        warn_split_turn_closers(tokenizer)
    assert not [r for r in caplog.records if "splits into" in r.getMessage()]
