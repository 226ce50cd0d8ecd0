"""Assistant-only labels on a three-row example, checked by decoding the trained spans."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from open_sft.data.pipeline import count_trained
from open_sft.data.tokenize import (IGNORE_INDEX, Example, special_markers, tokenize_conversations, trained_spans,
                                   trained_token_runs)
from open_sft.data.tokenize import truncate_example

ROWS = [
    [{"role": "user", "content": "What is 2 plus 3?"}, {"role": "assistant", "content": "5"}],
    [{"role": "user", "content": "Reverse the word cat."}, {"role": "assistant", "content": "tac"},
     {"role": "user", "content": "Now uppercase it."}, {"role": "assistant", "content": "TAC"}],
    [{"role": "system", "content": "Reply with a number."}, {"role": "user", "content": "How many m in 3 km?"},
     {"role": "assistant", "content": "3000 m"}],
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def label(tokenizer, rows, train_on="all_assistant") -> list[Example]:
    markers = special_markers(tokenizer)
    return tokenize_conversations(tokenizer, [trained_spans(tokenizer, r, train_on, markers) for r in rows])


def trained_runs(tokenizer, example: Example) -> list[str]:
    """Decoded contiguous runs of trained tokens (each trained label is its own token id)."""
    assert all(lab in (IGNORE_INDEX, token) for token, lab in zip(example.input_ids, example.labels))
    return [tokenizer.decode(run) for run in trained_token_runs(example.input_ids, example.labels)]


def test_only_assistant_content_and_eos_are_trained(tokenizer) -> None:
    examples = label(tokenizer, ROWS)
    eos = tokenizer.eos_token
    assert trained_runs(tokenizer, examples[0]) == ["5" + eos]
    assert trained_runs(tokenizer, examples[1]) == ["tac" + eos, "TAC" + eos]
    assert trained_runs(tokenizer, examples[2]) == ["3000 m" + eos]
    # The whole rendered conversation is tokenized: untrained tokens hold the headers and prompts.
    untrained = tokenizer.decode([t for t, l in zip(examples[2].input_ids, examples[2].labels) if l == IGNORE_INDEX])
    assert "<|system|>" in untrained and "Reply with a number." in untrained and "<|assistant|>" in untrained
    assert "3000" not in untrained


def test_train_on_last_assistant_and_all(tokenizer) -> None:
    last = label(tokenizer, ROWS[1:2], "last_assistant")[0]
    assert trained_runs(tokenizer, last) == ["TAC" + tokenizer.eos_token]
    everything = label(tokenizer, ROWS[1:2], "all")[0]
    assert everything.labels == everything.input_ids


def test_truncation(tokenizer) -> None:
    example = label(tokenizer, ROWS[2:3])[0]
    n = len(example.input_ids)
    kept, reason = truncate_example(example, n, "truncate")
    assert (kept, reason) == (example, "kept")
    assert truncate_example(example, n - 1, "drop") == (None, "too_long")
    cut, reason = truncate_example(example, n - 1, "truncate")
    assert reason == "truncated" and len(cut.input_ids) == n - 1 and count_trained(cut.labels) >= 1
    # A window the prompt fills alone keeps no trained token: the row is dropped, not kept useless.
    first_trained = next(i for i, l in enumerate(example.labels) if l != IGNORE_INDEX)
    assert truncate_example(example, first_trained, "truncate") == (None, "no_trained_tokens_after_truncation")


TOOLS_TEMPLATE = (
    "{% if tools %}<|system|>\nTools: {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{% if m.role == 'assistant' %}{{ eos_token }}{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def test_tools_column_reaches_the_template_and_is_never_trained(tokenizer) -> None:
    from open_sft.data.formats import to_messages

    tokenizer = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)  # a copy: the template changes
    tokenizer.chat_template = TOOLS_TEMPLATE
    schema = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    row = {"messages": [{"role": "user", "content": "Weather in Oslo?"},
                        {"role": "assistant", "content": "get_weather(city='Oslo')"},
                        {"role": "tool", "content": "rain, 4 C"},
                        {"role": "assistant", "content": "Rain and 4 C."}],
           "tools": [schema]}
    with_tools = label(tokenizer, [to_messages(row, "messages")])[0]
    as_json_string = label(tokenizer, [to_messages({**row, "tools": json.dumps([schema])}, "messages")])[0]
    without = label(tokenizer, [to_messages({"messages": row["messages"]}, "messages")])[0]
    text = tokenizer.decode(with_tools.input_ids)
    assert "get_weather" in text.split("<|user|>")[0]  # the schema is rendered before the conversation
    assert "get_weather" not in tokenizer.decode(without.input_ids).split("<|user|>")[0]
    assert as_json_string == with_tools
    eos = tokenizer.eos_token
    for example in (with_tools, without):  # tool schemas and the tool turn carry no loss
        assert trained_runs(tokenizer, example) == ["get_weather(city='Oslo')" + eos, "Rain and 4 C." + eos]


@pytest.mark.parametrize("tools", [{"name": "x"}, ["not an object"], "{not json"])
def test_bad_tools_column_is_a_row_error(tools) -> None:
    from open_sft.data.formats import RowError, to_messages

    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], "tools": tools}
    with pytest.raises(RowError) as error:
        to_messages(row, "messages")
    assert error.value.reason == "bad_tools" and "'tools'" in str(error.value)
