"""Llama 3.1's tool calling (tests/data/chat_templates/llama3_1_json.jinja, vLLM's JSON form of Meta's template): a
tool result under Llama's own role name, `ipython`, is a tool message (it was refused: "message 3 has role
'ipython'"), each call trains as the bare JSON the template writes through `<|eot_id|>`, and parallel calls, which
the template refuses, are a named bad row."""

from __future__ import annotations

import pytest

from open_sft.errors import UserError
from tests.unit.data.test_call_closers import template_tokenizer
from tests.unit.data.test_reasoning_tool_calls import TOOLS, build, trained_runs

SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
            "<|python_tag|>"]


def _row(result_role: str, cities: tuple[str, ...] = ("Oslo",)) -> dict:
    calls = [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}} for city in cities]
    return {"tools": TOOLS, "messages": [{"role": "user", "content": "How cold is Oslo?"},
                                         {"role": "assistant", "content": None, "tool_calls": calls},
                                         {"role": result_role, "content": '{"temp_c": -3}'},
                                         {"role": "assistant", "content": "It is -3 C."}]}


@pytest.fixture
def llama(tiny_model_dir):
    return template_tokenizer(tiny_model_dir, "llama3_1_json.jinja", SPECIALS, "<|eot_id|>", "<|begin_of_text|>")


def test_an_ipython_result_is_a_tool_message(llama, tmp_path) -> None:
    examples, (report,) = build(llama, tmp_path, [_row("ipython")])
    runs = trained_runs(llama, examples)
    assert [run for _, run in runs] == ['{"name": "get_weather", "parameters": {"city": "Oslo"}}<|eot_id|>',
                                        "It is -3 C.<|eot_id|>"]
    assert runs[1][0].endswith('<|start_header_id|>ipython<|end_header_id|>\n\n{"output": "{\\"temp_c\\": -3}"}'
                               "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    as_tool, _ = build(llama, tmp_path, [_row("tool")])
    assert [e.input_ids for e in as_tool] == [e.input_ids for e in examples] and report.rows_kept == 1


def test_parallel_calls_the_template_refuses_are_a_named_bad_row(llama, tmp_path) -> None:
    with pytest.raises(UserError, match=r"line 1: the chat template rejects this conversation \(This model only "
                                        r"supports single tool-calls at once!\)"):
        build(llama, tmp_path, [_row("tool", ("Oslo", "Bergen"))])
