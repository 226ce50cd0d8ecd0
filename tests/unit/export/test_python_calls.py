"""LFM2's calls (`<|tool_call_start|>[get_weather(city='Bern')]<|tool_call_end|>`, Python calls) read for `--tools`
by the layout read off its template (LFM2_SHAPE, the shape of LFM2's template: its licence keeps the file out of
tests/data): they read as text before (parse_reply's answer was the call as written, `[get_weather(city='Bern')]`
once its special tokens were dropped, and no call), so chat kept no call to answer and compare scored a miss."""

from __future__ import annotations

import pytest

from open_sft.export.reply import parse_reply
from open_sft.export.tool_calls import call_layout, read_calls

from ..data.test_reasoning_tool_calls import TOOLS, call
from ..data.test_template_families import LFM2_SHAPE, lfm_tokenizer
from .test_gemma4_calls import EVERY_KIND

QUESTION = [{"role": "user", "content": "Weather in Bern?"}]
STOP = "<|im_end|>"


def _prompt(tokenizer) -> str:
    return tokenizer.apply_chat_template(QUESTION, tools=TOOLS, add_generation_prompt=True, tokenize=False)


def _written(tokenizer, message: dict) -> str:
    """What a model trained on the template writes for `message` after the generation prompt, less its stop."""
    full = tokenizer.apply_chat_template(QUESTION + [message], tools=TOOLS, tokenize=False)
    assert full.startswith(_prompt(tokenizer))
    return full[len(_prompt(tokenizer)):].removesuffix(STOP + "\n")


def _parsed(tokenizer, reply: str, ended_by: str = STOP):
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in (reply, _prompt(tokenizer))]
    return parse_reply(tokenizer, ids[0], ids[1], TOOLS, ended_by)


def test_the_layout_is_read_off_the_template(tiny_model_dir) -> None:
    layout = call_layout(lfm_tokenizer(tiny_model_dir))
    assert (layout.kind, layout.marker, layout.closing, layout.listed) == (
        "python", "<|tool_call_start|>", "<|tool_call_end|>", True)


def test_a_call_reads_as_its_name_and_arguments_and_renders_back_as_written(tiny_model_dir) -> None:
    tokenizer = lfm_tokenizer(tiny_model_dir)
    reply = _written(tokenizer, {"role": "assistant", "content": "Let me check.", "tool_calls": [
        call("get_weather", {"city": "Bern"}, 1)]})
    assert reply == "Let me check.<|tool_call_start|>[get_weather(city='Bern')]<|tool_call_end|>"
    parts = _parsed(tokenizer, reply)
    assert (parts.tool_calls, parts.answer, parts.unreadable_call) == (
        ({"name": "get_weather", "arguments": {"city": "Bern"}},), "Let me check.", None)
    assert _written(tokenizer, parts.message()) == reply  # chat's history holds the call as the model wrote it


def test_parallel_calls_with_every_json_kind_and_text_after_them(tiny_model_dir) -> None:
    """Strings holding `]`, `)`, `,` and `:`, a negative float, True/False/None, a nested list, a nested dict (the
    template writes a dict as JSON, which Python reads as long as it holds no true/false/null)."""
    tokenizer = lfm_tokenizer(tiny_model_dir)
    message = {"role": "assistant", "content": "", "tool_calls": [
        call("get_weather", EVERY_KIND, 1), call("convert", {"celsius": 12}, 2)]}
    reply = _written(tokenizer, message) + "Checking both."
    assert reply.startswith("<|tool_call_start|>[get_weather(city='Bern, CH: {old town}]', days=3, celsius=-2.5, "
                            "hourly=True, alerts=False, region=None, hours=[6, 'noon', [18.5]], units={")
    parts = _parsed(tokenizer, reply)
    assert parts.tool_calls == ({"name": "get_weather", "arguments": EVERY_KIND},
                                {"name": "convert", "arguments": {"celsius": 12}})
    assert (parts.answer, parts.unreadable_call) == ("Checking both.", None)


def test_a_reply_cut_inside_a_call_is_unreadable_at_every_cut(tiny_model_dir) -> None:
    """Cut at --max_new_tokens anywhere before its `<|tool_call_end|>` (inside a string, after a whole `(...)`, after
    the list's `]`), the reply is an unreadable call shown as written, never a call."""
    tokenizer = lfm_tokenizer(tiny_model_dir)
    reply = _written(tokenizer, {"role": "assistant", "content": "", "tool_calls": [
        call("get_weather", {"city": "Bern, CH", "days": 3}, 1), call("convert", {"celsius": 12}, 2)]})
    ids = tokenizer(reply, add_special_tokens=False)["input_ids"]
    prompt = tokenizer(_prompt(tokenizer), add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids[-1]) == "<|tool_call_end|>"
    for cut in range(1, len(ids)):
        parts = parse_reply(tokenizer, ids[:cut], prompt, TOOLS, "")
        assert parts.tool_calls == () and parts.unreadable_call == tokenizer.decode(ids[:cut]).strip(), cut
    assert len(parse_reply(tokenizer, ids, prompt, TOOLS, STOP).tool_calls) == 2


