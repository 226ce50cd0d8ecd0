"""Tool-calling models tried as they were trained (`--tools` for generate, chat and compare), under the templates
their repositories ship (Qwen3, GLM-4.5, gpt-oss: tests/data/chat_templates) and a Mistral-layout stand-in: the
prompt holds the tools block the template writes, a reply that calls a tool is read back as its calls, the chat
history keeps them so a tool result renders after them, and an expected call is scored as a call. The reply a
model generates is the template's own rendering of an assistant message (what a model trained on it writes)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from open_sft.errors import UserError
from open_sft.export import generate as generate_cli
from open_sft.export.chat import chat
from open_sft.export.compare import read_tasks, score_tasks
from open_sft.export.generate import generate_reply
from open_sft.export.reply import reasoning_layout
from open_sft.export.tool_calls import call_layout, split_calls
from open_sft.export.tool_schemas import check_written, read_tools

from ..data.test_reasoning_tool_calls import TEMPLATES, TOOLS, family_tokenizer

QUESTION = [{"role": "user", "content": "How cold is Oslo?"}]
# the token each family's model stops at after a call, and after an answer
STOPS = {"qwen3": ("<|im_end|>", "<|im_end|>"), "glm": ("<|observation|>", "<|user|>"),
         "gpt_oss": ("<|call|>", "<|return|>"), "mistral": ("</s>", "</s>")}
# Mistral v0.3's tool layout ([AVAILABLE_TOOLS] schemas, [TOOL_CALLS] a JSON list of calls), written for the tests:
# the template in tests/data is its form without tools
MISTRAL_TOOLS = (
    "{{- bos_token }}{%- if tools %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}[INST] {{ m.content }}[/INST]"
    "{%- elif m.role == 'assistant' and m.tool_calls %}[TOOL_CALLS] [{%- for c in m.tool_calls %}"
    "{\"name\": {{ c.function.name | tojson }}, \"arguments\": {{ c.function.arguments | tojson }}, "
    "\"id\": {{ c.id | tojson }}}{%- if not loop.last %}, {% endif %}{%- endfor %}]{{ eos_token }}"
    "{%- elif m.role == 'assistant' %} {{ m.content }}{{ eos_token }}"
    "{%- elif m.role == 'tool' %}[TOOL_RESULTS] {\"content\": {{ m.content | tojson }}, \"call_id\": "
    "{{ m.tool_call_id | tojson }}}[/TOOL_RESULTS]{%- endif %}{%- endfor %}")
# Llama 3.1's layout: a bare JSON call, `parameters` its arguments, nothing before it (written for the tests)
LLAMA_TOOLS = (
    "{{- bos_token }}{%- for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    "{% if m.role == 'user' and loop.first and tools %}Tools: {{ tools | tojson }}\n\n{% endif %}"
    "{% if m.tool_calls %}{{ {'name': m.tool_calls[0].function.name, 'parameters': "
    "m.tool_calls[0].function.arguments} | tojson }}{% else %}{{ m.content }}{% endif %}<|eot_id|>{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif %}")
STOPS["llama"] = ("<|eot_id|>", "<|eot_id|>")
FAMILIES = sorted(STOPS)


def call(name: str, arguments: dict, n: int = 1) -> dict:
    return {"id": f"call{n:05d}", "type": "function", "function": {"name": name, "arguments": arguments}}


OSLO = {"role": "assistant", "content": "", "tool_calls": [call("get_weather", {"city": "Oslo"})]}
TRACED = {**OSLO, "reasoning_content": "I need the weather in Oslo."}
TWO = {"role": "assistant", "content": "", "tool_calls": [call("get_weather", {"city": "Oslo"}),
                                                          call("convert", {"celsius": -3.5}, 2)]}
RESULT = {"role": "tool", "content": '{"temp_c": -3}', "tool_call_id": "call00001", "name": "get_weather"}


def tokenizer_for(tiny_model_dir, family: str):
    if family not in ("mistral", "llama"):
        return family_tokenizer(tiny_model_dir, family)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    if family == "llama":
        tokenizer.add_special_tokens({"eos_token": "<|eot_id|>", "additional_special_tokens": [
            "<|start_header_id|>", "<|end_header_id|>"]})
        tokenizer.chat_template = LLAMA_TOOLS
        return tokenizer
    tokenizer.add_special_tokens({"bos_token": "<s>", "eos_token": "</s>", "additional_special_tokens": [
        "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
        "[/TOOL_RESULTS]"]})
    tokenizer.chat_template = MISTRAL_TOOLS
    return tokenizer


def written(tokenizer, context: list[dict], message: dict, stop: str) -> str:
    """What the template writes for `message` after `context`'s generation prompt, through the token the model
    stops at (the reply a model trained on such rows generates)."""
    prompt = tokenizer.apply_chat_template(context, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template(context + [message], tools=TOOLS, tokenize=False)
    assert full.startswith(prompt)
    return full[len(prompt):].split(stop)[0] + stop


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


def generating(monkeypatch, model, tokenizer, replies: list[str], family: str):
    """`model` made to generate `replies` in turn after any prompt, stopping at the family's stop tokens."""
    queue = [tokenizer(reply, add_special_tokens=False)["input_ids"] for reply in replies]
    model.generation_config.eos_token_id = sorted({tokenizer.convert_tokens_to_ids(t) for t in STOPS[family]})

    def generate(**kwargs):
        return torch.cat([kwargs["input_ids"], torch.tensor([queue.pop(0)], dtype=torch.long)], dim=1)

    monkeypatch.setattr(model, "generate", generate)


