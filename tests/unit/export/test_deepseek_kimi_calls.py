"""Calls of Kimi-K2-Thinking and DeepSeek-V3.1 and the R1 distills (tests/data/chat_templates), read for `--tools` from
the replies their own templates write: Kimi's template writes a call's id where a name would be (its models' ids
`functions.NAME:INDEX`: the name is read out of the id), DeepSeek's concatenate the arguments as a string (the
probe call with object arguments made them raise, so no layout was found and every call stayed text)."""

from __future__ import annotations

import json

import pytest
from tokenizers import AddedToken
from transformers import AutoTokenizer

from open_sft.export.reply import parse_reply
from open_sft.export.tool_calls import call_layout

from ..data.test_call_closers import tokenizer_for
from ..data.test_reasoning_tool_calls import TEMPLATES, TOOLS
from ..data.test_tool_arguments import R1_SPECIALS

QUESTION = [{"role": "user", "content": "Weather in Paris and Lyon?"}]
TRACE = "Two cities, two calls."
END = {"kimi": "<|im_end|>", "v3_1": "<｜end▁of▁sentence｜>", "r1": "<｜end▁of▁sentence｜>"}  # what the model stops at
OPTIONS = {"kimi": {}, "v3_1": {"thinking": True}, "r1": {}}  # V3.1 in thinking mode: its prompt opens <think>
FAMILIES = sorted(END)


def _tokenizer(tiny_model_dir, family: str):
    if family == "kimi":
        return tokenizer_for(tiny_model_dir, "kimi_k2_thinking")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_special_tokens({"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": END[family],
                                  "additional_special_tokens": R1_SPECIALS})
    tokenizer.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in ("<think>", "</think>")])
    template = "deepseek_v3_1.jinja" if family == "v3_1" else "deepseek_r1_distill.jinja"
    tokenizer.chat_template = (TEMPLATES / template).read_text()
    return tokenizer


def _prompt(tokenizer, family: str) -> str:
    return tokenizer.apply_chat_template(QUESTION, tools=TOOLS, add_generation_prompt=True, tokenize=False,
                                         **OPTIONS[family])


def _reply(tokenizer, family: str, cities: list[str]) -> str:
    """What a model trained on the template writes for a turn calling get_weather for each of `cities` after a trace,
    less the token it stops at: the template's own rendering of the turn after the generation prompt. DeepSeek's
    prompts open `<think>`, which the model closes after its trace, and their templates write the calls after
    `<｜Assistant｜>` (R1) or `<｜Assistant｜></think>` (V3.1). Kimi's ids are its models' own; DeepSeek's templates
    take the arguments as JSON text."""
    calls = [{"id": f"functions.get_weather:{n}", "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": city} if family == "kimi" else json.dumps({"city": city})}}
        for n, city in enumerate(cities)]
    message = {"role": "assistant", "content": "", "reasoning_content": TRACE, "tool_calls": calls}
    prompt = _prompt(tokenizer, family)
    full = tokenizer.apply_chat_template(QUESTION + [message], tools=TOOLS, tokenize=False, **OPTIONS[family])
    if family == "kimi":
        written = full[len(prompt):]
    else:
        opening = prompt[:prompt.rindex("<think>")]
        written = (TRACE if family == "v3_1" else f"{TRACE}\n</think>\n\n") + full[len(opening):]
    assert full.startswith(prompt if family == "kimi" else opening)
    return written.split(END[family])[0]


def _parsed(tokenizer, family: str, reply: str, ended_by: str):
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in (reply, _prompt(tokenizer, family))]
    return parse_reply(tokenizer, ids[0], ids[1], TOOLS, ended_by)


