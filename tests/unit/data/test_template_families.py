"""Tool-calling conversations under more families' shipped chat templates (tests/data/chat_templates; LFM2's in its
shape, written here): every assistant turn trains after exactly the context apply_chat_template gives it with the generation prompt, through
the token the model stops at, and the exported generation config stops there."""

from __future__ import annotations

import json

from transformers import AutoTokenizer

from open_sft.data.formats import to_messages
from open_sft.data.labels import IGNORE_INDEX
from tests.unit.data.test_reasoning_tool_calls import TEMPLATES, build, call, tool, trained_runs

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
# xLAM/glaive-style: no tool call ids, arguments as a JSON string; then a call with reasoning and a final answer
LFM_ROW = {"tools": TOOLS, "messages": [
    {"role": "user", "content": "Weather in Bern?"},
    {"role": "assistant", "content": "Let me check.",
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Bern"}'}}]},
    {"role": "tool", "content": '{"temp_c": 5}'},
    {"role": "assistant", "content": "", "reasoning_content": "Now Chur.",
     "tool_calls": [call("get_weather", {"city": "Chur"}, 1)]},
    tool('{"temp_c": 2}', 1),
    {"role": "assistant", "content": "Bern 5, Chur 2.", "reasoning_content": "Both known."}]}


# The shape of LFM2's template (LiquidAI/LFM2.5-8B-A1B, whose LFM Open License limits commercial use, so its text is
# not in this repository), written here in a few lines: ChatML turns, the tools as JSON in the system turn; an
# assistant turn inside {% generation %}: its think block (kept after the last user turn only, dropped from the
# content of earlier ones), its content, its calls as a Python list, <|tool_call_start|>[f(x='y')]<|tool_call_end|>
# (string arguments quoted with ', objects as JSON), then <|im_end|>.
LFM2_SHAPE = (
    "{{- bos_token }}{%- set ns = namespace(system='', last_user=-1) %}"
    "{%- if messages[0].role == 'system' %}{%- set ns.system = messages[0].content %}"
    "{%- set messages = messages[1:] %}{%- endif %}"
    "{%- if tools %}{%- set ns.system = ns.system + ('\\n\\n' if ns.system else '') + 'List of tools: '"
    " + tools | tojson %}{%- endif %}{%- if ns.system %}{{- '<|im_start|>system\\n' + ns.system + '<|im_end|>\\n' }}"
    "{%- endif %}{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' }}{%- set content = m.content or '' %}"
    "{%- if m.role == 'assistant' %}{%- generation %}{%- if loop.index0 > ns.last_user %}"
    "{%- if m.thinking is defined %}{{- '<think>' + m.thinking + '</think>' }}{%- endif %}"
    "{%- elif '</think>' in content %}{%- set content = content.split('</think>')[-1] | trim %}{%- endif %}"
    "{{- content }}{%- if m.tool_calls %}{{- '<|tool_call_start|>[' }}{%- for c in m.tool_calls %}"
    "{{- ', ' if not loop.first }}{{- c.function.name + '(' }}{%- for k, v in c.function.arguments.items() %}"
    "{{- ', ' if not loop.first }}{{- k + '=' }}"
    "{{- \"'\" + v + \"'\" if v is string else (v | tojson if v is mapping else v | string) }}{%- endfor %}"
    "{{- ')' }}{%- endfor %}{{- ']<|tool_call_end|>' }}{%- endif %}{{- '<|im_end|>\\n' }}{%- endgeneration %}"
    "{%- else %}{{- content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def lfm_tokenizer(tiny_model_dir):
    """LFM2's special tokens as its tokenizer marks them: <|tool_call_start|> and <|tool_call_end|> are special."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_special_tokens({"bos_token": "<|startoftext|>", "eos_token": "<|im_end|>", "additional_special_tokens": [
        "<|im_start|>", "<|tool_call_start|>", "<|tool_call_end|>"]})
    tokenizer.chat_template = LFM2_SHAPE
    return tokenizer


def test_lfm2_a_call_turn_in_history_trains_through_im_end(tiny_model_dir, tmp_path) -> None:
    """LFM2's template closes a call `<|tool_call_start|>[f(x='y')]<|tool_call_end|><|im_end|>`, both special tokens:
    <|tool_call_end|> was taken for an end of turn, so every call turn a tool result followed trained without the
    <|im_end|> the model stops at (a call ending the row trained it), and the exported generation config stopped at
    <|tool_call_end|>. A token closing a start/end pair the turn opened is the turn's text now."""
    from open_sft.export.save import end_of_turn_ids

    tokenizer = lfm_tokenizer(tiny_model_dir)
    examples, (report,) = build(tokenizer, tmp_path, [LFM_ROW])
    runs = trained_runs(tokenizer, examples)
    assert [run for _, run in runs] == [
        "Let me check.<|tool_call_start|>[get_weather(city='Bern')]<|tool_call_end|><|im_end|>",
        "<think>Now Chur.</think><|tool_call_start|>[get_weather(city='Chur')]<|tool_call_end|><|im_end|>",
        "<think>Both known.</think>Bern 5, Chur 2.<|im_end|>"]
    messages = to_messages(LFM_ROW, "messages")
    contexts = [tokenizer.apply_chat_template(messages[:k], tools=messages.tools, add_generation_prompt=True,
                                              tokenize=False) for k in (1, 3, 5)]
    assert [before for before, _ in runs] == contexts
    assert report.generation_tags_disagree == 0
    assert end_of_turn_ids(tokenizer) == tokenizer.convert_tokens_to_ids(["<|im_end|>"])


def test_lfm2_calls_written_as_python_read_as_calls(tiny_model_dir) -> None:
    """generate/chat --tools under LFM2's template: its calls are Python expressions, read by the python layout
    (tests/unit/export/test_python_calls.py); before it the reply was shown as text."""
    from open_sft.export.tool_calls import call_layout, split_calls

    tokenizer = lfm_tokenizer(tiny_model_dir)
    reply = "Sure.<|tool_call_start|>[get_weather(city='Bern'), get_weather(city='Chur')]<|tool_call_end|>"
    assert call_layout(tokenizer).kind == "python"
    assert split_calls(tokenizer, reply, TOOLS) == ("Sure.", [{"name": "get_weather", "arguments": {"city": "Bern"}},
                                                            {"name": "get_weather", "arguments": {"city": "Chur"}}])


def nemotron_tokenizer(tiny_model_dir):
    """Nemotron-Nano-v2's turn tokens, special as its tokenizer marks them; <SPECIAL_12> ends a turn."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_special_tokens({"eos_token": "<SPECIAL_12>", "additional_special_tokens": [
        "<SPECIAL_10>", "<SPECIAL_11>"]})
    tokenizer.add_tokens(["<think>", "</think>", "<TOOLCALL>", "</TOOLCALL>"])
    tokenizer.chat_template = (TEMPLATES / "nemotron_nano_v2.jinja").read_text()
    return tokenizer


def test_nemotron_a_turn_with_content_and_calls_trains_as_one_turn(tiny_model_dir, tmp_path) -> None:
    """Nemotron-Nano-v2's template writes a last assistant message with content and calls as two assistant turns
    (`Let me check.\\n<SPECIAL_12>\\n\\n<SPECIAL_11>Assistant\\n<TOOLCALL>[...]`), in history as one. The two trained
    as one run taught the model to stop after 'Let me check.' and never call. A run holding a stop token with more
    text after it cannot be generated: the turn trains as history writes it, as the model generates it in one go."""
    from open_sft.export.save import end_of_turn_ids

    tokenizer = nemotron_tokenizer(tiny_model_dir)
    ending = {"tools": TOOLS, "messages": LFM_ROW["messages"][:2]}  # the call turn ends the row
    answered = {"tools": TOOLS, "messages": [*LFM_ROW["messages"][:3],
                                             {"role": "assistant", "content": "Bern has 5 degrees."}]}
    examples, (report,) = build(tokenizer, tmp_path, [ending, answered])
    runs = trained_runs(tokenizer, examples)
    call_turn = ('Let me check.\n\n<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Bern"}}]</TOOLCALL>\n'
                 "<SPECIAL_12>")
    assert [run for _, run in runs] == [call_turn, call_turn, "Bern has 5 degrees.\n<SPECIAL_12>"]
    messages = to_messages(answered, "messages")
    history = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    prompt = tokenizer.apply_chat_template(messages[:1], tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<SPECIAL_11>Assistant\n<think>\n\n")  # context: as much of it as the turn writes
    opening = prompt[: -len("<think>\n\n")]
    assert [before for before, _ in runs[:2]] == [opening, opening]
    assert history.startswith(opening + call_turn)
    last = tokenizer.apply_chat_template(messages[:2], tools=TOOLS, tokenize=False)
    assert last.startswith(opening + "<think>\n\nLet me check.\n<SPECIAL_12>\n\n<SPECIAL_11>Assistant\n<TOOLCALL>")
    assert [before for before, _ in runs[2:]] == [
        tokenizer.apply_chat_template(messages[:3], tools=TOOLS, add_generation_prompt=True, tokenize=False)]
    assert report.examples == 2 and report.rows_kept == 2 and not report.dropped
    assert end_of_turn_ids(tokenizer) == tokenizer.convert_tokens_to_ids(["<SPECIAL_12>"])


def test_gemma4_call_turns_train_through_turn_end_after_the_whole_prompt(tiny_model_dir, tmp_path) -> None:
    """Gemma 4 spells its call's tags as halves, `<|tool_call>` ... `<tool_call|>`, which were not read as an element
    the turn opened: `<tool_call|>` was taken for an end of turn (a call turn trained without its `<turn|>`, the
    exported generation config stopped at `<tool_call|>`, after the first of parallel calls, and such a turn could
    not be generated). And its generation prompt ends with an empty thought channel the turn does not write
    (`<|channel>thought\\n<channel|>`): every turn trained after the prompt cut before it, a context the model never
    sees; the whole prompt is the context now."""
    from open_sft.export.save import end_of_turn_ids

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_special_tokens({"bos_token": "<bos>", "eos_token": "<turn|>", "additional_special_tokens": [
        "<|turn>", "<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>", "<|channel>", "<channel|>", '<|"|>']})
    tokenizer.chat_template = (TEMPLATES / "gemma4.jinja").read_text()
    parallel = {"tools": TOOLS, "messages": [
        {"role": "user", "content": "Weather in Paris and Lyon?"},
        {"role": "assistant", "content": "", "tool_calls": [call("get_weather", {"city": "Paris"}, 4),
                                                            call("get_weather", {"city": "Lyon"}, 5)]},
        tool('{"temp_c": 12}', 4), tool('{"temp_c": 15}', 5), {"role": "assistant", "content": "Paris 12, Lyon 15."}]}
    examples, (report,) = build(tokenizer, tmp_path, [parallel])
    runs = trained_runs(tokenizer, examples)
    assert [run for _, run in runs] == [
        '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|><|tool_call>call:get_weather{city:<|"|>Lyon'
        '<|"|>}<tool_call|><turn|>', "Paris 12, Lyon 15.<turn|>"]
    messages = to_messages(parallel, "messages")
    contexts = [tokenizer.apply_chat_template(messages[:k], tools=TOOLS, add_generation_prompt=True, tokenize=False)
                for k in (1, 4)]
    assert all(context.endswith("<|turn>model\n<|channel>thought\n<channel|>") for context in contexts)
    assert [before for before, _ in runs] == contexts
    through = tokenizer.apply_chat_template(messages[:2], tools=TOOLS, tokenize=False)
    assert through.endswith("<|turn>model\n" + runs[0][1] + "\n")  # the turn as the template writes it
    assert report.rows_kept == 1 and not report.dropped
    assert end_of_turn_ids(tokenizer) == tokenizer.convert_tokens_to_ids(["<turn|>"])


def gemma4_tokenizer(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_special_tokens({"bos_token": "<bos>", "eos_token": "<turn|>", "additional_special_tokens": [
        "<|turn>", "<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>", "<|channel>", "<channel|>", '<|"|>',
        "<|tool_response>", "<tool_response|>"]})
    tokenizer.chat_template = (TEMPLATES / "gemma4.jinja").read_text()
    return tokenizer


def test_gemma4_a_turn_after_a_tool_response_trains_without_the_header_its_prompt_leaves_out(tiny_model_dir,
                                                                                                tmp_path) -> None:
    """Gemma 4's own form of a call's results: `tool_responses` on the call turn (llama.cpp turns OpenAI tool messages
    into it). Its generation prompt after them opens no turn (`...<tool_response|>`, then the empty thought channel
    unless enable_thinking): the model goes on in the turn it called from. The template writes the next turn in history
    with a `<|turn>model\n` header, and every such turn trained that header, which the model never writes; it trains
    from what follows the prompt now (also the call turn the interleaved form writes without a header)."""
    tokenizer = gemma4_tokenizer(tiny_model_dir)
    responses = [{"name": "get_weather", "response": {"temp_c": 5}}]
    row = {"tools": TOOLS, "messages": [
        {"role": "user", "content": "Weather in Bern, then Chur?"},
        {"role": "assistant", "content": "", "tool_calls": [call("get_weather", {"city": "Bern"}, 1)],
         "tool_responses": responses},
        {"role": "assistant", "content": "", "tool_calls": [call("get_weather", {"city": "Chur"}, 2)],
         "tool_responses": [{"name": "get_weather", "response": {"temp_c": 2}}]},
        {"role": "assistant", "content": "Bern 5, Chur 2."}]}
    messages = to_messages(row, "messages")
    for kwargs, opening in (({}, "<|channel>thought\n<channel|>"), ({"enable_thinking": True}, "")):
        (tmp_path / str(bool(kwargs))).mkdir()
        examples, (report,) = build(tokenizer, tmp_path / str(bool(kwargs)), [row],
                                    chat_template_kwargs=json.dumps(kwargs))
        runs = trained_runs(tokenizer, examples)
        contexts = [tokenizer.apply_chat_template(messages[:k], tools=TOOLS, add_generation_prompt=True,
                                                  tokenize=False, **kwargs) for k in (1, 2, 3)]
        assert contexts[2].endswith("<|tool_response>response:get_weather{temp_c:2}<tool_response|>" + opening)
        assert sorted(before for before, _ in runs) == sorted(contexts)  # (in the examples' order)
        assert [run[:12] for _, run in runs[:2]] == ["<|tool_call>", "<|tool_call>"]  # not <|turn>model
        assert runs[2] == (contexts[2], "Bern 5, Chur 2.<turn|>")
        history = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False, **kwargs)
        assert history.endswith("<tool_response|><|turn>model\nBern 5, Chur 2.<turn|>\n")  # what trained before
        last = examples[-1]  # its labels: the answer's tokens right after the context's, nothing else
        at = [k for k, label in enumerate(last.labels) if label != IGNORE_INDEX]
        at = at[next(n for n in range(len(at)) if at[n:] == list(range(at[n], at[-1] + 1))):]  # its last run
        assert tokenizer.decode(last.input_ids[: at[0]]) == contexts[2]
        assert [last.input_ids[k] for k in at] == [last.labels[k] for k in at]
        assert tokenizer.decode([last.labels[k] for k in at]) == "Bern 5, Chur 2.<turn|>"
        assert tokenizer.decode(last.input_ids[at[-1] + 1:]) == "\n"
        assert report.rows_kept == 1 and not report.dropped



def test_gemma4_a_tool_response_in_the_calling_message_is_context_and_the_call_stops_at_its_opening(
        tiny_model_dir, tmp_path) -> None:
    """Gemma 4's own form writes a call's results (`tool_responses`, a field the model does not write) inside the
    calling turn: `<|tool_call>…<tool_call|><|tool_response>response:get_weather{temp_c:5}<tool_response|>`. The model
    writes its call and stops at `<|tool_response>` (in Gemma 4's generation_config eos ids); the engine writes the
    response. The call turn trained the tool's output as the model's, and in the merged form (call, responses and
    answer in one message) in the middle of the turn. Now the call trains through `<|tool_response>`, the response is
    context, the answer after it a run of its own, and the exported stops hold `<|tool_response>`."""
    from open_sft.export.save import end_of_turn_ids

    tokenizer = gemma4_tokenizer(tiny_model_dir)
    responses = [{"name": "get_weather", "response": {"temp_c": 5}}]
    bern = call("get_weather", {"city": "Bern"}, 1)
    split = {"tools": TOOLS, "messages": [
        {"role": "user", "content": "Weather in Bern?"},
        {"role": "assistant", "content": "", "tool_calls": [bern], "tool_responses": responses},
        {"role": "assistant", "content": "Bern 5."}]}
    merged = {"tools": TOOLS, "messages": [
        {"role": "user", "content": "Weather in Bern?"},
        {"role": "assistant", "content": "Bern 5.", "tool_calls": [bern], "tool_responses": responses}]}
    the_call = '<|tool_call>call:get_weather{city:<|"|>Bern<|"|>}<tool_call|><|tool_response>'
    response = "response:get_weather{temp_c:5}<tool_response|>"
    for name, row in (("split", split), ("merged", merged)):
        (tmp_path / name).mkdir()
        examples, (report,) = build(tokenizer, tmp_path / name, [row])
        runs = trained_runs(tokenizer, examples)
        messages = to_messages(row, "messages")
        prompt = tokenizer.apply_chat_template(messages[:1], tools=TOOLS, add_generation_prompt=True, tokenize=False)
        assert [run for _, run in runs] == [the_call, "Bern 5.<turn|>"]
        assert runs[0][0] == prompt
        if name == "split":  # the context of the answer: the call and its response as history writes them
            after = tokenizer.apply_chat_template(messages[:2], tools=TOOLS, add_generation_prompt=True,
                                                  tokenize=False)
            assert after.endswith(the_call + response + "<|channel>thought\n<channel|>")
        else:  # the turn as the template writes it after the call's context, the answer after the response
            after = prompt + the_call + response
            assert tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=False, tokenize=False
                                                 ).endswith("<|turn>model\n" + the_call + response + "Bern 5.<turn|>\n")
        assert runs[1][0] == after
        first = examples[0]  # the call's example: the response in its text, not trained
        ignored = [token for token, label in zip(first.input_ids, first.labels) if label == IGNORE_INDEX]
        trained = [token for token, label in zip(first.input_ids, first.labels) if label != IGNORE_INDEX]
        assert response in tokenizer.decode(first.input_ids) and response in tokenizer.decode(ignored)
        assert tokenizer.decode(trained) == the_call + ("Bern 5.<turn|>" if name == "merged" else "")
        assert len(examples) == (2 if name == "split" else 1)
        assert report.rows_kept == 1 and not report.dropped
    assert end_of_turn_ids(tokenizer) == tokenizer.convert_tokens_to_ids(["<turn|>", "<|tool_response>"])

# The shape of StepFun3.7-Flash's template (llama.cpp models/templates/StepFun3.7-Flash.jinja; Qwen3-Coder's call
# layout): ChatML turns; an assistant turn after the last user turn writes `<think>\n{trace}\n</think>\n`, earlier
# ones only their content; calls as `<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>
# \n</tool_call>` (arguments given as a JSON string are parsed); the generation prompt opens the think block.
XML_CALLS_SHAPE = (
    "{%- if tools %}{{- '<|im_start|>system\\n<tools>' + tools | tojson + '</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- set ns = namespace(last_user=-1) %}{%- for m in messages %}{%- if m.role == 'user' %}"
    "{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}{%- set content = m.content or '' %}{%- if m.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{%- if loop.index0 > ns.last_user %}"
    "{{- '<think>\\n' + (m.reasoning_content or '') + '\\n</think>\\n' }}{%- endif %}{{- content }}"
    "{%- for c in m.tool_calls or [] %}{{- '<tool_call>\\n<function=' + c.function.name + '>\\n' }}"
    "{%- set arguments = c.function.arguments | fromjson if c.function.arguments is string else c.function.arguments %}"
    "{%- for k, v in arguments | items %}{{- '<parameter=' + k + '>\\n' + v | string + '\\n</parameter>\\n' }}"
    "{%- endfor %}{{- '</function>\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}{{- '<|im_start|>tool_response\\n<tool_response>' + content"
    " + '</tool_response><|im_end|>\\n' }}{%- else %}{{- '<|im_start|>' + m.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
)


def test_xml_parameter_calls_train_after_the_opened_think_block_and_read_back(tiny_model_dir, tmp_path) -> None:
    """StepFun3.7-Flash / Qwen3-Coder call layout: every turn (a call with a JSON-string argument and no call id, a
    call with a trace, the answer) trains after exactly the generation prompt, which opens the think block, through
    <|im_end|>; generate/chat --tools reads such a reply's parallel calls (values typed by the tool's schema)."""
    from open_sft.export.tool_calls import split_calls

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_special_tokens({"eos_token": "<|im_end|>", "additional_special_tokens": ["<|im_start|>"]})
    tokenizer.add_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>"])
    tokenizer.chat_template = XML_CALLS_SHAPE
    examples, (report,) = build(tokenizer, tmp_path, [LFM_ROW])
    runs = trained_runs(tokenizer, examples)
    call = "<tool_call>\n<function=get_weather>\n<parameter=city>\n{}\n</parameter>\n</function>\n</tool_call><|im_end|>"
    assert [run for _, run in runs] == ["\n</think>\nLet me check." + call.format("Bern"),
                                        "Now Chur.\n</think>\n" + call.format("Chur"),
                                        "Both known.\n</think>\nBern 5, Chur 2.<|im_end|>"]
    messages = to_messages(LFM_ROW, "messages")
    assert [before for before, _ in runs] == [tokenizer.apply_chat_template(
        messages[:k], tools=messages.tools, add_generation_prompt=True, tokenize=False) for k in (1, 3, 5)]
    assert report.rows_kept == 1 and not report.dropped and not report.reasoning_not_rendered
    reply = call.format("Bern")[: -len("<|im_end|>")] + call.format("Chur")[: -len("<|im_end|>")]
    assert split_calls(tokenizer, "Sure." + reply, TOOLS) == ("Sure.", [
        {"name": "get_weather", "arguments": {"city": "Bern"}}, {"name": "get_weather", "arguments": {"city": "Chur"}}])


def gigachat3_tokenizer(tiny_model_dir):
    """GigaChat3's separators are special tokens with their newlines, as its tokenizer has them; eos is </s>."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_special_tokens({"bos_token": "<s>", "eos_token": "</s>", "additional_special_tokens": [
        "<|role_sep|>\n", "<|message_sep|>\n\n"]})
    tokenizer.chat_template = (TEMPLATES / "gigachat3.jinja").read_text()
    return tokenizer