def recording(monkeypatch, tokenizer) -> tuple[list[str], object]:
    """(the prompts rendered from here on, as text, with the tools they were given; the real renderer). The
    template's layouts are read first: their probes are not prompts."""
    call_layout(tokenizer)
    reasoning_layout(tokenizer.chat_template, tokenizer)
    prompts, real = [], tokenizer.apply_chat_template

    def record(messages, **kwargs):
        prompts.append(real(messages, tools=kwargs.get("tools"), add_generation_prompt=True, tokenize=False))
        return real(messages, **kwargs)

    monkeypatch.setattr(tokenizer, "apply_chat_template", record)
    return prompts, real


@pytest.mark.parametrize("family", FAMILIES)
def test_the_prompt_holds_the_tools_and_a_call_reads_back(tiny_model_dir, model, monkeypatch, family) -> None:
    """The prompt is the template's own rendering with tools=; the call the template writes is read back with its
    name and arguments (as JSON values) and kept as the same message (gpt-oss's was answer text before)."""
    tokenizer = tokenizer_for(tiny_model_dir, family)
    generating(monkeypatch, model, tokenizer, [written(tokenizer, QUESTION, OSLO, STOPS[family][0])], family)
    prompts, real = recording(monkeypatch, tokenizer)
    reply = generate_reply(model, tokenizer, QUESTION, 64, tools=TOOLS)
    assert prompts == [real(QUESTION, tools=TOOLS, add_generation_prompt=True, tokenize=False)]
    assert "get_weather" in prompts[0] and "get_weather" not in real(QUESTION, add_generation_prompt=True,
                                                                     tokenize=False)
    assert (reply.text, reply.tool_calls, reply.stop_token) == (
        "", ({"name": "get_weather", "arguments": {"city": "Oslo"}},), STOPS[family][0])
    assert reply.message() == OSLO


@pytest.mark.parametrize("family, message", [(f, m) for f in FAMILIES for m in ("traced", "two")
                                              if f not in ("gpt_oss", "llama") or m != "two"])  # one call a turn
def test_traces_and_parallel_calls_read_back(tiny_model_dir, family, message) -> None:
    tokenizer = tokenizer_for(tiny_model_dir, family)
    message = {"traced": TRACED, "two": TWO}[message]
    head, calls = split_calls(tokenizer, written(tokenizer, QUESTION, message, STOPS[family][0]), TOOLS)
    assert calls == [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                     for c in message["tool_calls"]]
    if "reasoning_content" in message and family not in ("mistral", "llama"):  # they write no reasoning
        assert "I need the weather in Oslo." in head and "get_weather" not in head


def test_each_template_has_its_layout(tiny_model_dir) -> None:
    layouts = {family: call_layout(tokenizer_for(tiny_model_dir, family)) for family in FAMILIES}
    assert {family: (layout.kind, layout.marker) for family, layout in layouts.items()} == {
        "qwen3": ("json", "<tool_call>"), "glm": ("pairs", "<tool_call>"), "gpt_oss": ("name_json", "to=functions."),
        "mistral": ("json", "[TOOL_CALLS]"), "llama": ("json", "")}
    assert layouts["mistral"].listed and layouts["glm"].pair == ("<arg_key>", "</arg_key>\n<arg_value>",
                                                                 "</arg_value>")
    plain = AutoTokenizer.from_pretrained(tiny_model_dir)  # a template without tool calls: replies are text
    assert call_layout(plain) is None and split_calls(plain, "<tool_call>x</tool_call>") == (
        "<tool_call>x</tool_call>", [])


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_keeps_the_call_and_renders_the_tool_result_after_it(tiny_model_dir, model, monkeypatch,
                                                                   family) -> None:
    """After a call and `/tool RESULT`, the prompt the follow-up answers is the template's own rendering of the
    conversation with the call and the result (gpt-oss's template raised: no assistant message with a call)."""
    tokenizer = tokenizer_for(tiny_model_dir, family)
    call_stop, answer_stop = STOPS[family]
    answer = {"role": "assistant", "content": "It is -3 degrees."}
    traced = TRACED if family in ("gpt_oss", "qwen3") else OSLO
    replies = [written(tokenizer, QUESTION, traced, call_stop),
               written(tokenizer, QUESTION, answer, answer_stop)]
    generating(monkeypatch, model, tokenizer, replies, family)
    prompts, real = recording(monkeypatch, tokenizer)
    lines, out = iter(["How cold is Oslo?", "/tool", '/tool {"temp_c": -3}', "/tool more", "/exit"]), io.StringIO()
    assert chat(model, tokenizer, lambda: next(lines), out, max_new_tokens=64, tools=TOOLS) == 2
    assert prompts[1] == real(QUESTION + [traced, RESULT], tools=TOOLS, add_generation_prompt=True, tokenize=False)
    shown = [line.strip() for line in out.getvalue().splitlines()]
    at = shown.index('[tool call] get_weather {"city": "Oslo"}')  # no empty answer line before it
    assert shown[:at] == (["[reasoning]", "I need the weather in Oslo.", "[/reasoning]"] if traced is TRACED else [])
    assert "It is -3 degrees." in shown
    assert "[/tool TEXT: give the result of get_weather]" in shown
    assert shown[-1].startswith("[no tool call awaits a result")


def test_a_tools_file_reads_as_a_training_rows_tools(tmp_path) -> None:
    bare = [tool["function"] for tool in TOOLS]
    for n, data in enumerate([TOOLS, bare, {"tools": TOOLS}, {"functions": bare}, json.dumps(TOOLS)]):
        path = tmp_path / f"tools{n}.json"
        path.write_text(json.dumps(data))
        assert read_tools(path) == TOOLS


@pytest.mark.parametrize("content, says", [
    (None, "No such file"), ("{not json", "not JSON"), ("[1, 2]", "must be a list of tool schemas"),
    ('[{"description": "no name"}]', "tool 1 has no function name"), ("[]", "holds no tool schemas"),
    ('{"city": "Oslo"}', "holds no tool schemas")])
