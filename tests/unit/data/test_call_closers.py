"""Tool-call turns under templates whose calls are closed by a special token that is not the end of the turn:
Phi-4-mini's `<|/tool_call|>`, Seed-OSS's `</seed:tool_call>`, MiniMax-M2's `</minimax:tool_call>`, Kimi-K2's
`<|tool_call_end|>` and `<|tool_calls_section_end|>` (tests/data/chat_templates). Such a token closes what the turn
opened: the turn trains through its real end of turn (in history too) and generation does not stop there (it
stopped after a turn's first call)."""

from __future__ import annotations

import pytest
from tokenizers import AddedToken
from transformers import AutoTokenizer

from open_sft.export.save import end_of_turn_ids
from tests.unit.data.test_reasoning_tool_calls import TEMPLATES, TOOLS, build, trained_runs

# per family: the template, its special tokens, eos, what ends a turn (the stops generation_config gets)
FAMILIES = {
    "phi_4_mini": ("phi_4_mini.jinja", ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|tool|>", "<|/tool|>",
                   "<|tool_call|>", "<|/tool_call|>", "<|tool_response|>"], "<|endoftext|>",
                   ["<|endoftext|>", "<|end|>"]),
    "seed_oss": ("seed_oss.jinja", ["<seed:bos>", "<seed:eos>", "<seed:tool_call>", "</seed:tool_call>",
                 "<seed:think>", "</seed:think>"], "<seed:eos>", ["<seed:eos>"]),
    "minimax_m2": ("minimax_m2.jinja", ["]~!b[", "]~b]", "[e~[", "<minimax:tool_call>", "</minimax:tool_call>",
                   "<think>", "</think>"], "[e~[", ["[e~["]),
    "kimi_k2_thinking": ("kimi_k2_thinking.jinja", ["<|im_system|>", "<|im_user|>", "<|im_assistant|>",
                         "<|im_middle|>", "<|im_end|>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                         "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"], "<|im_end|>",
                         ["<|im_end|>"]),
}