@pytest.mark.parametrize("written", [
    "[get_weather(city=Bern)]",  # a name, not a literal
    "[get_weather('Bern')]",  # a positional argument
    "[get_weather(city='Bern', city='Chur')]",  # a keyword given twice
    "[get_weather(**{'city': 'Bern'})]",
    "[get_weather(city='Bern' + 'e')]",  # an expression
    "[get_weather(city=('Bern', 'CH'))]",  # a tuple: no JSON value
    "[get_weather(city={'Bern'})]",  # a set
    "[get_weather(units={\"rain\": true})]",  # JSON's true: no Python literal
    "[get_weather(city=f(x=1))]",
    "[(city='Bern')]",  # no name
    "[get_weather(city='Bern')] ]",
    "get_weather(city='Bern')",  # not the template's list
    "[get_weather(city='it's')]"])  # the template's quote inside its string
def test_a_call_that_is_not_python_literals_is_unreadable(tiny_model_dir, written) -> None:
    raw = f"<|tool_call_start|>{written}<|tool_call_end|>"
    read = read_calls(lfm_tokenizer(tiny_model_dir), raw, TOOLS, STOP)
    assert (read.calls, read.unreadable) == ((), raw)


def test_nesting_past_pythons_parser_is_unreadable_not_a_crash(tiny_model_dir) -> None:
    raw = "<|tool_call_start|>[get_weather(city=" + "[" * 5000 + "1" + "]" * 5000 + ")]<|tool_call_end|>"
    read = read_calls(lfm_tokenizer(tiny_model_dir), raw, TOOLS, STOP)
    assert (read.calls, read.unreadable) == ((), raw)


def test_a_template_whose_values_do_not_read_as_python_keeps_replies_as_text(tiny_model_dir) -> None:
    """The shape writing every value as JSON (`hourly=true`): the probe of every JSON kind does not read back, so no
    layout, and a call reads as text rather than as a call made up from it."""
    tokenizer = lfm_tokenizer(tiny_model_dir)
    tokenizer.chat_template = LFM2_SHAPE.replace("(v | tojson if v is mapping else v | string)", "v | tojson")
    message = {"role": "assistant", "content": "", "tool_calls": [call("get_weather", EVERY_KIND, 1)]}
    assert "hourly=true" in tokenizer.apply_chat_template(QUESTION + [message], tools=TOOLS, tokenize=False)
    assert call_layout(tokenizer) is None
    written = "<|tool_call_start|>[get_weather(city='Bern')]<|tool_call_end|>"
    assert read_calls(tokenizer, written, TOOLS).calls == ()


@pytest.mark.parametrize("written", [
    r"[get_weather(city='\bBern\b')]",  # Python reads backspaces where the model wrote a backslash and `b`
    r"[get_weather(city='C:\new\table')]",  # a newline and a tab
    r"[get_weather(city='it\'s')]",  # a quote the template does not escape
    "[get_weather(city='''it's''')]",  # nor writes in triple quotes
    "[get_weather(city='Be' 'rn')]",  # nor as two strings
    r"[get_weather(city=r'\d')]"])
def test_a_string_the_raw_template_cannot_have_written_is_unreadable(tiny_model_dir, written) -> None:
    """LFM2 writes a string between quotes as it is: Python's reading of a backslash in it would be a call with
    arguments the model never wrote (`'\\x08Bern\\x08'`), so it stays text."""
    tokenizer = lfm_tokenizer(tiny_model_dir)
    assert call_layout(tokenizer).raw_strings is True
    raw = f"<|tool_call_start|>{written}<|tool_call_end|>"
    read = read_calls(tokenizer, raw, TOOLS, STOP)
    assert (read.calls, read.unreadable) == ((), raw)
    quoted = "<|tool_call_start|>[get_weather(city='say \"hi\"', units={\"rain\": \"mm\"})]<|tool_call_end|>"
    assert read_calls(tokenizer, quoted, TOOLS, STOP).calls == (
        {"name": "get_weather", "arguments": {"city": 'say "hi"', "units": {"rain": "mm"}}},)


def test_a_template_that_escapes_its_strings_reads_them_with_pythons_rules(tiny_model_dir) -> None:
    """The shape writing a string as JSON (`city="C:\\\\new"`): the probe string's backslash and quotes read back,
    so a backslash escape reads as Python (and JSON) reads it."""
    tokenizer = lfm_tokenizer(tiny_model_dir)
    tokenizer.chat_template = LFM2_SHAPE.replace("\"'\" + v + \"'\" if v is string", "v | tojson if v is string")
    message = {"role": "assistant", "content": "", "tool_calls": [call("get_weather", {"city": "C:\\new 'x'"}, 1)]}
    reply = _written(tokenizer, message)
    assert reply == "<|tool_call_start|>[get_weather(city=\"C:\\\\new 'x'\")]<|tool_call_end|>"
    assert call_layout(tokenizer).raw_strings is False
    assert _parsed(tokenizer, reply).tool_calls == ({"name": "get_weather", "arguments": {"city": "C:\\new 'x'"}},)


def test_a_template_whose_probe_render_fails_has_no_layout_not_a_crash(tiny_model_dir) -> None:
    """A template raising on a null value fails its probe of every JSON kind: no layout, and parse_reply (run on
    every reply of generate, chat and compare) reads the call as text rather than crashing."""
    tokenizer = lfm_tokenizer(tiny_model_dir)
    tokenizer.chat_template = LFM2_SHAPE.replace(
        "{{- k + '=' }}", "{%- if v is none %}{{ raise_exception('no null') }}{%- endif %}{{- k + '=' }}")
    assert call_layout(tokenizer) is None
    reply = "<|tool_call_start|>[get_weather(city='Bern')]<|tool_call_end|>"
    assert _parsed(tokenizer, reply).tool_calls == ()
