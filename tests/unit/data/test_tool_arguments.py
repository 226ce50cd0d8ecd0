"""Tool-call arguments in the form the chat template takes: the object (JSON-string arguments are handed over as
the object, for templates that write them with `tojson`), or, under a template that writes them by string
concatenation (DeepSeek-R1's and V3's '```json\\n' + arguments), the string as the row gave it."""

from __future__ import annotations

import json

import pytest

from open_sft.config.args import DataArguments
from open_sft.data.build import build_examples
from open_sft.data.chat.examples import row_examples
from open_sft.data.chat.render import special_markers
from open_sft.data.formats import to_messages
from open_sft.data.labels import trained_token_runs
from tests.unit.data.test_reasoning_tool_calls import call, family_tokenizer, tool

# DeepSeek-R1's way of writing a call, on chatml turns: string concatenation, which fails on an object
CONCATENATING = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "{{ '<tool_call>' + c.function.name + '\\n```json\\n' + c.function.arguments + '\\n```</tool_call>' }}"
    "{% endfor %}{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def weather(arguments) -> dict:
    return {"messages": [
        {"role": "user", "content": "How cold is Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [call("get_weather", arguments, 1)]},
        tool('{"temp_c": -3}', 1), {"role": "assistant", "content": "It is -3 in Oslo."}]}


@pytest.fixture
def concatenating(tiny_model_dir):
    tokenizer = family_tokenizer(tiny_model_dir, "qwen3")
    tokenizer.chat_template = CONCATENATING
    return tokenizer


@pytest.mark.parametrize("arguments, written", [('{"city":"Oslo"}', '{"city":"Oslo"}'),
                                                ({"city": "Oslo"}, '{"city": "Oslo"}')])
def test_a_template_that_concatenates_arguments_gets_them_as_a_string(concatenating, tmp_path, caplog, monkeypatch,
                                                                      arguments, written) -> None:
    """The row was refused ("can only concatenate str (not "dict") to str ... fix the row"; under --on_bad_row
    drop every tool-call row was dropped): the call trains with the arguments as the row wrote them (an object
    given as an object: its JSON), said once in the log; no note that the arguments are not JSON."""
    from open_sft.data.chat import tool_arguments

    monkeypatch.setattr(tool_arguments, "_SAID", set())  # said once a process: this test's own line
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps(weather(arguments)) + "\n")
    with caplog.at_level("INFO", logger="open_sft.data.chat.tool_arguments"):
        examples, _ = build_examples(DataArguments(dataset_mixer_list=[str(data), "1.0"]), concatenating, 0)
    runs = [concatenating.decode(run) for e in examples for run in trained_token_runs(e.input_ids, e.labels)]
    assert runs[0] == f"<tool_call>get_weather\n```json\n{written}\n```</tool_call><|im_end|>"
    assert runs[1] == "It is -3 in Oslo.<|im_end|>"
    assert "writes tool-call arguments by string concatenation" in caplog.text
    rendered = row_examples(concatenating, to_messages(weather(arguments), "messages"), "all_assistant",
                            special_markers(concatenating))
    assert not rendered.tool_arguments_not_json


def test_a_tojson_template_still_gets_the_object(tiny_model_dir) -> None:
    """Qwen3's template writes arguments with tojson: a JSON string is handed over as the object, as before."""
    qwen3 = family_tokenizer(tiny_model_dir, "qwen3")
    as_string = row_examples(qwen3, to_messages(weather('{"city": "Oslo"}'), "messages"), "all_assistant",
                             special_markers(qwen3))
    as_object = row_examples(qwen3, to_messages(weather({"city": "Oslo"}), "messages"), "all_assistant",
                             special_markers(qwen3))
    assert as_string.examples == as_object.examples and '"arguments": {"city": "Oslo"}' in as_string.examples[0][0]


def test_a_turn_that_shares_only_a_character_with_the_generation_prompt(concatenating, tmp_path) -> None:
    """R1's generation prompt opens "<think>\\n", which a tool-call turn does not write: the context was the common
    prefix in characters, "<" included, so the call's span began inside its first token and the row failed the
    label check ("the tokenizer merges across a turn boundary"). The context now ends at a whole tag or line."""
    concatenating.chat_template = CONCATENATING.replace("assistant\n{% endif %}", "assistant\n<think>\n{% endif %}")
    assert concatenating.chat_template != CONCATENATING
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps(weather('{"city": "Oslo"}')) + "\n")
    examples, _ = build_examples(DataArguments(dataset_mixer_list=[str(data), "1.0"]), concatenating, 0)
    runs = [concatenating.decode(run) for e in examples for run in trained_token_runs(e.input_ids, e.labels)]
    assert runs[0] == '<tool_call>get_weather\n```json\n{"city": "Oslo"}\n```</tool_call><|im_end|>'
    assert concatenating.decode(examples[0].input_ids).count("<|im_start|>assistant\n<tool_call>") == 1


