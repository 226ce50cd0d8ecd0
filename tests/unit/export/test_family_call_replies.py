"""Replies in the call format of model families whose templates tests/data/chat_templates holds (Phi-4-mini,
Seed-OSS, MiniMax-M2, Mistral-Small-3.1, Kimi-K2-Thinking), read for `--tools` as the template writes them: every
call of a turn with parallel calls read back (Kimi-K2's name out of the id its template writes in the name's place:
test_deepseek_kimi_calls)."""

from __future__ import annotations

import pytest

from open_sft.export.tool_calls import call_layout, split_calls

from ..data.test_call_closers import template_tokenizer, tokenizer_for
from ..data.test_call_ids import MISTRAL_SPECIALS
from ..data.test_reasoning_tool_calls import TOOLS

QUESTION = [{"role": "user", "content": "Weather in Paris and Lyon?"}]
CALLS = [{"id": f"functions.get_weather:{n}", "type": "function",
          "function": {"name": "get_weather", "arguments": {"city": city}}} for n, city in enumerate(["Paris", "Lyon"])]
# a trace before the calls: MiniMax-M2's generation prompt opens <think>, which the model closes before calling
TWO = {"role": "assistant", "content": "", "reasoning_content": "Two cities, two calls.", "tool_calls": CALLS}


def _tokenizer(tiny_model_dir, family: str):
    if family == "mistral_small":
        return template_tokenizer(tiny_model_dir, "mistral_small_3_1.jinja", MISTRAL_SPECIALS, "</s>", "<s>")
    return tokenizer_for(tiny_model_dir, family)


def _written(tokenizer, message: dict) -> str:
    """What the template writes for `message` after the generation prompt (the reply a model trained on it writes)."""
    prompt = tokenizer.apply_chat_template(QUESTION, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template(QUESTION + [message], tools=TOOLS, tokenize=False)
    assert full.startswith(prompt)
    return full[len(prompt):]


@pytest.mark.parametrize("family", ["phi_4_mini", "seed_oss", "minimax_m2", "mistral_small", "kimi_k2_thinking"])
def test_parallel_calls_in_the_familys_own_format_read_back(tiny_model_dir, family) -> None:
    """Phi-4-mini's reply read as an unreadable call (the call's closing was taken to be `<|/tool_call|><|end|>`,
    its special tokens not stripped: added tokens flagged special are not all `all_special_tokens`); MiniMax-M2's as
    text (its generation prompt opens `<think>`, so the probe's call did not follow the prompt) and, once read, its
    second `<invoke>` inside the one `<minimax:tool_call>` block was kept as text after the first call."""
    tokenizer = _tokenizer(tiny_model_dir, family)
    message = TWO if family != "mistral_small" else {**TWO, "tool_calls": [
        {**call, "id": f"a1b2c3d4{n}"} for n, call in enumerate(CALLS)]}
    head, calls = split_calls(tokenizer, _written(tokenizer, message), TOOLS)
    assert calls == [{"name": "get_weather", "arguments": {"city": "Paris"}},
                     {"name": "get_weather", "arguments": {"city": "Lyon"}}]
    assert "get_weather" not in head and "Paris" not in head


def test_minimax_reads_each_invoke_of_one_block(tiny_model_dir) -> None:
    layout = call_layout(tokenizer_for(tiny_model_dir, "minimax_m2"))
    assert (layout.kind, layout.marker, layout.next_marker) == ("pairs", '<minimax:tool_call>\n<invoke name="',
                                                                '<invoke name="')


def test_command_r7b_calls_read_after_a_plan_or_none(tiny_model_dir) -> None:
    """Command R7B writes `<|START_THINKING|>{plan}<|END_THINKING|><|START_ACTION|>[...]<|END_ACTION|>`: the marker was
    the empty plan and the action (`<|START_THINKING|><|END_THINKING|><|START_ACTION|>`), so a call after a plan was
    text; the marker is now what both write, the plan the reply's text."""
    from ..data.test_call_closers import command_r7b_tokenizer

    tokenizer = command_r7b_tokenizer(tiny_model_dir)
    assert call_layout(tokenizer).marker == "<|END_THINKING|><|START_ACTION|>"
    for plan in ("", "I will check Paris and Lyon."):
        head, calls = split_calls(tokenizer, _written(tokenizer, {**TWO, "reasoning_content": plan}), TOOLS)
        assert calls == [{"name": "get_weather", "arguments": {"city": "Paris"}},
                         {"name": "get_weather", "arguments": {"city": "Lyon"}}]
        assert head == f"<|START_THINKING|>{plan}"


def test_nemotron_calls_read_back(tiny_model_dir) -> None:
    """Nemotron-Nano-v2's `<TOOLCALL>[...]</TOOLCALL>` list (README said it read as text): each call of a parallel
    reply read back; cut before its closing, the reply is no call."""
    from ..data.test_template_families import nemotron_tokenizer

    tokenizer = nemotron_tokenizer(tiny_model_dir)
    full = tokenizer.apply_chat_template(QUESTION + [{"role": "assistant", "content": "", "tool_calls": CALLS}],
                                         tools=TOOLS, tokenize=False)  # its prompt opens a think block: from the call
    written = full[full.rindex("<TOOLCALL>"):]
    assert written.startswith("<TOOLCALL>[") and "</TOOLCALL>" in written
    head, calls = split_calls(tokenizer, written, TOOLS)
    assert calls == [{"name": "get_weather", "arguments": {"city": "Paris"}},
                     {"name": "get_weather", "arguments": {"city": "Lyon"}}] and "Paris" not in head
    assert split_calls(tokenizer, written[:written.index("</TOOLCALL>")], TOOLS)[1] == []