def test_a_bad_tools_file_is_named_with_what_it_should_hold(tmp_path, content, says) -> None:
    path = tmp_path / "tools.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(UserError) as error:
        read_tools(path)
    assert str(error.value).startswith(f"--tools {path}: ") and says in str(error.value)
    assert "a JSON list of tool schemas" in str(error.value)


def test_a_template_that_writes_no_tools_is_an_error(tiny_model_dir, tmp_path, capsys) -> None:
    """Mistral v0.3's template without tools (and the tiny default) would ask without them: said, exit 2."""
    mistral = AutoTokenizer.from_pretrained(tiny_model_dir)
    mistral.add_special_tokens({"bos_token": "<s>", "eos_token": "</s>"})
    mistral.chat_template = (TEMPLATES / "mistral_v0_3.jinja").read_text()
    with pytest.raises(UserError, match="does not write tool schemas"):
        check_written(mistral, TOOLS, "--tools t.json")
    check_written(family_tokenizer(tiny_model_dir, "qwen3"), TOOLS, "--tools t.json")
    path = tmp_path / "tools.json"
    path.write_text(json.dumps(TOOLS))
    assert generate_cli.main([str(tiny_model_dir), "--tools", str(path), "--prompt", "Hi"]) == 2
    assert f"error: --tools {path}: the chat template does not write tool schemas" in capsys.readouterr().err
    assert generate_cli.main([str(tiny_model_dir), "--tools", str(tmp_path / "none.json"), "--prompt", "Hi"]) == 2
    assert "none.json: No such file" in capsys.readouterr().err


def test_a_template_that_fails_only_without_tools_writes_them(tiny_model_dir, tmp_path, capsys) -> None:
    """Phi-4-mini's template (as llama.cpp writes its calls) loops over `tools` whenever it is defined, and
    apply_chat_template hands it tools=None without --tools: that rendering fails. `generate --tools` on a model
    trained under it was refused, 'the chat template fails to render the tools (TypeError: 'NoneType' object is
    not iterable)', though it renders them; the tools are written now and the reply comes."""
    from tests.unit.data.test_call_closers import tokenizer_for as closer_tokenizer

    tokenizer = closer_tokenizer(tiny_model_dir, "phi_4_mini")
    with pytest.raises(TypeError, match="'NoneType' object is not iterable"):
        tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert "<|tool|>" in tokenizer.apply_chat_template(QUESTION, tools=TOOLS, add_generation_prompt=True,
                                                       tokenize=False)
    check_written(tokenizer, TOOLS, "--tools t.json")
    with pytest.raises(UserError, match="fails to render the tools"):  # a schema it cannot write is still said
        check_written(tokenizer, [{"type": "function"}], "--tools t.json")
    out = tmp_path / "phi"
    phi = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    phi.resize_token_embeddings(len(tokenizer))  # the added special tokens
    phi.save_pretrained(out)
    tokenizer.save_pretrained(out)
    path = tmp_path / "tools.json"
    path.write_text(json.dumps(TOOLS))
    code = generate_cli.main([str(out), "--tools", str(path), "--prompt", "Hi", "--max_new_tokens", "2"])
    captured = capsys.readouterr()
    assert (code, captured.err.count("error:")) == (0, 0), captured.err
    assert json.loads(captured.out.splitlines()[-1])["prompt"] == "Hi"


def test_compare_scores_an_expected_call_as_a_call(tiny_model_dir, model, monkeypatch, tmp_path) -> None:
    """A task whose reply is a call (its row's own tools in the prompt) is a hit for the same name and arguments
    as JSON values (JSON text or object, any key order), a miss for other arguments; `answer` may be left out."""
    tokenizer = tokenizer_for(tiny_model_dir, "qwen3")
    expected = {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"messages": QUESTION + [expected], "tools": json.dumps(TOOLS)}) + "\n")
    rows = read_tasks(tasks) * 3
    right = written(tokenizer, QUESTION, OSLO, "<|im_end|>")
    chatty = right.replace("\n\n<tool_call>", "\n\nLet me look.\n<tool_call>")
    wrong = right.replace("Oslo", "Bergen")
    generating(monkeypatch, model, tokenizer, [right, wrong, chatty], "qwen3")
    prompts, real = recording(monkeypatch, tokenizer)
    score = score_tasks(model, tokenizer, rows, max_new_tokens=64)
    assert score.correct == [True, False, True] and rows[0]["answer"] == 'get_weather {"city": "Oslo"}'
    assert score.answers[:2] == ['get_weather {"city": "Oslo"}', 'get_weather {"city": "Bergen"}']
    assert prompts[0] == real(QUESTION, tools=TOOLS, add_generation_prompt=True, tokenize=False)


def test_generate_score_sample_scores_calls(tiny_model_dir, model, monkeypatch) -> None:
    from open_sft.export.generate import score_sample

    tokenizer = tokenizer_for(tiny_model_dir, "gpt_oss")
    rows = [{"messages": QUESTION + [OSLO], "tools": TOOLS, "answer": ""},
            {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}],
             "answer": "Hello."}]
    generating(monkeypatch, model, tokenizer, [written(tokenizer, QUESTION, OSLO, "<|call|>"),
                                               "<|channel|>final<|message|>Hello.<|return|>"], "gpt_oss")
    assert score_sample(model, tokenizer, rows, 64) == {"held_out_tasks": 2, "exact_answer_accuracy": 1.0,
                                                        "reasoning_set_aside": 1, "scored_as_tool_calls": 1}


