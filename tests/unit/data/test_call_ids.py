"""Rows without tool call ids (xLAM, glaive) under templates that write ids: Mistral-Small-3.1's (which raised on
them, reported as a tool schema lacking 'id') and Kimi-K2-Thinking's (which wrote an empty id, refused as calls the
template does not write). Such a row is a bad row named with the fix; templates that write no ids train it."""

from __future__ import annotations

import copy

import pytest

from open_sft.errors import UserError
from tests.unit.data.test_call_closers import template_tokenizer, tokenizer_for
from tests.unit.data.test_reasoning_tool_calls import TOOLS, build, family_tokenizer, trained_runs

MISTRAL_SPECIALS = ["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                    "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"]
WITH_IDS = {"tools": TOOLS, "messages": [
    {"role": "system", "content": "You answer weather questions."},
    {"role": "user", "content": "How cold is Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_a1b2c3d4e", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "content": '{"temp_c": -3}', "tool_call_id": "call_a1b2c3d4e"},
    {"role": "assistant", "content": "Oslo is at -3 degrees."}]}


def _without(row: dict, key: str) -> dict:
    row = copy.deepcopy(row)
    for message in row["messages"]:
        message.pop(key, None)
        for call in message.get("tool_calls") or []:
            call.pop(key, None)
    return row


@pytest.fixture
def mistral(tiny_model_dir):
    return template_tokenizer(tiny_model_dir, "mistral_small_3_1.jinja", MISTRAL_SPECIALS, "</s>", "<s>")


def test_ids_given_train_as_the_template_writes_them(mistral, tmp_path) -> None:
    examples, (report,) = build(mistral, tmp_path, [WITH_IDS])
    runs = [run for _, run in trained_runs(mistral, examples)]
    assert runs == ['[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}, "id": "a1b2c3d4e"}]</s>',
                    "Oslo is at -3 degrees.</s>"]
    assert report.rows_kept == 1


@pytest.mark.parametrize("key, where", [("id", r"message 3 \(assistant, with tool calls\): a tool call has no 'id'"),
                                        ("tool_call_id", r"message 4 \(tool\): it has no 'tool_call_id'")])
def test_missing_ids_are_a_named_bad_row_under_mistral_small(mistral, tmp_path, key, where) -> None:
    """Was: `'dict object' has no attribute 'id'; each tool schema needs 'id' under this template` (the schemas
    were never the problem)."""
    row = _without(WITH_IDS, key)
    with pytest.raises(UserError, match=r"conversations.jsonl line 2: " + where + r", and the chat template writes "
                                        r"tool call ids .*9 letters and digits.*--on_bad_row drop"):
        build(mistral, tmp_path, [WITH_IDS, row])
    examples, (report,) = build(mistral, tmp_path, [WITH_IDS, row], on_bad_row="drop")
    assert dict(report.dropped) == {"tool_call_ids_missing": 1} and report.rows_kept == 1 and len(examples) == 1


def test_kimi_writes_the_id_in_place_of_the_name(tiny_model_dir, tmp_path) -> None:
    """Kimi-K2-Thinking's template writes `<|tool_call_begin|>{id}<|tool_call_argument_begin|>`: without ids it wrote
    an empty one (refused as calls it does not write, which misled)."""
    tokenizer = tokenizer_for(tiny_model_dir, "kimi_k2_thinking")
    with pytest.raises(UserError, match=r"line 1: message 3 \(assistant, with tool calls\): a tool call has no 'id'"
                                        r".*functions\.NAME:INDEX"):
        build(tokenizer, tmp_path, [_without(WITH_IDS, "id")])


def test_a_template_that_writes_no_ids_trains_rows_without_them(tiny_model_dir, tmp_path) -> None:
    tokenizer = family_tokenizer(tiny_model_dir, "qwen3")
    examples, (report,) = build(tokenizer, tmp_path, [_without(_without(WITH_IDS, "id"), "tool_call_id")])
    assert report.rows_kept == 1 and len(trained_runs(tokenizer, examples)) == 2


def test_ids_a_template_writes_in_history_only_are_asked_of_rows_that_have_history(tiny_model_dir, tmp_path) -> None:
    """Apriel-1.5's template writes a call's id after its arguments in history, never in the last assistant turn
    (the one the model generates): an xLAM row whose one call turn is its last trains without ids, as the template
    writes it; a row with a call turn in history, which the template would write with an id the row lacks, is the
    named bad row (the template-wide probe alone refused both)."""
    from transformers import AutoTokenizer

    from tests.unit.data.test_reasoning_tool_calls import TEMPLATES

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_special_tokens({"eos_token": "<|endoftext|>", "additional_special_tokens": [
        "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|tool_result|>"]})
    tokenizer.chat_template = (TEMPLATES / "apriel_1_5.jinja").read_text()
    no_ids = _without(WITH_IDS, "id")
    no_ids = _without(no_ids, "tool_call_id")
    last_call = {"tools": TOOLS, "messages": no_ids["messages"][:3]}
    examples, (report,) = build(tokenizer, tmp_path, [last_call, no_ids], on_bad_row="drop")
    assert dict(report.dropped) == {"tool_call_ids_missing": 1} and report.rows_kept == 1
    assert [run for _, run in trained_runs(tokenizer, examples)] == [
        '\n<tool_calls>[{"name": "get_weather", "arguments": {"city": "Oslo"}}]</tool_calls>\n<|end|>\n<|endoftext|>']


def test_mistral_small_3_2_names_rows_without_ids(tiny_model_dir, tmp_path) -> None:
    """Mistral-Small-3.2's template writes `[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}` and raises unless every id is 9
    characters long: the probes' ids (12 characters) failed it, so the template was taken for one that writes no ids
    and an xLAM row was refused with the template's own 'Tool call IDs should be alphanumeric strings with length 9!'
    (counted as template_error). The probes use 9 letters and digits now: such a row is the named bad row
    (tool_call_ids_missing), and a row with Mistral's ids trains them."""
    specials = MISTRAL_SPECIALS + ["[CALL_ID]", "[ARGS]", "[TOOL_CONTENT]"]
    tokenizer = template_tokenizer(tiny_model_dir, "mistral_small_3_2.jinja", specials, "</s>", "<s>")
    with_ids = copy.deepcopy(WITH_IDS)
    with_ids["messages"][2]["tool_calls"][0]["id"] = with_ids["messages"][3]["tool_call_id"] = "a1b2c3d4e"
    examples, (report,) = build(tokenizer, tmp_path, [with_ids])
    assert [run for _, run in trained_runs(tokenizer, examples)] == [
        '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Oslo"}</s>', "Oslo is at -3 degrees.</s>"]
    row = _without(_without(WITH_IDS, "id"), "tool_call_id")
    with pytest.raises(UserError, match=r"line 2: message 3 \(assistant, with tool calls\): a tool call has no 'id', "
                                        r"and the chat template writes tool call ids .*9 letters and digits"):
        build(tokenizer, tmp_path, [with_ids, row])
    _, (report,) = build(tokenizer, tmp_path, [with_ids, row], on_bad_row="drop")
    assert dict(report.dropped) == {"tool_call_ids_missing": 1} and report.rows_kept == 1
