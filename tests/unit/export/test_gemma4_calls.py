"""Gemma 4's calls (`<|tool_call>call:NAME{key:<|"|>text<|"|>,n:3}<tool_call|>`, its own object notation) read for
`--tools` by the notation read off its template: they read as text before (parse_reply's answer was the call as
written, `<|tool_call>call:get_weather{city:<|"|>Bern<|"|>}<tool_call|>` decoded, and no call)."""

from __future__ import annotations

import pytest

from open_sft.export.reply import parse_reply
from open_sft.export.tool_calls import call_layout, read_calls, was_right

from ..data.test_reasoning_tool_calls import TEMPLATES, TOOLS, call
from ..data.test_template_families import gemma4_tokenizer

QUESTION = [{"role": "user", "content": "Weather in Bern?"}]
STOP = "<|tool_response>"  # Gemma 4 stops there after a call (its generation_config eos ids)
# a value of each JSON kind, strings holding the notation's own `,` `}` `:` and brackets
EVERY_KIND = {"city": "Bern, CH: {old town}]", "days": 3, "celsius": -2.5, "hourly": True, "alerts": False,
              "region": None, "hours": [6, "noon", [18.5]], "units": {"wind": {"speed": "km/h"}, "rain": "mm"}}


def _prompt(tokenizer) -> str:
    return tokenizer.apply_chat_template(QUESTION, tools=TOOLS, add_generation_prompt=True, tokenize=False)


def _written(tokenizer, message: dict) -> str:
    """What a model trained on the template writes for `message`, up to the token it stops at after a call: the
    template's rendering of the turn after the generation prompt (Gemma 4 writes the calls before the content)."""
    full = tokenizer.apply_chat_template(QUESTION + [message], tools=TOOLS, tokenize=False)
    prompt = _prompt(tokenizer)[:-len("<|channel>thought\n<channel|>")]  # the empty thought block: context only
    assert full.startswith(prompt)
    return full[len(prompt):].removesuffix("<turn|>\n")


def _parsed(tokenizer, reply: str, ended_by: str = STOP):
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in (reply, _prompt(tokenizer))]
    return parse_reply(tokenizer, ids[0], ids[1], TOOLS, ended_by)


def test_the_notation_is_read_off_the_template(tiny_model_dir) -> None:
    layout = call_layout(gemma4_tokenizer(tiny_model_dir))
    assert (layout.kind, layout.marker, layout.closing) == ("object", "<|tool_call>call:", "<tool_call|>")
    assert layout.notation.quote == '<|"|>'
    assert dict(layout.notation.literals) == {"true": True, "false": False, "None": None}  # Jinja writes None


def test_a_call_reads_as_its_name_and_arguments(tiny_model_dir) -> None:
    tokenizer = gemma4_tokenizer(tiny_model_dir)
    reply = _written(tokenizer, {"role": "assistant", "content": "", "tool_calls": [call("get_weather", {
        "city": "Bern"}, 1)]})
    assert reply == '<|tool_call>call:get_weather{city:<|"|>Bern<|"|>}<tool_call|>'
    parts = _parsed(tokenizer, reply)
    assert parts.tool_calls == ({"name": "get_weather", "arguments": {"city": "Bern"}},)
    assert (parts.answer, parts.unreadable_call) == ("", None)


def test_parallel_calls_with_every_json_kind_and_text_around_them(tiny_model_dir) -> None:
    tokenizer = gemma4_tokenizer(tiny_model_dir)
    message = {"role": "assistant", "content": "Checking both.", "tool_calls": [
        call("get_weather", EVERY_KIND, 1), call("convert", {"celsius": 12}, 2)]}
    reply = _written(tokenizer, message)
    assert reply.startswith('<|tool_call>call:get_weather{alerts:false,celsius:-2.5,city:<|"|>Bern, CH: {old town}]'
                            '<|"|>,days:3,hourly:true,hours:[6,<|"|>noon<|"|>,[18.5]],region:None,units:{rain:')
    assert reply.endswith("<tool_call|>Checking both.")
    expected = ({"name": "get_weather", "arguments": EVERY_KIND}, {"name": "convert", "arguments": {"celsius": 12}})
    parts = _parsed(tokenizer, reply, "<turn|>")
    assert (parts.tool_calls, parts.answer) == (expected, "Checking both.")
    before = _parsed(tokenizer, "Let me look that up." + reply.removesuffix("Checking both."))  # text before a call
    assert (before.tool_calls, before.answer) == (expected, "Let me look that up.")