def test_compare_gives_a_call_room_by_default(tiny_model_dir, monkeypatch, tmp_path) -> None:
    """16 new tokens (a short answer's room) cut a call inside its arguments: a task that expects one gets 128, the
    others keep 16 (every task got 128 once any expected a call); --max_new_tokens applies to every task."""
    from open_sft.export import compare
    from open_sft.export import generate as generate_module

    limits = []

    def reply(model, tokenizer, messages, max_new_tokens, **kwargs):
        limits.append(max_new_tokens)
        return generate_module.Generation("Hello.", generate_module.END_OF_TURN, 1, 1)

    monkeypatch.setattr(generate_module, "generate_reply", reply)
    plain = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}],
             "answer": "Hello."}
    (tasks := tmp_path / "tasks.jsonl").write_text(json.dumps(plain) + "\n" + json.dumps(
        {"messages": QUESTION + [OSLO]}) + "\n")
    assert compare.main([str(tiny_model_dir), str(tiny_model_dir), "--tasks", str(tasks)]) == 0
    assert limits == [16, 128] * 2
    limits.clear()
    assert compare.main([str(tiny_model_dir), str(tiny_model_dir), "--tasks", str(tasks), "--max_new_tokens", "5"]) \
        == 0
    assert limits == [5, 5] * 2


@pytest.mark.parametrize("family", FAMILIES)
def test_a_call_cut_off_inside_its_arguments_is_text(tiny_model_dir, family) -> None:
    """A reply cut at --max_new_tokens inside its call is not a call named '' with no arguments: it stays text."""
    tokenizer = tokenizer_for(tiny_model_dir, family)
    reply = written(tokenizer, QUESTION, OSLO, STOPS[family][0])
    cut = reply[:reply.index("Oslo")]
    assert split_calls(tokenizer, cut, TOOLS) == (cut, [])
    name_cut = reply[:reply.index("get_weather")]
    assert split_calls(tokenizer, name_cut, TOOLS) == (name_cut, [])


@pytest.mark.parametrize("family", ["qwen3", "glm"])
def test_a_call_cut_off_before_its_closing_is_an_unreadable_call(tiny_model_dir, model, monkeypatch, family) -> None:
    """A call cut at --max_new_tokens after its arguments but before the template's `</tool_call>` (Qwen3's whole
    JSON, GLM's last pair) is not a complete call: it read as get_weather {city: Oslo}, a compare hit."""
    tokenizer = tokenizer_for(tiny_model_dir, family)
    assert call_layout(tokenizer).closing == "</tool_call>"
    whole = written(tokenizer, QUESTION, OSLO, STOPS[family][0])
    cut = whole[:whole.index("</tool_call>")]
    assert split_calls(tokenizer, cut, TOOLS) == (cut, [])
    generating(monkeypatch, model, tokenizer, [cut, cut, whole], family)
    reply = generate_reply(model, tokenizer, QUESTION, 128, tools=TOOLS)
    assert (reply.tool_calls, reply.unreadable_call) == ((), cut[cut.index("<tool_call>"):].strip())
    tasks = [{"messages": QUESTION + [OSLO], "answer": ""}]
    assert [score_tasks(model, tokenizer, tasks, max_new_tokens=128).correct for _ in "ab"] == [[False], [True]]


# what each template writes after a call's arguments: its closing of the call, then the end of any message
AFTER_ARGUMENTS = {"qwen3": "\n</tool_call>", "glm": "</tool_call>", "gpt_oss": "<|call|>", "mistral": "</s>",
                   "llama": "<|eot_id|>"}
CUT_CALLS = {"qwen3": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}',
             "glm": "<tool_call>get_weather<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>",
             "gpt_oss": 'to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}'}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_call_cut_off_right_after_its_arguments(tiny_model_dir, model, monkeypatch, family) -> None:
    """A reply cut at --max_new_tokens right after its call's arguments lacks the closing the template writes after
    a call (Qwen3's and GLM's `</tool_call>`, gpt-oss's `<|call|>`, the token its model stops at): an unreadable
    call, shown as written (gpt-oss's read as get_weather {city: Oslo}); ended by that token, it is the call.
    Mistral's and Llama's write nothing after a call but the end of any message (`</s>`, `<|eot_id|>`): their
    complete JSON is the call, as an answer cut before its end of turn is the answer."""
    tokenizer = tokenizer_for(tiny_model_dir, family)
    whole = written(tokenizer, QUESTION, OSLO, STOPS[family][0])
    cut = whole[:whole.rindex(AFTER_ARGUMENTS[family])]
    generating(monkeypatch, model, tokenizer, [cut, whole], family)
    limit = len(tokenizer(cut, add_special_tokens=False)["input_ids"])
    cut_reply, reply = (generate_reply(model, tokenizer, QUESTION, n, tools=TOOLS) for n in (limit, 128))
    oslo = ({"name": "get_weather", "arguments": {"city": "Oslo"}},)
    assert (reply.stop_reason, reply.tool_calls, reply.unreadable_call) == ("end_of_turn", oslo, None)
    assert (cut_reply.stop_reason, cut_reply.tool_calls, cut_reply.unreadable_call) == (
        "max_new_tokens", () if family in CUT_CALLS else oslo, CUT_CALLS.get(family))
    assert call_layout(tokenizer).closing == AFTER_ARGUMENTS[family].strip() * (family in CUT_CALLS)