def test_gigachat3_call_turns_train_through_eos_and_read_back(tiny_model_dir, tmp_path) -> None:
    """GigaChat3's template closes every message with <|message_sep|> and writes a call as a second message after
    it (`text<|message_sep|>\\n\\nfunction call<|role_sep|>\\n{json}`): <|message_sep|> was taken for the stop, so
    every call row was refused (turn_not_generable) and generation stopped before any call. The model goes on after
    it; a turn ends with eos (</s>) in its place, as GigaChat3's parsers read the model's calls, and the export
    stops at </s> alone. generate/chat --tools reads such a call."""
    from open_sft.export.save import end_of_turn_ids
    from open_sft.export.tool_calls import split_calls

    tokenizer = gigachat3_tokenizer(tiny_model_dir)
    plain = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                          {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Bye!"}]}
    examples, (report,) = build(tokenizer, tmp_path, [LFM_ROW, plain])
    runs = trained_runs(tokenizer, examples)
    call = '<|message_sep|>\n\nfunction call<|role_sep|>\n{{"name": "get_weather", "arguments": {{"city": "{}"}}}}</s>'
    assert [run for _, run in runs] == ["Let me check." + call.format("Bern"), call.format("Chur"),
                                        "Bern 5, Chur 2.</s>", "Hello!</s>", "Bye!</s>"]
    contexts = []
    for row, ks in ((LFM_ROW, (1, 3, 5)), (plain, (1, 3))):
        messages = to_messages(row, "messages")
        contexts += [tokenizer.apply_chat_template(messages[:k], tools=messages.tools, add_generation_prompt=True,
                                                   tokenize=False) for k in ks]
    assert [before for before, _ in runs] == contexts
    assert all(context.endswith("<|message_sep|>\n\nassistant<|role_sep|>\n") for context in contexts)
    assert report.rows_kept == 2 and not report.dropped and report.examples == 5  # history closes a turn otherwise
    assert end_of_turn_ids(tokenizer) == [tokenizer.eos_token_id]
    reply = call.format("Bern")[: -len("</s>")]
    assert split_calls(tokenizer, "Let me check." + reply, TOOLS) == (
        "Let me check.", [{"name": "get_weather", "arguments": {"city": "Bern"}}])
    assert split_calls(tokenizer, reply[:-3], TOOLS) == (reply[:-3], [])  # cut off: shown as written


def test_the_fields_a_template_reads_off_a_message_beside_the_models_own() -> None:
    """What foreign_fields probes: the keys a template reads off a message other than role, content, calls, a trace
    and a tool message's name and id (Gemma 4's tool_responses); none for Qwen3's, nor for a template that does not
    parse; transformers' own {% generation %} tag does not stop the reading."""
    from open_sft.data.chat.foreign_fields import message_fields

    assert message_fields((TEMPLATES / "gemma4.jinja").read_text()) == ("tool_responses",)
    assert message_fields((TEMPLATES / "qwen3.jinja").read_text()) == ()
    assert message_fields("{% for m in messages %}{{ m['content'] }}{{ m.weight }}{% endfor %}") == ("weight",)
    assert message_fields("{% for m in messages %}{% generation %}{{ m['extra'] }}{% endgeneration %}{% endfor %}"
                          ) == ("extra",)
    assert message_fields("{% if %}") == ()