def test_each_familys_call_layout_is_read_off_its_template(tiny_model_dir) -> None:
    """DeepSeek's layouts are found by a probe whose arguments are JSON text; Kimi's reads the name out of the id."""
    layouts = {family: call_layout(_tokenizer(tiny_model_dir, family)) for family in FAMILIES}
    assert {family: (layout.kind, layout.marker, layout.arguments_after, layout.closing, layout.next_marker,
                     layout.id_name) for family, layout in layouts.items()} == {
        "kimi": ("name_json", "<|tool_calls_section_begin|><|tool_call_begin|>", "<|tool_call_argument_begin|>",
                 "<|tool_call_end|>", "<|tool_call_begin|>", r"functions\.([A-Za-z0-9_.:\-]+?):\d+"),
        "v3_1": ("name_json", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>",
                 "<｜tool▁call▁begin｜>", ""),
        "r1": ("name_json", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>", "```json",
               "```<｜tool▁call▁end｜>", "<｜tool▁call▁begin｜>function<｜tool▁sep｜>", "")}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("cities", [["Paris"], ["Paris", "Lyon"]])
def test_single_and_parallel_calls_read_back_after_a_trace(tiny_model_dir, family, cities) -> None:
    """Each call read back with its name and arguments, the trace the reply's reasoning, no answer text. Before, all
    three replies were text: `generate` printed the raw tokens as the answer and made no call."""
    tokenizer = _tokenizer(tiny_model_dir, family)
    reply = _reply(tokenizer, family, cities)
    parts = _parsed(tokenizer, family, reply, END[family])
    assert parts.tool_calls == tuple({"name": "get_weather", "arguments": {"city": city}} for city in cities)
    assert (parts.reasoning, parts.answer, parts.unreadable_call) == (TRACE, "", None)


def test_kimis_reply_is_read_as_its_template_writes_it(tiny_model_dir) -> None:
    tokenizer = _tokenizer(tiny_model_dir, "kimi")
    assert _reply(tokenizer, "kimi", ["Paris", "Lyon"]) == (
        "<think>Two cities, two calls.</think><|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>functions.get_weather:1'
        '<|tool_call_argument_begin|>{"city": "Lyon"}<|tool_call_end|><|tool_calls_section_end|>')


@pytest.mark.parametrize("family", FAMILIES)
def test_a_cut_off_call_is_unreadable_not_a_call(tiny_model_dir, family) -> None:
    """Cut by --max_new_tokens inside the second call's arguments, or before its closing (`<|tool_call_end|>`,
    `<｜tool▁call▁end｜>`): the reply is an unreadable call from its first marker on, the first call not made."""
    tokenizer = _tokenizer(tiny_model_dir, family)
    reply = _reply(tokenizer, family, ["Paris", "Lyon"])
    closing = "<|tool_call_end|>" if family == "kimi" else "<｜tool▁call▁end｜>"
    marker = call_layout(tokenizer).marker
    for cut in (reply[:reply.index('"Lyon"') + 3], reply[:reply.rindex(closing)]):
        parts = _parsed(tokenizer, family, cut, "")
        assert (parts.tool_calls, parts.unreadable_call) == ((), cut[cut.index(marker):].strip())
        assert parts.reasoning == TRACE


@pytest.mark.parametrize("written", ["get_weather", "functions.get_weather", "call_1", "functions.get_weather:x",
                                     "get_weather:1"])
def test_a_kimi_id_without_a_name_in_its_form_is_unreadable(tiny_model_dir, written) -> None:
    """An id that does not carry a name as `functions.NAME:INDEX` names no call: the reply is an unreadable call,
    never a call named by the id's text."""
    tokenizer = _tokenizer(tiny_model_dir, "kimi")
    reply = _reply(tokenizer, "kimi", ["Paris", "Lyon"]).replace("functions.get_weather:1", written)
    parts = _parsed(tokenizer, "kimi", reply, END["kimi"])
    assert parts.tool_calls == ()
    assert parts.unreadable_call == reply[reply.index("<|tool_calls_section_begin|>"):]


def test_apriels_calls_read_back_as_its_prompt_asks_for_them(tiny_model_dir) -> None:
    """Apriel-1.5's template writes arguments with `|string` (an object as Python's repr), so open_sft trains them
    as the JSON text a row gives, the form its prompt asks for (`<tool_calls>[{"name": ..., "arguments": {...}}]
    </tool_calls>`); its probe with object arguments wrote the repr, and its replies were text. Parallel calls read
    back; cut before the list's closing, the reply is an unreadable call."""
    from open_sft.export.tool_calls import read_calls

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_special_tokens({"eos_token": "<|endoftext|>", "additional_special_tokens": [
        "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|tool_result|>"]})
    tokenizer.chat_template = (TEMPLATES / "apriel_1_5.jinja").read_text()
    calls = [{"id": f"call{n}", "type": "function", "function": {
        "name": "get_weather", "arguments": json.dumps({"city": city})}} for n, city in enumerate(["Paris", "Lyon"])]
    prompt = tokenizer.apply_chat_template(QUESTION, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template(QUESTION + [{"role": "assistant", "content": "", "tool_calls": calls}],
                                         tools=TOOLS, tokenize=False)
    reply = full[len(prompt):].removesuffix("<|endoftext|>")
    assert reply == ('\n<tool_calls>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_weather", '
                     '"arguments": {"city": "Lyon"}}]</tool_calls>\n<|end|>\n')
    read = read_calls(tokenizer, reply, TOOLS, "<|endoftext|>")
    assert (read.head.strip(), read.calls, read.unreadable) == ("", (
        {"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_weather", "arguments": {"city": "Lyon"}}),
        None)
    cut = reply[:reply.index("]</tool_calls>")]
    assert read_calls(tokenizer, cut, TOOLS).unreadable == cut.strip()


@pytest.mark.parametrize("family", FAMILIES)
def test_chats_history_renders_the_calls_as_the_reply_wrote_them(tiny_model_dir, family) -> None:
    """chat keeps a reply's calls and sends each /tool result after them. Its history gave Kimi's calls the ids
    `call00001`... (its template writes the id as the name: the next prompt held calls the model never wrote, and
    `## Return of call00001`) and DeepSeek's calls object arguments (its templates raise a TypeError on them). The
    next prompt now holds the calls exactly as the reply wrote them."""
    from open_sft.export.chat import tool_result

    tokenizer = _tokenizer(tiny_model_dir, family)
    reply = _reply(tokenizer, family, ["Paris", "Lyon"])
    messages = QUESTION + [_parsed(tokenizer, family, reply, END[family]).message()]
    for text in ('{"temp_c": 12}', '{"temp_c": 15}'):
        messages.append(tool_result(messages, text))
    prompt = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False,
                                           **OPTIONS[family])
    assert reply[reply.index(call_layout(tokenizer).marker):] in prompt
    if family == "kimi":
        assert [m["tool_call_id"] for m in messages[2:]] == ["functions.get_weather:0", "functions.get_weather:1"]
        assert '## Return of functions.get_weather:1\n{"temp_c": 15}' in prompt