def test_a_response_template_reads_the_calls(tiny_model_dir) -> None:
    """A tokenizer with a `response_template` (transformers' parse_response) reads the calls by it: the calls it
    parses are the reply's, its trace the reasoning."""
    from open_sft.export.reply import parse_reply

    tokenizer = tokenizer_for(tiny_model_dir, "qwen3")
    tokenizer.response_template = {"start_anchor": "<|im_start|>assistant\n", "fields": {
        "reasoning_content": {"open": "<think>", "close": "</think>"},
        "tool_calls": {"open": "<tool_call>", "close": "</tool_call>", "content": "json", "repeats": True,
                       "transform": {"type": "function", "function": "{content}"}},
        "content": {}}}
    prompt = tokenizer(tokenizer.apply_chat_template(QUESTION, tools=TOOLS, add_generation_prompt=True, tokenize=False),
                       add_special_tokens=False)["input_ids"]
    reply = written(tokenizer, QUESTION, TWO | {"reasoning_content": "Two calls."}, "<|im_end|>")[:-len("<|im_end|>")]
    parts = parse_reply(tokenizer, tokenizer(reply, add_special_tokens=False)["input_ids"], prompt, TOOLS)
    assert (parts.reasoning, parts.answered, parts.tool_calls) == ("Two calls.", True, (
        {"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "convert", "arguments": {"celsius": -3.5}}))


def test_compare_says_which_tasks_were_scored_by_their_calls() -> None:
    from open_sft.export.compare import calls_lines

    rows = [{"messages": QUESTION + [OSLO]}, {"messages": QUESTION + [{"role": "assistant", "content": "Cold."}]}]
    assert calls_lines(rows) == ["1 of 2 tasks expect a tool call: scored by the call (the same tool names and the "
                                 "same arguments as JSON values, key order and spacing aside), not by its text"]
    assert calls_lines(rows[1:]) == []


def _reply(tiny_model_dir, model, monkeypatch, family: str, reply: str):
    tokenizer = tokenizer_for(tiny_model_dir, family)
    generating(monkeypatch, model, tokenizer, [reply], family)
    return generate_reply(model, tokenizer, QUESTION, 128, tools=TOOLS)


def test_a_call_written_inside_the_reasoning_is_reasoning(tiny_model_dir, model, monkeypatch) -> None:
    """Calls are read where the template writes them, after the trace: one mused about inside the think block is
    reasoning, and the answer after it is the reply's (it was read as the call, with the answer lost)."""
    musing = '<tool_call>\n{"name": "convert", "arguments": {"celsius": 1}}\n</tool_call>'
    reply = _reply(tiny_model_dir, model, monkeypatch, "qwen3",
                   f"<think>\nI could call {musing} but no.\n</think>\n\nIt is cold.<|im_end|>")
    assert (reply.text, reply.tool_calls, reply.reasoning) == ("It is cold.", (), f"I could call {musing} but no.")
    assert reply.message()["content"] == "It is cold."


def test_text_after_a_call_is_kept_in_the_answer(tiny_model_dir, model, monkeypatch) -> None:
    """Text the model writes after its last call (past `</tool_call>`) is not dropped: it follows the text before."""
    call_text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    reply = _reply(tiny_model_dir, model, monkeypatch, "qwen3", f"Sure. {call_text} and more text<|im_end|>")
    assert (reply.text, reply.tool_calls) == ("Sure.\n\nand more text",
                                              ({"name": "get_weather", "arguments": {"city": "Oslo"}},))


@pytest.mark.parametrize("family, arguments", [("gpt_oss", '"Oslo"'), ("gpt_oss", "[1, 2]"), ("gpt_oss", "{'c': 1}"),
                                               ("gpt_oss", '{"city": "Oslo"'), ("qwen3", "{'city': 'Oslo'}"),
                                               ("qwen3", '["Oslo"]')])
def test_a_call_that_does_not_read_is_an_unreadable_call(tiny_model_dir, model, monkeypatch, family,
                                                          arguments) -> None:
    """A call whose arguments are not a JSON object (a string, a list, Python's dict, cut-off JSON) is no call named
    get_weather with no arguments, nor a trace with the call's header glued in: the trace is split right and the
    call shown as written, an unreadable call (answered; a miss when scored); chat does not keep the turn."""
    tokenizer = tokenizer_for(tiny_model_dir, family)
    good = written(tokenizer, QUESTION, TRACED, STOPS[family][0])
    bad = good.replace('{"city": "Oslo"}', arguments)
    assert bad != good
    generating(monkeypatch, model, tokenizer, [bad, bad, written(tokenizer, QUESTION, {
        "role": "assistant", "content": "Fine."}, STOPS[family][1])], family)
    reply = generate_reply(model, tokenizer, QUESTION, 128, tools=TOOLS)
    marker = call_layout(tokenizer).marker
    assert (reply.reasoning, reply.tool_calls, reply.answered) == ("I need the weather in Oslo.", (), True)
    assert reply.unreadable_call.startswith(marker) and arguments in reply.unreadable_call
    assert reply.unreadable_line().startswith(f"[tool call, unreadable] {marker}")
    prompts, real = recording(monkeypatch, tokenizer)
    lines, out = iter(["How cold is Oslo?", "Again?", "/exit"]), io.StringIO()
    assert chat(model, tokenizer, lambda: next(lines), out, max_new_tokens=64, tools=TOOLS) == 2
    assert "[tool call, unreadable]" in out.getvalue() and "Fine." in out.getvalue()
    assert "[the call does not read as one: your message and this reply are both left out of the conversation; ask " \
           "again]" in out.getvalue().splitlines()
    assert prompts[1] == real([{"role": "user", "content": "Again?"}], tools=TOOLS, add_generation_prompt=True,
                              tokenize=False)  # the unreadable turn is not kept


def test_an_unreadable_call_after_a_tool_result_asks_for_the_result_again(tiny_model_dir, model, monkeypatch) -> None:
    """An unreadable call that answered a /tool result leaves the result out too (the line said only that the turn
    was not kept): the line says so and how to go on, and the result sent again is answered after the call."""
    tokenizer = tokenizer_for(tiny_model_dir, "qwen3")
    good = written(tokenizer, QUESTION, OSLO, "<|im_end|>")
    answer = written(tokenizer, QUESTION, {"role": "assistant", "content": "Cold."}, "<|im_end|>")
    generating(monkeypatch, model, tokenizer, [good, good.replace("</tool_call>", ""), answer], "qwen3")
    prompts, real = recording(monkeypatch, tokenizer)
    lines, out = iter(["How cold is Oslo?", '/tool {"temp_c": -3}', '/tool {"temp_c": -3}', "/exit"]), io.StringIO()
    assert chat(model, tokenizer, lambda: next(lines), out, max_new_tokens=64, tools=TOOLS) == 3
    assert "[the call does not read as one: the tool result and this reply are both left out of the conversation; " \
           "send it again with /tool]" in out.getvalue().splitlines()
    assert prompts[2] == real(QUESTION + [OSLO, RESULT], tools=TOOLS, add_generation_prompt=True, tokenize=False)


def test_compare_counts_an_unreadable_call_as_a_miss(tiny_model_dir, model, monkeypatch, tmp_path) -> None:
    """An unreadable call is a miss, shown as written (the table and --json said only "(unreadable tool call)"):
    shortened in the table as other replies are, whole in --json's after_unreadable_call."""
    from open_sft.export.compare import format_table, reasoning_lines, write_scores

    tokenizer = tokenizer_for(tiny_model_dir, "gpt_oss")
    bad = written(tokenizer, QUESTION, TRACED, "<|call|>").replace('"Oslo"}', '"Oslo"')
    generating(monkeypatch, model, tokenizer, [bad], "gpt_oss")
    rows = [{"messages": QUESTION + [OSLO], "answer": "get_weather"}]
    score = score_tasks(model, tokenizer, rows, max_new_tokens=64)
    raw = 'to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"'
    assert (score.correct, score.answers, score.cut) == ([False], [f"(unreadable) {raw}"], [False])
    assert "✗ (unreadable) to=functions…" in format_table(rows, score, score, 1).splitlines()[1]
    write_scores(tmp_path / "scores.json", rows, (tmp_path, tmp_path), score, score)
    shown = json.loads((tmp_path / "scores.json").read_text())["rows"][0]
    assert (shown["after"], shown["before_unreadable_call"], shown["after_unreadable_call"]) == (
        f"(unreadable) {raw}", raw, raw)
    assert reasoning_lines("after", score, 64)[-1] == (
        "after: 1 of 1 replies wrote an unreadable tool call (cut off, not JSON, arguments not an object: scored as "
        "misses)")


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_a_bad_tools_file_is_said_before_the_model_loads(tiny_model_dir, tmp_path, monkeypatch, capsys,
                                                         command) -> None:
    """A --tools typo, a file that is not tool schemas, or a template that writes none: said and exit 2 without
    loading the model (the template check needs the tokenizer alone)."""
    from open_sft.export import chat as chat_cli
    from open_sft.export import run_dir

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before --tools was checked")

    monkeypatch.setattr(run_dir, "load_run_model", no_load)
    main = {"generate": generate_cli.main, "chat": chat_cli.main}[command]
    (tmp_path / "bad.json").write_text("[1, 2]")
    (tmp_path / "tools.json").write_text(json.dumps(TOOLS))
    for name, says in [("none.json", "No such file"), ("bad.json", "must be a list of tool schemas"),
                       ("tools.json", "the chat template does not write tool schemas")]:
        assert main([str(tiny_model_dir), "--tools", str(tmp_path / name)]) == 2
        assert f"error: --tools {tmp_path / name}: " in (err := capsys.readouterr().err) and says in err


def test_compare_says_a_task_rows_tools_the_template_does_not_write(tiny_model_dir, tmp_path, monkeypatch,
                                                                     capsys) -> None:
    """A task row's own tools under a template that writes none are the same error as --tools there (they were
    left out of the prompt silently, rc 0): the tasks file and line named, exit 2, no model loaded."""
    from open_sft.export import compare, run_dir

    monkeypatch.setattr(run_dir, "load_run_model", lambda *a, **k: pytest.fail("a model was loaded"))
    tasks = tmp_path / "tasks.jsonl"
    plain = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}],
             "answer": "Hello."}
    tasks.write_text(json.dumps(plain) + "\n\n" + json.dumps({"messages": QUESTION + [OSLO], "tools": TOOLS}) + "\n")
    assert compare.main([str(tiny_model_dir), str(tiny_model_dir), "--tasks", str(tasks)]) == 2
    assert f"error: --tasks {tasks} line 3: the row's tools ({tiny_model_dir}): the chat template does not write " \
           "tool schemas" in capsys.readouterr().err


