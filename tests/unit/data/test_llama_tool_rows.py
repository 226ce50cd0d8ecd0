"""Llama 3.1's tool calling (the shape of vLLM's JSON form of Meta's template, LLAMA3_1_JSON_SHAPE below): a
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
# The shape of Llama 3.1's JSON tool-calling template (vLLM's form of meta-llama/Llama-3.1-8B-Instruct's, whose Llama
# 3.1 Community Licence keeps its text out of this repository), written here in a few lines: a system turn (with
# "Environment: ipython" when there are tools); the tools as JSON in the first user turn; a call as bare JSON,
# {"name": ..., "parameters": ...}, one a turn (more is refused); a `tool` or `ipython` result as an ipython turn,
# {"output": ...}; every turn closed by <|eot_id|>.
LLAMA3_1_JSON_SHAPE = (
    "{{- bos_token + '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{%- if tools %}{{- 'Environment: ipython\\n' }}{%- endif %}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- set messages = messages[1:] %}{%- endif %}"
    "{{- '<|eot_id|>' }}{%- if tools %}{{- '<|start_header_id|>user<|end_header_id|>\\n\\nCall a function as '"
    " + '{\"name\": function name, \"parameters\": its arguments}.\\n\\n' }}"
    "{%- for t in tools %}{{- t | tojson + '\\n\\n' }}{%- endfor %}"
    "{{- messages[0].content + '<|eot_id|>' }}{%- set messages = messages[1:] %}{%- endif %}"
    "{%- for m in messages %}{%- if m.tool_calls %}{%- if m.tool_calls | length > 1 %}"
    "{{- raise_exception('This model only supports single tool-calls at once!') }}{%- endif %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n{\"name\": \"' + m.tool_calls[0].function.name"
    " + '\", \"parameters\": ' + m.tool_calls[0].function.arguments | tojson + '}<|eot_id|>' }}"
    "{%- elif m.role in ['tool', 'ipython'] %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + {'output': m.content} | tojson + '<|eot_id|>' }}"
    "{%- else %}{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


def _row(result_role: str, cities: tuple[str, ...] = ("Oslo",)) -> dict:
    calls = [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}} for city in cities]
    return {"tools": TOOLS, "messages": [{"role": "user", "content": "How cold is Oslo?"},
                                         {"role": "assistant", "content": None, "tool_calls": calls},
                                         {"role": result_role, "content": '{"temp_c": -3}'},
                                         {"role": "assistant", "content": "It is -3 C."}]}


@pytest.fixture
def llama(tiny_model_dir):
    return template_tokenizer(tiny_model_dir, LLAMA3_1_JSON_SHAPE, SPECIALS, "<|eot_id|>", "<|begin_of_text|>")


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