def template_tokenizer(tiny_model_dir, template: str, specials: list[str], eos: str, bos: str | None = None):
    """The tiny tokenizer with a template (a fixture file's name, or a shape's own text), its special tokens and its
    eos (and bos)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in specials], special_tokens=True)
    tokenizer.eos_token = eos
    tokenizer.chat_template = template if "{" in template else (TEMPLATES / template).read_text()
    if bos:
        tokenizer.bos_token = bos
    return tokenizer


def tokenizer_for(tiny_model_dir, family: str):
    template, specials, eos, _ = FAMILIES[family]
    return template_tokenizer(tiny_model_dir, template, specials, eos, "<seed:bos>" if family == "seed_oss" else None)


def _call(city: str, n: int) -> dict:  # Kimi-K2's own ids: functions.NAME:INDEX (its template writes the id alone)
    return {"id": f"functions.get_weather:{n}", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": city}}}


PARALLEL = {"tools": TOOLS, "messages": [  # two calls in one turn, their results, an answer
    {"role": "user", "content": "Weather in Paris and Lyon?"},
    {"role": "assistant", "content": "", "reasoning_content": "Two cities, two calls.",
     "tool_calls": [_call("Paris", 0), _call("Lyon", 1)]},
    {"role": "tool", "content": '{"temp_c": 12}', "tool_call_id": "functions.get_weather:0"},
    {"role": "tool", "content": '{"temp_c": 15}', "tool_call_id": "functions.get_weather:1"},
    {"role": "assistant", "content": "Paris 12, Lyon 15."}]}
# what each template writes for the call turn after its context (MiniMax-M2's generation prompt opens <think>\n)
CALL_TURN = {
    "phi_4_mini": '<|tool_call|>{"name": "get_weather", "arguments": {"city": "Paris"}}<|/tool_call|><|tool_call|>'
                  '{"name": "get_weather", "arguments": {"city": "Lyon"}}<|/tool_call|><|end|>',
    "seed_oss": "<seed:think>Two cities, two calls.</seed:think>\n<seed:tool_call>\n<function=get_weather>\n"
                "<parameter=city>Paris</parameter>\n</function>\n</seed:tool_call>\n<seed:tool_call>\n"
                "<function=get_weather>\n<parameter=city>Lyon</parameter>\n</function>\n</seed:tool_call><seed:eos>",
    "minimax_m2": 'Two cities, two calls.\n</think>\n\n\n<minimax:tool_call>\n<invoke name="get_weather">\n'
                  '<parameter name="city">Paris</parameter>\n</invoke>\n<invoke name="get_weather">\n'
                  '<parameter name="city">Lyon</parameter>\n</invoke>\n</minimax:tool_call>\n[e~[',
    "kimi_k2_thinking": "<think>Two cities, two calls.</think><|tool_calls_section_begin|><|tool_call_begin|>"
                        'functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
                        '<|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>{"city": "Lyon"}'
                        "<|tool_call_end|><|tool_calls_section_end|><|im_end|>",
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_call_turn_trains_through_its_end_of_turn_not_its_calls_closer(tiny_model_dir, tmp_path, family) -> None:
    """The call turn, in history before the answer, trained only up to its last call's closer (`<|/tool_call|>`,
    `</seed:tool_call>`, `</minimax:tool_call>`, `<|tool_call_end|>`), never its end of turn, and the exported stops
    held that closer, so generation ended after the first of parallel calls."""
    tokenizer = tokenizer_for(tiny_model_dir, family)
    examples, (report,) = build(tokenizer, tmp_path, [PARALLEL])
    runs = trained_runs(tokenizer, examples)
    messages = PARALLEL["messages"]
    context = tokenizer.apply_chat_template(messages[:1], tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert (context, CALL_TURN[family]) in runs
    through = tokenizer.apply_chat_template(messages[:2], tools=TOOLS, tokenize=False)
    assert CALL_TURN[family] in through  # the turn as the template writes it, its end of turn included
    assert report.rows_kept == 1 and not report.dropped
    assert end_of_turn_ids(tokenizer) == tokenizer.convert_tokens_to_ids(FAMILIES[family][3])


COMMAND_R7B = ["<BOS_TOKEN>", "<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>", "<|SYSTEM_TOKEN|>", "<|USER_TOKEN|>",
               "<|CHATBOT_TOKEN|>", "<|START_THINKING|>", "<|END_THINKING|>", "<|START_ACTION|>", "<|END_ACTION|>",
               "<|START_RESPONSE|>", "<|END_RESPONSE|>", "<|START_TOOL_RESULT|>", "<|END_TOOL_RESULT|>"]
# The shape of Command R7B's tool-use template (CohereForAI/c4ai-command-r7b-12-2024, whose licence, CC-BY-NC-4.0, keeps
# its text out of this repository), written here in a few lines: a system turn listing the tools; a call turn as
# <|START_THINKING|>plan<|END_THINKING|><|START_ACTION|>[one JSON call a line, numbered through the conversation]
# <|END_ACTION|>; an answer as <|START_RESPONSE|>...<|END_RESPONSE|>; the results of consecutive tool messages as
# one system turn, each by its call's number; and the generation prompt after every conversation, asked for or not.
COMMAND_R7B_SHAPE = (
    "{{ bos_token }}{%- set ns = namespace(ids=[]) %}<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>You are Command."
    "{%- if messages[0].role == 'system' %}{{ '\\n' + messages[0].content }}{% endif %}"
    "{%- if tools %}{{ '\\n## Available Tools\\n' + tools | tojson }}{% endif %}<|END_OF_TURN_TOKEN|>"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and not loop.first %}"
    "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>{{ m.content }}<|END_OF_TURN_TOKEN|>"
    "{%- elif m.role == 'user' %}<|START_OF_TURN_TOKEN|><|USER_TOKEN|>{{ m.content }}<|END_OF_TURN_TOKEN|>"
    "{%- elif m.role == 'assistant' and m.tool_calls %}<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_THINKING|>"
    "{{ m.reasoning_content }}<|END_THINKING|><|START_ACTION|>[{%- for c in m.tool_calls %}{{ ',' if not loop.first }}"
    "{{ '\\n    ' }}{\"tool_call_id\": \"{{ ns.ids | length }}\", \"tool_name\": \"{{ c.function.name }}\", "
    "\"parameters\": {{ c.function.arguments | tojson }}}{%- set ns.ids = ns.ids + [c.id] %}{% endfor %}"
    "{{ '\\n' }}]<|END_ACTION|><|END_OF_TURN_TOKEN|>"
    "{%- elif m.role == 'assistant' %}"
    "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_RESPONSE|>{{ m.content }}<|END_RESPONSE|><|END_OF_TURN_TOKEN|>"
    "{%- elif m.role == 'tool' %}{%- if loop.previtem is not defined or loop.previtem.role != 'tool' %}"
    "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|><|START_TOOL_RESULT|>[{% else %},{% endif %}{{ '\\n    ' }}"
    "{\"tool_call_id\": \"{{ ns.ids.index(m.tool_call_id) if m.tool_call_id in ns.ids }}\", \"results\": "
    "{\"0\": {{ m.content | tojson }}}, \"is_error\": null}"
    "{%- if loop.nextitem is not defined or loop.nextitem.role != 'tool' %}"
    "{{ '\\n' }}]<|END_TOOL_RESULT|><|END_OF_TURN_TOKEN|>{% endif %}"
    "{%- endif %}{%- endfor %}<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"
)


def command_r7b_tokenizer(tiny_model_dir):
    """The tiny tokenizer with Command R7B's special tokens, its eos and bos, and its template's shape."""
    return template_tokenizer(tiny_model_dir, COMMAND_R7B_SHAPE, COMMAND_R7B, "<|END_OF_TURN_TOKEN|>", "<BOS_TOKEN>")


def test_command_r7b_turns_end_at_end_of_turn_not_its_response_closer_or_trailing_prompt(tiny_model_dir,
                                                                                          tmp_path) -> None:
    """Command R7B's template closes an answer with <|END_RESPONSE|><|END_OF_TURN_TOKEN|> and writes its generation
    prompt, <|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>, after every conversation: the last turn trained that prompt too
    (a turn the model never writes), and turns in history stopped at <|END_RESPONSE|> / <|END_ACTION|>."""
    tokenizer = command_r7b_tokenizer(tiny_model_dir)
    examples, (report,) = build(tokenizer, tmp_path, [PARALLEL])
    assert [run for _, run in trained_runs(tokenizer, examples)] == [
        '<|START_THINKING|>Two cities, two calls.<|END_THINKING|><|START_ACTION|>[\n    {"tool_call_id": "0", '
        '"tool_name": "get_weather", "parameters": {"city": "Paris"}},\n    {"tool_call_id": "1", "tool_name": '
        '"get_weather", "parameters": {"city": "Lyon"}}\n]<|END_ACTION|><|END_OF_TURN_TOKEN|>',
        "<|START_RESPONSE|>Paris 12, Lyon 15.<|END_RESPONSE|><|END_OF_TURN_TOKEN|>"]
    assert report.rows_kept == 1 and report.examples == 1
    stops = tokenizer.convert_ids_to_tokens(end_of_turn_ids(tokenizer))
    assert stops[0] == "<|END_OF_TURN_TOKEN|>" and not {"<|END_RESPONSE|>", "<|END_ACTION|>",
                                                         "<|CHATBOT_TOKEN|>"} & set(stops)


# Kimi-K3's shape (written here, not copied): every element opened `<|open|>x<|sep|>`, closed `<|close|>x<|sep|>`, a
# message ended `<|end_of_msg|>`; the generation prompt opens the assistant message and its think element
K3 = ("{%- macro o(t) %}{{ '<|open|>' + t + '<|sep|>' }}{% endmacro %}{%- macro c(t) %}{{ '<|close|>' + t + '<|sep|>' }}"
      "{% endmacro %}{%- if tools %}{{ o('message role=\"system\" type=\"tool-declare\"') + (tools | tojson) }}"
      "{{ c('message') + '<|end_of_msg|>' }}{% endif %}{%- for m in messages %}{%- if m.role == 'assistant' %}"
      "{{ o('message role=\"assistant\"') + o('think') + (m.reasoning_content or '') + c('think') + o('response') }}"
      "{{ (m.content or '') + c('response') }}{%- if m.tool_calls %}{{ o('tools') }}{% for t in m.tool_calls %}"
      "{{ o('call tool=\"' + t.function.name + '\" index=\"' + loop.index|string + '\"') }}"
      "{%- for k, v in t.function.arguments.items() %}{{ o('argument key=\"' + k + '\" type=\"string\"') + v }}"
      "{{ c('argument') }}{% endfor %}{{ c('call') }}{% endfor %}{{ c('tools') }}{% endif %}"
      "{{ c('message') + '<|end_of_msg|>' }}{%- else %}{{ o('message role=\"' + m.role + '\"') + m.content }}"
      "{{ c('message') + '<|end_of_msg|>' }}{% endif %}{% endfor %}"
      "{%- if add_generation_prompt %}{{ o('message role=\"assistant\"') + o('think') }}{% endif %}")


def test_kimi_k3_element_tags_inside_a_turn_are_no_stops(tiny_model_dir, tmp_path) -> None:
    """Kimi-K3's `<|close|>` and `<|sep|>`, special tokens, close every element, also the message
    (`<|close|>message<|sep|><|end_of_msg|>`): they were taken for ends of turn, every turn (which writes them after
    its trace) was refused as turn_not_generable, and generation would stop after the trace. A token the turn
    writes before its content is the turn's text; the turn ends at <|end_of_msg|>. A reply's calls in that format are
    shown as text (no layout reads them), never a wrong call."""
    from open_sft.export.tool_calls import split_calls

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in [
        "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"]], special_tokens=True)
    tokenizer.eos_token, tokenizer.chat_template = "<|end_of_msg|>", K3
    row = {"tools": TOOLS, "messages": [
        PARALLEL["messages"][0], {**PARALLEL["messages"][1], "tool_calls": [_call("Paris", 0)]},
        PARALLEL["messages"][2], {"role": "assistant", "content": "Paris 12.", "reasoning_content": "It said 12."}]}
    examples, (report,) = build(tokenizer, tmp_path, [row])
    runs = trained_runs(tokenizer, examples)
    assert [run for _, run in runs] == [
        'Two cities, two calls.<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>'
        '<|open|>call tool="get_weather" index="1"<|sep|><|open|>argument key="city" type="string"<|sep|>Paris'
        '<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>',
        "It said 12.<|close|>think<|sep|><|open|>response<|sep|>Paris 12.<|close|>response<|sep|><|close|>message"
        "<|sep|><|end_of_msg|>"]
    assert [before for before, _ in runs] == [tokenizer.apply_chat_template(
        row["messages"][:k], tools=TOOLS, add_generation_prompt=True, tokenize=False) for k in (1, 3)]
    assert report.rows_kept == 1 and not report.dropped
    assert end_of_turn_ids(tokenizer) == tokenizer.convert_tokens_to_ids(["<|end_of_msg|>"])
    reply = runs[0][1].removesuffix("<|end_of_msg|>")
    assert split_calls(tokenizer, reply, TOOLS) == (reply, [])


def test_a_template_that_needs_tools_says_so_for_a_row_without_them(tiny_model_dir, tmp_path) -> None:
    """llama.cpp's form of Phi-4-mini's template iterates `tools` whenever it is defined, and apply_chat_template
    defines it (None) for every row: a row without tools failed with "fix the row", though the row is fine. The
    error names the cause and the fix; with --on_bad_row drop such rows are counted as template_needs_tools. Rows
    with tools train."""
    from open_sft.errors import UserError

    tokenizer = tokenizer_for(tiny_model_dir, "phi_4_mini")
    plain = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    with pytest.raises(TypeError, match="'NoneType' object is not iterable"):
        tokenizer.apply_chat_template(plain["messages"], tokenize=False)
    (tmp_path / "alone").mkdir()
    with pytest.raises(UserError, match=r"line 1: the chat template cannot render a conversation without tools "
                       r"\(TypeError: 'NoneType' object is not iterable; it renders this one given a tools list\): the "
                       r"row is fine, the template needs a tools list\. Choose a form of the template") as raised:
        build(tokenizer, tmp_path / "alone", [plain])
    assert "fix the row" not in str(raised.value)
    with_tools = {"tools": TOOLS, "messages": [{"role": "user", "content": "Hi"},
                                               {"role": "assistant", "content": "Hello."}]}
    examples, (report,) = build(tokenizer, tmp_path, [plain, with_tools], on_bad_row="drop")
    assert dict(report.dropped) == {"template_needs_tools": 1} and report.rows_kept == 1
    assert [run for _, run in trained_runs(tokenizer, examples)] == ["Hello.<|end|><|endoftext|>"]