def test_compare_names_the_line_a_task_was_read_from(tiny_model_dir, tmp_path, monkeypatch, capsys) -> None:
    """A row's tools error names the line the row was read from: the file was read again to number the rows, split
    at Unicode line breaks (a U+2028 JSON writes raw in a string with ensure_ascii=False) as reading it is not, and
    named line 2 for the row on line 3 (and would misname any row of a file that changed between the reads)."""
    from open_sft.export import compare, run_dir

    monkeypatch.setattr(run_dir, "load_run_model", lambda *a, **k: pytest.fail("a model was loaded"))
    plain = {"messages": [{"role": "user", "content": "One\u2028two"}, {"role": "assistant", "content": "Three."}],
             "answer": "Three."}
    lines = [json.dumps(plain, ensure_ascii=False), "", json.dumps({"messages": QUESTION + [OSLO], "tools": TOOLS})]
    (tasks := tmp_path / "tasks.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert "\u2028" in tasks.read_text(encoding="utf-8") and len(compare.read_tasks(tasks)) == 2
    assert compare.main([str(tiny_model_dir), str(tiny_model_dir), "--tasks", str(tasks)]) == 2
    assert f"error: --tasks {tasks} line 3: the row's tools ({tiny_model_dir}): the chat template does not write " \
           "tool schemas" in capsys.readouterr().err


def test_small_messages_and_the_json_calls(tmp_path) -> None:
    """A task without an answer is told that an expected tool_calls reply needs none; a tools file's error says what
    to give once; compare --json gives the calls structured beside their display strings."""
    from open_sft.export.compare import TaskScore, write_scores

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"messages": QUESTION + [{"role": "assistant", "content": "Cold."}]}) + "\n")
    with pytest.raises(ValueError, match="line 1: .*or no 'answer' where that reply has 'tool_calls'"):
        read_tasks(tasks)
    (tools := tmp_path / "tools.json").write_text('{"tools": "notalist"}')
    with pytest.raises(UserError) as error:
        read_tools(tools)
    assert str(error.value).count("give") == 1
    rows = [{"messages": QUESTION + [OSLO], "answer": 'get_weather {"city": "Oslo"}'}]
    oslo = {"name": "get_weather", "arguments": {"city": "Oslo"}}
    before = TaskScore(["Cold."], [False], calls=[[]])
    after = TaskScore(['get_weather {"city": "Oslo"}'], [True], calls=[[oslo]])
    write_scores(tmp_path / "s.json", rows, (Path("a"), Path("b")), before, after)
    written_row = json.loads((tmp_path / "s.json").read_text())["rows"][0]
    assert (written_row["expected_tool_calls"], written_row["before_tool_calls"], written_row["after_tool_calls"]) == (
        [oslo], [], [oslo])