R1_SPECIALS = ["<｜User｜>", "<｜Assistant｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
               "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>",
               "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"]


@pytest.fixture
def deepseek_r1(tiny_model_dir):
    """A tokenizer of DeepSeek-R1-Distill's special tokens, with the template its repositories ship."""
    from transformers import AutoTokenizer

    from tests.unit.data.test_reasoning_tool_calls import TEMPLATES

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_special_tokens({"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>",
                                  "additional_special_tokens": R1_SPECIALS})
    tokenizer.chat_template = (TEMPLATES / "deepseek_r1_distill.jinja").read_text()
    return tokenizer


def test_r1_trains_a_call_turn_through_the_token_it_stops_at(deepseek_r1, tmp_path) -> None:
    """R1's template writes `<｜Assistant｜>` + content + `<｜end▁of▁sentence｜>` for any content that is not None:
    after a call turn's null content (made "") it writes `<｜Assistant｜><｜end▁of▁sentence｜>` once more, past the
    `<｜end▁of▁sentence｜>` the model stops at. That pair was trained as part of the call; it is context now. Token by
    token: the example is apply_chat_template's rendering, and the trained tokens are the call through its first
    end of sentence and the answer through its own."""
    row = weather('{"city": "Rome"}')
    row["messages"][1]["content"] = None
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps(row) + "\n")
    (example,), _ = build_examples(DataArguments(dataset_mixer_list=[str(data), "1.0"]), deepseek_r1, 0)
    messages = [{**m, "content": m["content"] or ""} for m in row["messages"]]
    text = deepseek_r1.apply_chat_template(messages, tokenize=False)
    call_turn = ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
                 '{"city": "Rome"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>')
    answer = "It is -3 in Oslo.<｜end▁of▁sentence｜>"
    context = deepseek_r1.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert context.endswith("<｜Assistant｜><think>\n")  # the model writes a call, not the think block, after this
    pieces = [(context[: -len("<think>\n")], False), (call_turn, True),
              ("<｜Assistant｜><｜end▁of▁sentence｜><｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>"
               '{"temp_c": -3}<｜tool▁output▁end｜><｜tool▁outputs▁end｜>', False), (answer, True)]
    assert "".join(piece for piece, _ in pieces) == text
    ids = [deepseek_r1(piece, add_special_tokens=False)["input_ids"] for piece, _ in pieces]
    assert example.input_ids == deepseek_r1(text, add_special_tokens=False)["input_ids"] == sum(ids, [])
    assert example.labels == [token if trained else -100 for (_, trained), part in zip(pieces, ids) for token in part]


def test_r1_a_second_call_turn_is_refused_saying_why(deepseek_r1, tmp_path) -> None:
    """R1's template never resets its ns.is_first: a row's second call turn (call, result, call, result, answer) is
    written as '\\n<｜tool▁call▁begin｜>...' right after the first result, without `<｜Assistant｜><｜tool▁calls▁begin｜>`.
    The row was refused with a generic 'does not follow the generation prompt'; the error now says what the template
    does and what to do."""
    from open_sft.errors import UserError

    row = weather('{"city": "Oslo"}')
    row["messages"][3:3] = [{"role": "assistant", "content": "", "tool_calls": [call("get_weather", '{"city": "Bergen"}',
                                                                                    2)]},
                            tool('{"temp_c": 4}', 2)]
    messages = [{**m, "content": m["content"] or ""} for m in row["messages"]]
    through = deepseek_r1.apply_chat_template(messages[:4], tokenize=False)
    assert through.endswith('{"temp_c": -3}<｜tool▁output▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n'
                            '```json\n{"city": "Bergen"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>'
                            "<｜Assistant｜><｜end▁of▁sentence｜>")  # the template's own writing of the second call turn
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps(weather('{"city": "Oslo"}')) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(UserError) as raised:
        build_examples(DataArguments(dataset_mixer_list=[str(data), "1.0"]), deepseek_r1, 0)
    message = str(raised.value)
    assert "rows.jsonl line 2: message 4 (assistant): the template writes this call turn, after an earlier call turn, " \
           "without the opening it writes for a row's first call turn ('<｜Assistant｜><｜tool▁calls▁begin｜>')" in message
    assert "cannot render a conversation with more than one call turn" in message
    assert "Keep one call turn a row under it, or choose another template" in message
    _, (report,) = build_examples(DataArguments(dataset_mixer_list=[str(data), "1.0"], on_bad_row="drop"),
                                  deepseek_r1, 0)
    assert report.dropped == {"turn_not_located": 1} and report.rows_kept == 1


