"""A generation prompt that opens the trace with words, not a tag (chat/opened_trace.py, worded_turn): Apriel-1.6's
template ends it `<|begin_assistant|>\\nHere are my reasoning steps:\\n` and writes the last turn without those words
(`trace\\n[BEGIN FINAL RESPONSE]\\nanswer`). Each turn trained after `<|begin_assistant|>\\n`, a context the model never
sees; it trains after the whole generation prompt, as apply_chat_template renders it, through `<|end|>`."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from tests.unit.data.test_reasoning_tool_calls import TEMPLATES, TOOLS, build, call, tool, trained_runs

PREFIX = "<|begin_assistant|>\nHere are my reasoning steps:\n"
USER = {"role": "user", "content": "Greet."}
ROWS = {
    "reasoning": ({"messages": [USER, {"role": "assistant", "content": "Hello!", "reasoning_content": "A greeting."}]},
                  ["A greeting.\n[BEGIN FINAL RESPONSE]\nHello!<|end|>"]),
    "no_reasoning": ({"messages": [USER, {"role": "assistant", "content": "Hello!"}]},
                     ["\n[BEGIN FINAL RESPONSE]\nHello!<|end|>"]),
    "multi_turn": ({"messages": [USER, {"role": "assistant", "content": "Hello!", "reasoning_content": "A greeting."},
                                 {"role": "user", "content": "Again."}, {"role": "assistant", "content": "Hi!"}]},
                   ["A greeting.\n[BEGIN FINAL RESPONSE]\nHello!<|end|>", "\n[BEGIN FINAL RESPONSE]\nHi!<|end|>"]),
    "call_then_answer": ({"tools": TOOLS, "messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "reasoning_content": "Need weather.",
         "tool_calls": [call("get_weather", {"city": "Oslo"}, 1)]},
        tool('{"temp_c": -3}', 1),
        {"role": "assistant", "content": "Oslo is -3.", "reasoning_content": "Tool said -3."}]},
        ['Need weather.\n[BEGIN FINAL RESPONSE]\n\n<tool_calls>[{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
         '</tool_calls><|end|>', "Tool said -3.\n[BEGIN FINAL RESPONSE]\nOslo is -3.<|end|>"]),
    "xlam_call": ({"tools": TOOLS, "messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}]},
        ['\n[BEGIN FINAL RESPONSE]\n\n<tool_calls>[{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
         '</tool_calls><|end|>']),
}


def apriel_tokenizer(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_special_tokens({"eos_token": "<|end|>", "additional_special_tokens": [
        "<|begin_system|>", "<|begin_user|>", "<|begin_assistant|>", "<|begin_tool_result|>", "<|begin_content|>"]})
    tokenizer.chat_template = (TEMPLATES / "apriel_1_6.jinja").read_text()
    return tokenizer


@pytest.mark.parametrize("name", sorted(ROWS))
def test_each_turn_trains_after_the_words_its_generation_prompt_opens_with(tiny_model_dir, tmp_path, name) -> None:
    """Each assistant turn's context is apply_chat_template's generation prompt for the messages before it, the
    words `Here are my reasoning steps:\\n` included; the turn trains its trace, `[BEGIN FINAL RESPONSE]`, the answer
    or calls and `<|end|>`; a turn without a trace trains an empty one closed by the marker (the model has to close
    what the prompt opened: Apriel's parsers read all before the marker as reasoning)."""
    tokenizer = apriel_tokenizer(tiny_model_dir)
    row, generated = ROWS[name]
    examples, (report,) = build(tokenizer, tmp_path, [row])
    messages, tools = row["messages"], row.get("tools")
    prompts = [tokenizer.apply_chat_template(messages[:k], tools=tools, add_generation_prompt=True, tokenize=False)
               for k, m in enumerate(messages) if m["role"] == "assistant"]
    assert all(prompt.endswith("\n" + PREFIX) for prompt in prompts)
    assert trained_runs(tokenizer, examples) == list(zip(prompts, generated))
    assert (report.reasoning_opened_by_prompt, report.rows_kept) == (1, 1)


def test_a_content_that_holds_its_trace_and_marker_trains_once(tiny_model_dir, tmp_path) -> None:
    """A row storing the model's output as the content (`trace\\n[BEGIN FINAL RESPONSE]\\nanswer`, with or without
    the prompt's words) trains it as written after the prompt, the marker not doubled."""
    tokenizer = apriel_tokenizer(tiny_model_dir)
    output = "A greeting.\n[BEGIN FINAL RESPONSE]\nHello!"
    rows = [{"messages": [USER, {"role": "assistant", "content": content}]}
            for content in (output, "Here are my reasoning steps:\n" + output)]
    examples, _ = build(tokenizer, tmp_path, rows)
    prompt = tokenizer.apply_chat_template([USER], add_generation_prompt=True, tokenize=False)
    assert trained_runs(tokenizer, examples) == [(prompt, output + "<|end|>")] * 2