def test_a_json_answer_is_no_call_under_a_bare_json_layout(tiny_model_dir, model, monkeypatch) -> None:
    """Under Llama 3.1's layout (no marker) a JSON answer with a "name" key read as a call named Alice with {} (and
    chat kept it as one): a bare call needs its arguments key and the name of a tool given, and tools at all."""
    tokenizer = tokenizer_for(tiny_model_dir, "llama")
    alice = '{"name": "Alice", "age": 30}<|eot_id|>'
    for text, tools in [(alice, None), (alice, TOOLS), ('{"name": "get_weather"}<|eot_id|>', TOOLS),
                        ('{"name": "Alice", "parameters": {}}<|eot_id|>', TOOLS),
                        ('{"name": "get_weather", "parameters": {"city": "Oslo"}}<|eot_id|>', None)]:
        assert split_calls(tokenizer, text, tools) == (text, [])
    call_text = '{"name": "get_weather", "parameters": {"city": "Oslo"}}<|eot_id|>'
    assert split_calls(tokenizer, call_text, TOOLS)[1] == [{"name": "get_weather", "arguments": {"city": "Oslo"}}]
    generating(monkeypatch, model, tokenizer, [alice], "llama")
    lines, out = iter(["Who?", "/exit"]), io.StringIO()
    chat(model, tokenizer, lambda: next(lines), out, max_new_tokens=64)
    assert out.getvalue().startswith('{"name": "Alice", "age": 30}\n') and "[tool call]" not in out.getvalue()


def test_chat_goes_on_after_every_result_of_parallel_calls(tiny_model_dir, model, monkeypatch) -> None:
    """After a reply with two calls the first /tool result is kept and the model waits for the second (it answered
    with one result missing, and the second call could never be answered); the follow-up sees both results."""
    tokenizer = tokenizer_for(tiny_model_dir, "qwen3")
    answer = {"role": "assistant", "content": "It is 26.6 F."}
    generating(monkeypatch, model, tokenizer, [written(tokenizer, QUESTION, TWO, "<|im_end|>"),
                                               written(tokenizer, QUESTION, answer, "<|im_end|>")], "qwen3")
    prompts, real = recording(monkeypatch, tokenizer)
    lines = iter(["How cold is Oslo?", '/tool {"temp_c": -3}', '/tool {"f": 26.6}', "/exit"])
    out = io.StringIO()
    assert chat(model, tokenizer, lambda: next(lines), out, max_new_tokens=64, tools=TOOLS) == 2
    second = {"role": "tool", "content": '{"f": 26.6}', "tool_call_id": "call00002", "name": "convert"}
    assert len(prompts) == 2 and prompts[1] == real(QUESTION + [TWO, RESULT, second], tools=TOOLS,
                                                    add_generation_prompt=True, tokenize=False)
    shown = out.getvalue().splitlines()
    assert "[result kept; 1 more call awaits /tool]" in shown and "It is 26.6 F." in shown


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_refuses_a_message_while_calls_await_their_results(tiny_model_dir, model, monkeypatch, family) -> None:
    """A message typed while the reply's calls await /tool results is refused with a line naming the next call (it
    went to the model as a user turn after a call with no result, a conversation no training row holds, and the
    calls were lost: `/tool` then said no call awaited a result); the calls stay, and their results are answered as
    if the line had not been typed."""
    tokenizer = tokenizer_for(tiny_model_dir, family)
    two = family not in ("gpt_oss", "llama")  # one call a turn
    reply = written(tokenizer, QUESTION, TWO if two else OSLO, STOPS[family][0])
    answer = written(tokenizer, QUESTION, {"role": "assistant", "content": "Cold."}, STOPS[family][1])
    generating(monkeypatch, model, tokenizer, [reply, answer], family)
    prompts, real = recording(monkeypatch, tokenizer)
    lines = iter(["How cold is Oslo?", "And Bergen?", '/tool {"temp_c": -3}'] + (
        ["And Bergen?", '/tool {"f": 26.6}'] if two else []) + ["/exit"])
    out = io.StringIO()
    assert chat(model, tokenizer, lambda: next(lines), out, max_new_tokens=64, tools=TOOLS) == 2
    second = {"role": "tool", "content": '{"f": 26.6}', "tool_call_id": "call00002", "name": "convert"}
    assert prompts[1] == real(QUESTION + ([TWO, RESULT, second] if two else [OSLO, RESULT]), tools=TOOLS,
                              add_generation_prompt=True, tokenize=False)
    refusals = [line for line in out.getvalue().splitlines() if "await" in line]
    first = "[2 tool calls await their results: give get_weather's" if two else \
        "[a tool call awaits its result: give get_weather's"
    assert refusals == [f"{first} with /tool TEXT (an error message is a result too), or /reset to start over]"] + (
        ["[result kept; 1 more call awaits /tool]", "[a tool call awaits its result: give convert's with /tool TEXT "
         "(an error message is a result too), or /reset to start over]"] if two else [])


