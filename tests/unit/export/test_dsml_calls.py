"""DeepSeek-V3.2's DSML calls read for `--tools`: `<｜DSML｜function_calls>` holding one `<｜DSML｜invoke name="NAME">`
per call, each argument a `<｜DSML｜parameter name="k" string="true|false">v</｜DSML｜parameter>` pair whose `string`
attribute says whether v is the string itself or JSON. They read as text before (a call with a number argument was an
unreadable call; one with strings alone read, and `</｜DSML｜function_calls>` was left as the reply's answer).
DSV32_SHAPE is the shape of its format as llama.cpp's DeepSeek-V3.2 template writes it (non-thinking mode)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from open_sft.export.reply import parse_reply
from open_sft.export.tool_calls import call_layout, read_calls

from ..data.test_reasoning_tool_calls import TOOLS, call

DSV32_SHAPE = (
    "{{- bos_token }}{%- if tools %}{{- '## Tools\\n<functions>' + tools | tojson + '</functions>\\n' }}{%- endif %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{{- '<｜User｜>' + m.content }}"
    "{%- elif m.role == 'tool' %}{{- '<function_results><result>' + m.content + '</result></function_results>' }}"
    "{%- elif m.role == 'assistant' %}{{- '<｜Assistant｜></think>' + (m.content or '') }}"
    "{%- if m.tool_calls %}{{- '\\n\\n<｜DSML｜function_calls>' }}{%- for c in m.tool_calls %}"
    "{{- '\\n<｜DSML｜invoke name=\"' + c.function.name + '\">\\n' }}{%- for k, v in c.function.arguments.items() %}"
    "{%- if not loop.first %}{{- '\\n' }}{%- endif %}{{- '<｜DSML｜parameter name=\"' + k + '\" string=\"' }}"
    "{{- ('true' if v is string else 'false') + '\">' + (v if v is string else v | tojson) + '</｜DSML｜parameter>' }}"
    "{%- endfor %}{{- '\\n</｜DSML｜invoke>' }}{%- endfor %}{{- '\\n</｜DSML｜function_calls>' }}{%- endif %}"
    "{{- '<｜end▁of▁sentence｜>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<｜Assistant｜></think>' }}{%- endif %}")
QUESTION = [{"role": "user", "content": "Weather in Bern?"}]
STOP = "<｜end▁of▁sentence｜>"
KINDS = {"city": "Bern, CH", "days": 3, "celsius": -2.5, "hourly": True, "region": None, "code": "7",
         "hours": [6, "noon"], "units": {"rain": "mm"}}  # "7": a string that reads as JSON stays a string


def dsml_tokenizer(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_special_tokens({"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": STOP,
                                  "additional_special_tokens": ["<｜User｜>", "<｜Assistant｜>"]})
    tokenizer.chat_template = DSV32_SHAPE
    return tokenizer


def _prompt(tokenizer) -> str:
    return tokenizer.apply_chat_template(QUESTION, tools=TOOLS, add_generation_prompt=True, tokenize=False)


def _written(tokenizer, message: dict) -> str:
    full = tokenizer.apply_chat_template(QUESTION + [message], tools=TOOLS, tokenize=False)
    assert full.startswith(_prompt(tokenizer))
    return full[len(_prompt(tokenizer)):].removesuffix(STOP)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_the_layout_is_read_off_the_template(tiny_model_dir) -> None:
    layout = call_layout(dsml_tokenizer(tiny_model_dir))
    assert (layout.kind, layout.marker, layout.next_marker, layout.block_end) == (
        "pairs", '<｜DSML｜function_calls>\n<｜DSML｜invoke name="', '<｜DSML｜invoke name="', "</｜DSML｜function_calls>")
    assert layout.pair[1:] == ('" string="true">', "</｜DSML｜parameter", '" string="false">')


def test_parallel_calls_read_back_with_every_kind_and_text_before(tiny_model_dir) -> None:
    tokenizer = dsml_tokenizer(tiny_model_dir)
    message = {"role": "assistant", "content": "Checking.", "tool_calls": [
        call("get_weather", KINDS, 1), call("convert", {"celsius": 12}, 2)]}
    reply = _written(tokenizer, message)
    assert '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>' in reply
    parts = parse_reply(tokenizer, _ids(tokenizer, reply), _ids(tokenizer, _prompt(tokenizer)), TOOLS, STOP)
    assert parts.tool_calls == ({"name": "get_weather", "arguments": KINDS},
                                {"name": "convert", "arguments": {"celsius": 12}})
    assert (parts.answer, parts.unreadable_call) == ("Checking.", None)


def test_a_reply_cut_at_any_token_is_no_call(tiny_model_dir) -> None:
    """Cut anywhere before `</｜DSML｜function_calls>` (between the two invokes of one block too), the reply is an
    unreadable call shown as written: never its first call alone."""
    tokenizer = dsml_tokenizer(tiny_model_dir)
    reply = _written(tokenizer, {"role": "assistant", "content": "", "tool_calls": [
        call("get_weather", {"city": "Bern"}, 1), call("convert", {"celsius": 12}, 2)]})
    ids, prompt = _ids(tokenizer, reply), _ids(tokenizer, _prompt(tokenizer))
    for cut in range(1, len(ids)):  # before the whole marker (`...<｜DSML｜invoke name="`) no call is begun: text
        parts, text = parse_reply(tokenizer, ids[:cut], prompt, TOOLS, ""), tokenizer.decode(ids[:cut]).strip()
        assert parts.tool_calls == () and parts.unreadable_call == (text if 'invoke name="' in text else None), cut
    assert len(parse_reply(tokenizer, ids, prompt, TOOLS, STOP).tool_calls) == 2


@pytest.mark.parametrize("value", ["Bern", "[1, 2", "{'rain': 'mm'}"])
def test_a_value_marked_as_no_string_that_is_not_json_is_unreadable(tiny_model_dir, value) -> None:
    written = ('<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" '
               f'string="false">{value}</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>')
    read = read_calls(dsml_tokenizer(tiny_model_dir), written, TOOLS, STOP)
    assert (read.calls, read.unreadable) == ((), written)


def test_kimis_reply_cut_between_two_calls_is_no_call(tiny_model_dir) -> None:
    """Kimi-K2's section holds each call; cut after its first call, before `<|tool_calls_section_end|>`, the reply
    read as that one call (a second may have followed); it is an unreadable call now."""
    from .test_deepseek_kimi_calls import _parsed, _reply, _tokenizer

    tokenizer = _tokenizer(tiny_model_dir, "kimi")
    whole = _reply(tokenizer, "kimi", ["Paris", "Lyon"])
    cut = whole[:whole.index("<|tool_call_begin|>functions.get_weather:1")]
    parts = _parsed(tokenizer, "kimi", cut, "")
    assert parts.tool_calls == () and parts.unreadable_call.startswith("<|tool_calls_section_begin|>")
    assert len(_parsed(tokenizer, "kimi", whole, "<|im_end|>").tool_calls) == 2