def test_a_template_writing_an_object_as_pythons_repr_gets_the_string(tiny_model_dir, tmp_path) -> None:
    """Apriel-1.5's template writes arguments with `|string`: an object comes out as Python's repr, `{'city':
    'Bern'}`, the row's JSON string as given. JSON-string arguments were handed over as objects, so every call
    trained the repr, which no tool parser reads; they are handed over as strings now (objects as their JSON), and
    each call trains what apply_chat_template writes for the row as it is."""
    from transformers import AutoTokenizer

    from tests.unit.data.test_reasoning_tool_calls import TEMPLATES, build, trained_runs

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_special_tokens({"eos_token": "<|endoftext|>", "additional_special_tokens": [
        "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|tool_result|>"]})
    tokenizer.chat_template = (TEMPLATES / "apriel_1_5.jinja").read_text()
    as_string = {"messages": [{"role": "user", "content": "Weather in Bern?"}, {"role": "assistant", "content": "",
                 "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Bern"}'}}]}]}
    as_object = json.loads(json.dumps(as_string))
    as_object["messages"][1]["tool_calls"][0]["function"]["arguments"] = {"city": "Bern"}
    examples, _ = build(tokenizer, tmp_path, [as_string, as_object])
    call_turn = '\n<tool_calls>[{"name": "get_weather", "arguments": {"city": "Bern"}}]</tool_calls>\n<|end|>\n<|endoftext|>'
    assert [run for _, run in trained_runs(tokenizer, examples)] == [call_turn, call_turn]
    assert tokenizer.apply_chat_template(as_string["messages"], tokenize=False).endswith(call_turn)
    assert "{'city': 'Bern'}" in tokenizer.apply_chat_template(as_object["messages"], tokenize=False)


def test_r1_a_second_call_turn_with_content_in_a_later_user_turn_is_refused_saying_why(deepseek_r1, tmp_path) -> None:
    """A second call turn with content, after the next user message (R1 writes it as '\\n<｜tool▁call▁begin｜>...'
    after that message, then `<｜Assistant｜>Let me check.<｜end▁of▁sentence｜>`: the content after the call, past the
    end of sentence the model stops at), was refused as turn_not_generable, 'choose another template', without the
    cause or the fix (keep one call turn a row) that the same row with an empty content gets; it gets them now."""
    from open_sft.errors import UserError

    row = weather('{"city": "Oslo"}')
    row["messages"] += [{"role": "user", "content": "And Bergen?"},
                        {"role": "assistant", "content": "Let me check.",
                         "tool_calls": [call("get_weather", '{"city": "Bergen"}', 2)]},
                        tool('{"temp_c": 4}', 2), {"role": "assistant", "content": "It is 4 in Bergen."}]
    through = deepseek_r1.apply_chat_template(row["messages"][:6], tokenize=False)
    assert through.endswith('And Bergen?\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
                            '{"city": "Bergen"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>'
                            "<｜Assistant｜>Let me check.<｜end▁of▁sentence｜>")  # the template's own writing of it
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps(weather('{"city": "Oslo"}')) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(UserError) as raised:
        build_examples(DataArguments(dataset_mixer_list=[str(data), "1.0"]), deepseek_r1, 0)
    assert "rows.jsonl line 2: message 6 (assistant): the template writes this call turn, after an earlier call " \
           "turn, without the opening it writes for a row's first call turn" in str(raised.value)
    assert "Keep one call turn a row under it, or choose another template" in str(raised.value)
    _, (report,) = build_examples(DataArguments(dataset_mixer_list=[str(data), "1.0"], on_bad_row="drop"),
                                  deepseek_r1, 0)
    assert report.dropped == {"turn_not_located": 1} and report.rows_kept == 1