def test_a_marker_in_the_trace_or_a_second_call_that_does_not_read(tiny_model_dir, model, monkeypatch) -> None:
    """A call marker left unfinished inside the think block does not stop the call after the trace from reading;
    a readable call followed by one that does not read makes the reply an unreadable call, all or none (the first
    call alone would be a turn chat keeps that the model did not write, and a compare hit on half a reply)."""
    good = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    reply = _reply(tiny_model_dir, model, monkeypatch, "qwen3",
                   f'<think>\nMaybe <tool_call>\n{{"name": "conv\n</think>\n\n{good}<|im_end|>')
    assert (reply.tool_calls, reply.unreadable_call, reply.reasoning) == (
        ({"name": "get_weather", "arguments": {"city": "Oslo"}},), None, 'Maybe <tool_call>\n{"name": "conv')
    for second in ('<tool_call>\n{"name": "convert", "argu', "<tool_call>\nnot json\n</tool_call>"):
        reply = _reply(tiny_model_dir, model, monkeypatch, "qwen3", f"{good}\n{second}<|im_end|>")
        assert (reply.tool_calls, reply.unreadable_call) == ((), f"{good}\n{second}")


@pytest.mark.parametrize("trace", ["", "<|channel|>analysis<|message|>Need it.<|end|><|start|>assistant"])
@pytest.mark.parametrize("preamble", ["", "<|channel|>commentary<|message|>Let me check.<|end|><|start|>assistant"])
@pytest.mark.parametrize("header", [" to=functions.get_weather<|channel|>commentary json<|message|>",
                                    "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"])
def test_gpt_oss_calls_in_the_models_own_order(tiny_model_dir, model, monkeypatch, trace, preamble, header) -> None:
    """gpt-oss writes the recipient after the channel too, and may say a preamble on the commentary channel first:
    the call reads either way, and the text and reasoning are clean (they were 'commentary' as text and 'Need
    it.assistantcommentary' as reasoning)."""
    written_reply = f'{trace}{preamble}{header}{{"city": "Oslo"}}<|call|>'
    reply = _reply(tiny_model_dir, model, monkeypatch, "gpt_oss", written_reply)
    assert (reply.text, reply.reasoning, reply.tool_calls) == (
        "Let me check." if preamble else "", "Need it." if trace else None,
        ({"name": "get_weather", "arguments": {"city": "Oslo"}},))


def test_the_layouts_do_not_keep_a_tokenizer_alive(tiny_model_dir) -> None:
    """The call and reasoning layouts are read once per tokenizer (again when its template changes) and do not keep
    it alive: an lru_cache keyed on the tokenizer held up to 8 of them after their last use."""
    import gc
    import weakref

    tokenizer = tokenizer_for(tiny_model_dir, "qwen3")
    assert call_layout(tokenizer).marker == "<tool_call>" and reasoning_layout(tokenizer.chat_template, tokenizer)
    assert call_layout(tokenizer) is call_layout(tokenizer)
    tokenizer.chat_template = LLAMA_TOOLS
    assert call_layout(tokenizer).marker == "" and reasoning_layout(tokenizer.chat_template, tokenizer) is None
    alive = weakref.ref(tokenizer)
    del tokenizer
    gc.collect()
    assert alive() is None


def test_compare_names_the_borrowed_template_a_tools_check_failed_on(tiny_model_dir, tmp_path, monkeypatch,
                                                                      capsys) -> None:
    """A model without a chat template is asked with the other's; where that template fails on its tokenizer (a
    bos_token it lacks) the --tools error named the template-less model alone, as if its own template failed."""
    from open_sft.export import compare

    def load(directory, kwargs, tokenizer_only=False):  # a fresh tokenizer each time, as from its directory
        assert tokenizer_only, "a model was loaded"
        tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
        if str(directory) == "before":
            tokenizer.chat_template, tokenizer.bos_token = None, None
        else:
            tokenizer.chat_template = ("{{ bos_token + '' }}{% for m in messages %}{{ m.content }}{% endfor %}"
                                       "{% if tools %}{{ tools | tojson }}{% endif %}")
        return tokenizer

    monkeypatch.setattr(compare, "_load", load)
    (tools := tmp_path / "tools.json").write_text(json.dumps(TOOLS))
    (tasks := tmp_path / "tasks.jsonl").write_text(json.dumps({"messages": QUESTION + [OSLO], "tools": TOOLS}) + "\n")
    for flags, where in [(["--tools", str(tools)], f"--tools {tools}"),
                         ([], f"--tasks {tasks} line 1: the row's tools")]:
        assert compare.main(["before", "after", "--tasks", str(tasks), *flags]) == 2
        assert f"error: {where} (before, asked with after's chat template: it has none): the chat template fails to " \
               "render the tools" in capsys.readouterr().err