def test_a_reply_cut_inside_a_call_is_unreadable_at_every_cut(tiny_model_dir) -> None:
    """Cut at --max_new_tokens anywhere before its `<tool_call|>` (inside a string, between a key and its value, after
    a complete object), the reply is an unreadable call shown as written, never a call."""
    tokenizer = gemma4_tokenizer(tiny_model_dir)
    reply = _written(tokenizer, {"role": "assistant", "content": "", "tool_calls": [
        call("get_weather", {"city": "Bern, CH", "days": 3, "units": {"rain": "mm"}}, 1)]})
    ids = tokenizer(reply, add_special_tokens=False)["input_ids"]
    prompt = tokenizer(_prompt(tokenizer), add_special_tokens=False)["input_ids"]
    closing = tokenizer.convert_tokens_to_ids("<tool_call|>")
    assert ids[-1] == closing and ids.count(closing) == 1
    unreadable = []
    for cut in range(1, len(ids)):
        parts = parse_reply(tokenizer, ids[:cut], prompt, TOOLS, "")
        assert parts.tool_calls == (), cut
        unreadable.append(parts.unreadable_call == tokenizer.decode(ids[:cut]).strip())
    assert unreadable == [tokenizer.decode(ids[:cut]).startswith("<|tool_call>call:") for cut in range(1, len(ids))]
    marker_at = unreadable.index(True)  # before the whole marker `<|tool_call>call:`, no call and no marker: text
    assert "<|tool_call>call:".startswith(tokenizer.decode(ids[:marker_at])) and not any(unreadable[:marker_at])
    assert all(unreadable[marker_at:]) and len(unreadable[marker_at:]) > 20
    assert parse_reply(tokenizer, ids, prompt, TOOLS, STOP).tool_calls[0]["arguments"]["units"] == {"rain": "mm"}


@pytest.mark.parametrize("written", [
    '<|tool_call>call:get_weather{city:Bern}<tool_call|>',  # a bare word: not a value of the notation
    '<|tool_call>call:get_weather{city:<|"|>Bern<|"|>,}<tool_call|>',
    '<|tool_call>call:get_weather{"city":"Bern"}<tool_call|>',  # JSON's quote is not the template's
    '<|tool_call>call:get_weather{city:<|"|>Bern<|"|>}}<tool_call|>',
    '<|tool_call>call:{city:<|"|>Bern<|"|>}<tool_call|>'])  # no name
def test_a_call_not_in_the_notation_is_unreadable(tiny_model_dir, written) -> None:
    read = read_calls(gemma4_tokenizer(tiny_model_dir), written, TOOLS, STOP)
    assert (read.calls, read.unreadable) == ((), written)


def test_nesting_past_pythons_depth_is_unreadable_not_a_crash(tiny_model_dir) -> None:
    written = "<|tool_call>call:get_weather{city:" + "[" * 5000 + "1" + "]" * 5000 + "}<tool_call|>"
    read = read_calls(gemma4_tokenizer(tiny_model_dir), written, TOOLS, STOP)
    assert (read.calls, read.unreadable) == ((), written)


def test_a_template_whose_notation_does_not_read_back_keeps_replies_as_text(tiny_model_dir) -> None:
    """A nested object written `key=value` (not in the notation read off the top level's `key:value`): the check on a
    probe of every JSON kind fails, so no layout, and a call reads as text rather than as a call made up from it."""
    tokenizer = gemma4_tokenizer(tiny_model_dir)
    nested = "{{- format_argument(value, escape_keys=escape_keys) -}}"  # how format_argument writes an object's value
    tokenizer.chat_template = (TEMPLATES / "gemma4.jinja").read_text().replace(":" + nested, "=" + nested)
    assert call_layout(tokenizer) is None
    written = '<|tool_call>call:get_weather{city:<|"|>Bern<|"|>}<tool_call|>'
    assert read_calls(tokenizer, written, TOOLS).calls == ()


