"""Kimi-K2-Thinking's template writes every final answer `<think></think>answer`, the last message too, and the trace
only of the call turns after the last answer: a thinking model trained on that learns to think nothing before its
answers, where at inference it writes `<think>trace</think>answer`, as the template writes its call turns. Such a
turn trains its trace in that block (chat/emptied_trace.py)."""

from __future__ import annotations

from open_sft.data.formats import to_messages
from tests.unit.data.test_call_closers import tokenizer_for
from tests.unit.data.test_reasoning_tool_calls import TOOLS, build, family_tokenizer, trained_runs


def _call(city: str, n: int) -> dict:
    return {"id": f"functions.get_weather:{n}", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": city}}}


ROW = {"tools": TOOLS, "messages": [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "I need the weather.", "tool_calls": [_call("Paris", 0)]},
    {"role": "tool", "content": '{"temp_c": 12}', "tool_call_id": "functions.get_weather:0"},
    {"role": "assistant", "content": "Paris is at 12 degrees.", "reasoning_content": "The tool said 12."},
    {"role": "user", "content": "Is that warm?"},
    {"role": "assistant", "content": "Mild.", "reasoning_content": "12 is mild."}]}


def test_kimi_final_answers_train_their_trace_in_the_think_block(tiny_model_dir, tmp_path) -> None:
    tokenizer = tokenizer_for(tiny_model_dir, "kimi_k2_thinking")
    messages = to_messages(ROW, "messages")
    last = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    assert last.endswith("<think></think>Mild.<|im_end|>")  # the template's own rendering of the last turn
    examples, (report,) = build(tokenizer, tmp_path, [ROW])
    runs = trained_runs(tokenizer, examples)
    assert [run for _, run in runs] == [
        "<think>I need the weather.</think><|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>',
        "<think>The tool said 12.</think>Paris is at 12 degrees.<|im_end|>",
        "<think>12 is mild.</think>Mild.<|im_end|>"]
    contexts = [tokenizer.apply_chat_template(messages[:k], tools=TOOLS, add_generation_prompt=True, tokenize=False)
                for k in (1, 3, 5)]
    assert [before for before, _ in runs] == contexts
    assert (report.reasoning_block_filled, report.reasoning_not_rendered, report.examples) == (1, 0, 2)


def test_a_row_without_a_trace_trains_the_empty_block_the_template_writes(tiny_model_dir, tmp_path) -> None:
    tokenizer = tokenizer_for(tiny_model_dir, "kimi_k2_thinking")
    row = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    examples, (report,) = build(tokenizer, tmp_path, [row])
    assert [run for _, run in trained_runs(tokenizer, examples)] == ["<think></think>Hello.<|im_end|>"]
    assert report.reasoning_block_filled == 0


def test_templates_writing_the_last_turns_trace_are_unchanged(tiny_model_dir, tmp_path) -> None:
    """Qwen3's template writes the trace of every turn after the last user message: nothing to fill."""
    tokenizer = family_tokenizer(tiny_model_dir, "qwen3")
    examples, (report,) = build(tokenizer, tmp_path, [ROW])
    runs = [run for _, run in trained_runs(tokenizer, examples)]
    assert runs[-1] == "<think>\n12 is mild.\n</think>\n\nMild.<|im_end|>"
    assert report.reasoning_block_filled == 0


def test_a_trace_in_the_content_trains_once_in_the_block(tiny_model_dir, tmp_path) -> None:
    """A content holding its trace (`<think>trace</think>answer`, as some datasets store it), alone or beside the same
    trace as reasoning_content: the template wrote its own block and the content's, `<think></think><think>trace
    </think>answer` (a call turn with both: the trace twice), a turn the model never writes. One block now, as the
    model writes it; a row whose two traces differ is refused."""
    import pytest

    from open_sft.errors import UserError

    tokenizer = tokenizer_for(tiny_model_dir, "kimi_k2_thinking")
    row = {"tools": TOOLS, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "<think>I need the weather.</think>",
         "reasoning_content": "I need the weather.", "tool_calls": [_call("Paris", 0)]},
        {"role": "tool", "content": '{"temp_c": 12}', "tool_call_id": "functions.get_weather:0"},
        {"role": "assistant", "content": "<think>\nThe tool said 12.\n</think>\n\nParis is at 12 degrees."}]}
    messages = to_messages(row, "messages")
    written = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    call_turn = tokenizer.apply_chat_template(messages[:2], tools=TOOLS, tokenize=False)
    assert "<think>I need the weather.</think><think>I need the weather.</think>" in call_turn  # the template's own
    assert written.endswith("<think></think><think>\nThe tool said 12.\n</think>\n\nParis is at 12 degrees.<|im_end|>")
    examples, (report,) = build(tokenizer, tmp_path, [row])
    runs = trained_runs(tokenizer, examples)
    assert [run for _, run in runs] == [
        "<think>I need the weather.</think><|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>',
        "<think>The tool said 12.</think>Paris is at 12 degrees.<|im_end|>"]
    contexts = [tokenizer.apply_chat_template(messages[:k], tools=TOOLS, add_generation_prompt=True, tokenize=False)
                for k in (1, 3)]
    assert runs[0][0] == contexts[0]
    assert runs[1][0] == contexts[1].replace("<think>I need the weather.</think><think>I need the weather.</think>",
                                             "<think>I need the weather.</think>")  # its history holds one trace too
    assert (report.reasoning_block_filled, report.examples) == (1, 1)
    two = {"messages": [{"role": "user", "content": "Hi"},
                        {"role": "assistant", "content": "<think>Greet.</think>Hello.", "reasoning_content": "Wave."}]}
    (tmp_path / "two").mkdir()
    with pytest.raises(UserError, match="holds a trace in its content .* and another in its reasoning field"):
        build(tokenizer, tmp_path / "two", [two])
