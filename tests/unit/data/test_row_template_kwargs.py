"""A row's own chat template variables (smoltalk2's `chat_template_kwargs` column, read by SmolLM3's template): each
row renders with them, over --chat_template_kwargs; a value that is not an object is a named bad row."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from open_sft.data.chat import render
from open_sft.data.formats import RowError, to_messages, without_arrow_fill
from tests.unit.data.test_call_closers import template_tokenizer
from tests.unit.data.test_more_families import SMOLLM3_SHAPE
from tests.unit.data.test_reasoning_tool_calls import build, trained_runs

# SmolLM3's shape, with the custom instructions it writes in the system turn where no system message gives them
SHAPE = SMOLLM3_SHAPE.replace("'\\n<|im_end|>\\n' }}", "'\\n' + (custom_instructions or '') + '<|im_end|>\\n' }}", 1)
QUESTION = [{"role": "user", "content": "What is 6 times 7?"}, {"role": "assistant", "content": "42."}]


@pytest.fixture
def smollm3(tiny_model_dir):
    return template_tokenizer(tiny_model_dir, SHAPE, ["<|im_start|>", "<|im_end|>"], "<|im_end|>")


def test_each_row_renders_with_its_own_template_variables(smollm3, tmp_path) -> None:
    """smoltalk2's rows carry the variables SmolLM3's template reads (`{"enable_thinking": false, "custom_instructions":
    ...}`): the column was ignored, and a no-think row trained '42.' after a '/think' system turn, without the empty
    think block its generation prompt writes. Each row renders as apply_chat_template(**its kwargs) now, the row's
    value over --chat_template_kwargs', and the data report counts the rows."""
    rows = [{"messages": QUESTION,
             "chat_template_kwargs": {"enable_thinking": False, "custom_instructions": "Be terse."}},
            {"messages": QUESTION, "chat_template_kwargs": {"enable_thinking": None, "python_tools": None}},
            {"messages": QUESTION}]
    examples, (report,) = build(smollm3, tmp_path, rows, chat_template_kwargs='{"enable_thinking": true}')
    runs = trained_runs(smollm3, examples)
    assert [run for _, run in runs] == ["42.<|im_end|>"] * 3
    assert runs[0][0] == ("<|im_start|>system\nReasoning Mode: /no_think\nBe terse.<|im_end|>\n<|im_start|>user\n"
                          "What is 6 times 7?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n")
    assert runs[0][0] == smollm3.apply_chat_template(QUESTION[:1], add_generation_prompt=True, tokenize=False,
                                                     enable_thinking=False, custom_instructions="Be terse.")
    thinking = smollm3.apply_chat_template(QUESTION[:1], add_generation_prompt=True, tokenize=False)
    assert runs[1][0] == runs[2][0] == thinking and "/think\n<|im_end|>" in thinking  # a null is no variable
    assert report.row_template_kwargs == 1 and report.to_dict()["row_template_kwargs"] == 1


def test_a_row_whose_template_variables_are_no_object_is_a_named_bad_row(smollm3, tmp_path) -> None:
    for value, named in [(["enable_thinking"], "'chat_template_kwargs' is a list"),
                         ("enable_thinking=False", "'chat_template_kwargs' is a string but not JSON"),
                         ({"tools": []}, "'chat_template_kwargs' sets tools: apply_chat_template's own arguments"),
                         ({"sanitize_control_tokens": True},
                          "'chat_template_kwargs' sets sanitize_control_tokens: apply_chat_template's own arguments"),
                         ({"date": b"2025"}, "'chat_template_kwargs' holds a value that is not JSON")]:
        with pytest.raises(RowError, match=named) as error:
            to_messages({"messages": QUESTION, "chat_template_kwargs": value}, "messages")
        assert error.value.reason == "bad_template_kwargs"
    assert to_messages({"messages": QUESTION, "chat_template_kwargs": '{"enable_thinking": false}'},
                       "messages").template_kwargs == {"enable_thinking": False}
    _, (report,) = build(smollm3, tmp_path, [{"messages": QUESTION, "chat_template_kwargs": 3},
                                             {"messages": QUESTION}], on_bad_row="drop")
    assert report.rows_kept == 1 and dict(report.dropped) == {"bad_template_kwargs": 1}