def test_chat_history_renders_the_call_as_written_and_compare_scores_it(tiny_model_dir) -> None:
    from open_sft.export.chat import tool_result

    tokenizer = gemma4_tokenizer(tiny_model_dir)
    message = {"role": "assistant", "content": "", "tool_calls": [call("get_weather", EVERY_KIND, 1)]}
    reply = _written(tokenizer, message)
    parts = _parsed(tokenizer, reply)
    messages = QUESTION + [parts.message()]
    messages.append(tool_result(messages, '{"temp_c": 5}'))
    prompt = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert prompt == _prompt(tokenizer)[:-len("<|channel>thought\n<channel|>")] + reply + (
        '<turn|>\n<|turn>tool\n{"temp_c": 5}<turn|>\n<|turn>model\n<|channel>thought\n<channel|>')
    row = {"messages": QUESTION + [message]}
    assert was_right(row, parts, lambda expected, got: False)
    other = _parsed(tokenizer, reply.replace("Bern", "Chur"))
    assert other.tool_calls[0]["arguments"]["city"] == "Chur, CH: {old town}]"
    assert not was_right(row, other, lambda expected, got: False)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


def _chat(monkeypatch, model, tokenizer, replies: list[str], lines: list[str]) -> tuple[list[str], str]:
    """(the prompts chat rendered, its output) with `model` made to write `replies` in turn (each ending at one of
    Gemma 4's stops, `<|tool_response>` or `<turn|>`) for `lines` typed."""
    import io

    import torch

    from open_sft.export.chat import chat

    queue = [tokenizer(reply, add_special_tokens=False)["input_ids"] for reply in replies]
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids([STOP, "<turn|>"])
    prompts = []
    call_layout(tokenizer)

    def generate(**kwargs):
        prompts.append(tokenizer.decode(kwargs["input_ids"][0]))
        return torch.cat([kwargs["input_ids"], torch.tensor([queue.pop(0)], dtype=torch.long)], dim=1)

    monkeypatch.setattr(model, "generate", generate)
    typed, out = iter(lines + ["/exit"]), io.StringIO()
    chat(model, tokenizer, lambda: next(typed), out, max_new_tokens=64, tools=TOOLS)
    return prompts, out.getvalue()


def test_chat_gives_results_back_where_the_model_stopped_for_them(tiny_model_dir, model, monkeypatch) -> None:
    """A reply that stops at `<|tool_response>` after its calls (Gemma 4's own form, a stop of its export) gets its
    /tool results right there, as `tool_responses` of the calling message (a JSON object as an object, other text as
    its `value`), and goes on in the same turn; a tool message (the prompt before) was a turn of its own,
    `<turn|>\\n<|turn>tool\\n...`, after a turn the model never closed. A reply that ends its turn after the call
    (`<turn|>`: a model trained on tool messages) gets a tool message as before."""
    tokenizer = gemma4_tokenizer(tiny_model_dir)
    two = _written(tokenizer, {"role": "assistant", "content": "", "tool_calls": [
        call("get_weather", {"city": "Bern"}, 1), call("convert", {"celsius": 12}, 2)]})
    prompts, out = _chat(monkeypatch, model, tokenizer, [two + STOP, "Bern: sunny, 53.6 F.<turn|>"],
                         ["Weather in Bern?", '/tool {"temp_c": 12}', "/tool sunny"])
    assert len(prompts) == 2 and prompts[1] == _prompt(tokenizer)[:-len("<|channel>thought\n<channel|>")] + two + (
        "<|tool_response>response:get_weather{temp_c:12}<tool_response|>"
        '<|tool_response>response:convert{value:<|"|>sunny<|"|>}<tool_response|><|channel>thought\n<channel|>')
    assert '[tool call] get_weather {"city": "Bern"}' in out and "Bern: sunny, 53.6 F." in out
    one = _written(tokenizer, {"role": "assistant", "content": "", "tool_calls": [call("get_weather", {
        "city": "Bern"}, 1)]})
    prompts, _ = _chat(monkeypatch, model, tokenizer, [one + "<turn|>", "Bern: 12.<turn|>"],
                       ["Weather in Bern?", '/tool {"temp_c": 12}'])
    assert prompts[1].endswith(one + '<turn|>\n<|turn>tool\n{"temp_c": 12}<turn|>\n<|turn>model\n'
                                     "<|channel>thought\n<channel|>")