def test_a_parquet_struct_column_of_variables_loses_the_nulls_arrow_fills_in(tmp_path) -> None:
    """smoltalk2's parquet: one struct type over all rows, so a row gets every key any row has, null where it has
    none; a null enable_thinking would switch SmolLM3's thinking off (`if enable_thinking`), and xml_tools' schemas
    would carry other rows' keys."""
    rows = [{"messages": QUESTION, "chat_template_kwargs": {"enable_thinking": False}},
            {"messages": QUESTION,
             "chat_template_kwargs": {"xml_tools": [{"name": "add", "strict": True}, {"name": "f"}]}}]
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    read = [without_arrow_fill(row) for row in pq.read_table(path).to_pylist()]
    assert [to_messages(row, "messages").template_kwargs for row in read] == [
        {"enable_thinking": False}, {"xml_tools": [{"name": "add", "strict": True}, {"name": "f"}]}]
    assert json.dumps(read[0]["chat_template_kwargs"]) == '{"enable_thinking": false}'


def test_the_sources_template_state_outlives_a_hundred_rows_with_variables_of_their_own(smollm3, monkeypatch) -> None:
    """Template states were dropped in the order they were made (64 kept): after 64 rows with distinct variables of
    their own (smoltalk2's xml_tools), the state every other row shares was dropped and made again, with all its
    probes, and again every 64 rows. The least recently used one is dropped now: 100 such rows between plain rows
    make 101 states, the plain rows' one state throughout."""
    made, direct = [], render._direct_renderer

    def counted(tokenizer, kwargs):  # once per state made
        made.append(kwargs)
        return direct(tokenizer, kwargs)

    monkeypatch.setattr(render, "_direct_renderer", counted)
    shared = render.template_state(smollm3, render.DEFAULT_OPTIONS)
    for k in range(100):
        own = to_messages({"messages": QUESTION, "chat_template_kwargs": {"xml_tools": [{"name": f"tool_{k}"}]}},
                          "messages")
        render.template_state(smollm3, render.row_options(render.DEFAULT_OPTIONS, own))
        assert render.template_state(smollm3, render.row_options(render.DEFAULT_OPTIONS, QUESTION)) is shared
    assert len(made) == 101 and made[0] == {} and made[100] == {"xml_tools": [{"name": "tool_99"}]}


def test_only_rows_whose_variables_change_what_the_template_gets_are_counted(smollm3, tmp_path) -> None:
    """A row whose column repeats the source's variables (`enable_thinking: true` under --chat_template_kwargs
    '{"enable_thinking": true}', smoltalk2's thinking subsets) renders as the source's rows do, yet was counted as
    row_template_kwargs; only the row that sets another value (or a variable the source does not) counts now."""
    rows = [{"messages": QUESTION, "chat_template_kwargs": {"enable_thinking": True}},
            {"messages": QUESTION, "chat_template_kwargs": {"enable_thinking": True, "python_tools": None}},
            {"messages": QUESTION, "chat_template_kwargs": {"enable_thinking": False}},
            {"messages": QUESTION,
             "chat_template_kwargs": {"enable_thinking": True, "custom_instructions": "Be terse."}}]
    examples, (report,) = build(smollm3, tmp_path, rows, chat_template_kwargs='{"enable_thinking": true}')
    assert report.rows_kept == 4 and report.row_template_kwargs == 2
    contexts = [context for context, _ in trained_runs(smollm3, examples)]
    assert contexts[0] == contexts[1] == smollm3.apply_chat_template(QUESTION[:1], add_generation_prompt=True,
                                                                     tokenize=False)
    assert "/no_think" in contexts[2] and "Be terse.<|im_end|>" in contexts[3]


def test_rows_with_variables_of_their_own_render_through_the_template_checked_once(smollm3, monkeypatch) -> None:
    """Each row with variables of its own (smoltalk2's xml_tools, custom_instructions) made a template state whose
    renderer was checked against apply_chat_template on 20 probe renders: 1.3 ms a row became 9.4 ms (tiny SmolLM3
    shape, 400 rows). The check runs once per template now; the rows still render as apply_chat_template(**kwargs)."""
    calls = []
    public = smollm3.apply_chat_template

    def counted(*args, **kwargs):
        calls.append(kwargs)
        return public(*args, **kwargs)

    monkeypatch.setattr(smollm3, "apply_chat_template", counted)
    render.template_state(smollm3, render.DEFAULT_OPTIONS)
    checked = len(calls)
    assert checked == 20  # the probes: with and without tools, five prefixes, with and without a generation prompt
    for k in range(30):
        own = to_messages({"messages": QUESTION, "chat_template_kwargs": {"custom_instructions": f"Rule {k}."}},
                          "messages")
        draw = render.template_state(smollm3, render.row_options(render.DEFAULT_OPTIONS, own)).draw
        assert draw(QUESTION, False, None) == public(QUESTION, tokenize=False, custom_instructions=f"Rule {k}.")
    assert len(calls) == checked
