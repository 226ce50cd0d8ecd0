"""Tool-calling and reasoning rows under more families' templates, written here in their shapes (Hermes 2 Pro's and
3's tool_use template, under the Llama 3 licences; SmolLM3's, whose `{% generation %}` block holds the turn's header):
every assistant turn trains after exactly the context apply_chat_template gives it with the generation prompt,
through the token the model stops at."""

from __future__ import annotations

from open_sft.data.chat.examples import RowRender, _tags_disagree, row_examples
from open_sft.data.chat.render import DEFAULT_OPTIONS, special_markers
from open_sft.data.formats import to_messages
from tests.unit.data.test_call_closers import template_tokenizer
from tests.unit.data.test_reasoning_tool_calls import TOOLS, build, call, tool, trained_runs

# The shape of NousResearch's Hermes 2 Pro / Hermes 3 tool_use template: ChatML, the tools in the system turn, a call
# turn `<tool_call>\n{json}\n</tool_call>` (its content not written), tool results in one `tool` turn, each
# `<tool_response>\n...\n</tool_response>` followed by "\n" unless it is the conversation's last message, and the
# turn closed by `<|im_end|>` with no newline after it.
HERMES_SHAPE = (
    "{{- bos_token }}{{- '<|im_start|>system\\nTools: <tools> ' }}{%- for t in tools %}{{- t.function.name + ' ' }}"
    "{%- endfor %}{{- '</tools><|im_end|>\\n' }}{%- for m in messages %}"
    "{%- if m.role == 'user' or m.role == 'system' or (m.role == 'assistant' and m.tool_calls is not defined) %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- elif m.role == 'assistant' %}"
    "{{- '<|im_start|>assistant' }}{%- for c in m.tool_calls %}{{- '\\n<tool_call>\\n{\"name\": \"' + c.function.name"
    " + '\", \"arguments\": ' + c.function.arguments | tojson + '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}{%- elif m.role == 'tool' %}{%- if loop.previtem and loop.previtem.role != 'tool' %}"
    "{{- '<|im_start|>tool\\n' }}{%- endif %}{{- '<tool_response>\\n' + m.content }}"
    "{%- if not loop.last %}{{- '\\n</tool_response>\\n' }}{%- else %}{{- '\\n</tool_response>' }}{%- endif %}"
    "{%- if not loop.last and loop.nextitem.role != 'tool' %}{{- '<|im_end|>' }}{%- elif loop.last %}"
    "{{- '<|im_end|>' }}{%- endif %}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
HERMES_ROW = {"tools": TOOLS, "messages": [  # parallel calls, their results, an answer; then a call without an id
    {"role": "user", "content": "Weather in Paris and Lyon?"},
    {"role": "assistant", "content": None, "tool_calls": [call("get_weather", {"city": "Paris"}, 4),
                                                          call("get_weather", {"city": "Lyon"}, 5)]},
    tool('{"temp_c": 12}', 4), tool('{"temp_c": 15}', 5),
    {"role": "assistant", "content": "Paris 12, Lyon 15."},
    {"role": "user", "content": "And Bern?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Bern"}'}}]},
    {"role": "tool", "content": '{"temp_c": 5}'},
    {"role": "assistant", "content": "Bern has 5 degrees."}]}


def test_hermes_an_answer_after_tool_results_trains_after_the_prompt_that_ends_them(tiny_model_dir, tmp_path) -> None:
    """Hermes 2 Pro's and 3's templates close a tool result `</tool_response>\\n<|im_end|>` once a turn follows it and
    `</tool_response><|im_end|>` while it is the last message, as at inference: every answer after a tool result was
    refused ('what the template writes for this turn does not follow the generation prompt ...; choose another
    template'), the row with it, under the template the model was trained with. The answer trains after the prompt
    the model sees."""
    tokenizer = template_tokenizer(tiny_model_dir, HERMES_SHAPE, ["<|im_start|>", "<|im_end|>"], "<|im_end|>",
                                   "<|begin_of_text|>")
    examples, (report,) = build(tokenizer, tmp_path, [HERMES_ROW])
    messages = to_messages(HERMES_ROW, "messages")
    contexts = [tokenizer.apply_chat_template(messages[:k], tools=TOOLS, add_generation_prompt=True, tokenize=False)
                for k in (1, 4, 6, 8)]
    assert contexts[1].endswith('{"temp_c": 15}\n</tool_response><|im_end|><|im_start|>assistant\n')
    assert dict(trained_runs(tokenizer, examples)) == dict(zip(contexts, [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
        '{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call><|im_end|>',
        "Paris 12, Lyon 15.<|im_end|>",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Bern"}}\n</tool_call><|im_end|>',
        "Bern has 5 degrees.<|im_end|>"]))
    assert len(trained_runs(tokenizer, examples)) == 4
    assert report.rows_kept == 1 and not report.dropped
    # the history writes the answer's context otherwise: it trains in an example of its own
    assert report.examples == 2


# The shape of SmolLM3's template: the reasoning mode from enable_thinking (or /think, /no_think in the system
# prompt) in the system turn; each assistant turn inside one `{% generation %}` block that holds its header too,
# `<|im_start|>assistant\n` + content + `<|im_end|>\n` (under /no_think with an empty think block after the header),
# tool results as user turns; the generation prompt writes the header (and, under /no_think, the empty think block).
SMOLLM3_SHAPE = (
    "{%- if enable_thinking is not defined %}{%- set enable_thinking = true %}{%- endif %}"
    "{%- set mode = '/think' if enable_thinking else '/no_think' %}"
    "{%- if messages[0].role == 'system' and '/no_think' in messages[0].content %}{%- set mode = '/no_think' %}"
    "{%- endif %}{{- '<|im_start|>system\\nReasoning Mode: ' + mode + '\\n<|im_end|>\\n' }}"
    "{%- for message in messages %}{%- set content = message.content if message.content is string else '' %}"
    "{%- if message.role == 'user' or message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n' + content + '<|im_end|>\\n' }}{%- elif message.role == 'assistant' %}"
    "{% generation %}{%- if mode == '/think' %}"
    "{{- '<|im_start|>assistant\\n' + content.lstrip('\\n') + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n' + content.lstrip('\\n') + '<|im_end|>\\n' }}"
    "{%- endif %}{% endgeneration %}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if mode == '/no_think' %}{{- '<think>\\n\\n</think>\\n' }}{%- endif %}{%- endif %}"
)
THOUGHT = {"messages": [  # SmolLM3's data writes the trace in the content
    {"role": "user", "content": "What is 6 times 7?"},
    {"role": "assistant", "content": "<think>\nSix sevens are forty-two.\n</think>\n42."},
    {"role": "user", "content": "Thanks!"}, {"role": "assistant", "content": "You are welcome."}]}


def test_smollm3_generation_blocks_that_hold_the_header_agree_with_the_labels(tiny_model_dir, tmp_path,
                                                                               caplog) -> None:
    """SmolLM3's template marks `<|im_start|>assistant\\n` in each turn's `{% generation %}` block; the generation
    prompt writes it, so it is context and the turn trains without it. Every row was counted and warned about as
    'labelled otherwise than the chat template's {% generation %} tags mark ... check the tags, or the template', on
    the model's own template and right labels. A block's text before the trained run that is the end of the run's
    context agrees now; a block that leaves the end-of-turn token out is still counted."""
    tokenizer = template_tokenizer(tiny_model_dir, SMOLLM3_SHAPE, ["<|im_start|>", "<|im_end|>"], "<|im_end|>")
    no_think = {"messages": [{"role": "system", "content": "Be brief. /no_think"}, *THOUGHT["messages"][2:]]}
    with caplog.at_level("WARNING"):
        examples, (report,) = build(tokenizer, tmp_path, [THOUGHT, no_think])
    assert report.generation_tags_disagree == 0 and report.rows_kept == 2
    assert not [r for r in caplog.records if "{% generation %}" in r.getMessage()]
    runs = trained_runs(tokenizer, examples)
    assert [run for _, run in runs] == ["<think>\nSix sevens are forty-two.\n</think>\n42.<|im_end|>",
                                        "You are welcome.<|im_end|>", "You are welcome.<|im_end|>"]
    assert runs[2][0].endswith("Thanks!<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n")
    for (before, _), (row, k) in zip(runs, [(THOUGHT, 1), (THOUGHT, 3), (no_think, 2)]):
        assert before == tokenizer.apply_chat_template(row["messages"][:k], add_generation_prompt=True,
                                                       tokenize=False)
    tokenizer.chat_template = SMOLLM3_SHAPE.replace(" + '<|im_end|>\\n' }}{%- else %}", " }}{%- else %}")
    _, (report,) = build(tokenizer, tmp_path, [THOUGHT])  # /think turns' blocks without their <|im_end|>
    assert report.generation_tags_disagree == 1


# The shape of Hunyuan's template (Tencent's Hunyuan-A13B, whose licence limits use, so its text is not here): no
# generation prompt (an assistant turn follows the user's `<|extra_0|>` directly), calls as
# `<tool_calls>[json]</tool_calls>`, a turn closed by `<|eos|>`; with enable_thinking false it ends every rendering,
# generation prompt or not, with an empty think block.
HUNYUAN_SHAPE = (
    "{%- for m in messages %}{%- if m.role == 'system' %}{{- '<|startoftext|>' + m.content + '<|extra_4|>' }}"
    "{%- elif m.role == 'user' %}{{- '<|startoftext|>' + m.content + '<|extra_0|>' }}"
    "{%- elif m.role == 'tool' %}{{- '<tool_response>' + m.content + '</tool_response><|extra_0|>' }}"
    "{%- elif m.role == 'assistant' %}{{- m.content or '' }}{%- if m.tool_calls %}{{- '<tool_calls>[' }}"
    "{%- for c in m.tool_calls %}{{- ', ' if not loop.first }}{{- '{\"name\": \"' + c.function.name + '\", "
    "\"arguments\": ' + c.function.arguments | tojson + '}' }}{%- endfor %}{{- ']</tool_calls>' }}{%- endif %}"
    "{{- '<|eos|>' }}{%- endif %}{%- endfor %}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n' }}{%- endif %}"
)


def test_hunyuan_without_thinking_trains_each_turn_after_the_trailing_think_block(tiny_model_dir, tmp_path,
                                                                                 caplog) -> None:
    """Hunyuan's template with enable_thinking false writes its empty think block after the last message of every
    rendering, so a turn's rendering does not go on from its prompt (`...<|extra_0|><think>\\n\\n</think>\\n`) but from
    the messages before it: a call turn was refused ('does not follow the generation prompt ...; choose another
    template'), and a row without calls trained in one rendering, warned about as 'a turn answering an empty user
    message' under Mistral v0.3's template. Each turn trains after the prompt the model sees, trailer and all, what
    the template writes between the messages before it and that trailer."""
    tokenizer = template_tokenizer(tiny_model_dir, HUNYUAN_SHAPE, ["<|startoftext|>", "<|extra_0|>", "<|extra_4|>",
                                                                  "<|eos|>"], "<|eos|>")
    rows = [{"tools": TOOLS, "messages": [
        {"role": "user", "content": "Weather in Bern?"},
        {"role": "assistant", "content": "", "tool_calls": [call("get_weather", {"city": "Bern"}, 1)]},
        tool('{"temp_c": 5}', 1), {"role": "assistant", "content": "Bern has 5 degrees."}]},
        {"messages": [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello!"}]}]
    with caplog.at_level("WARNING"):
        examples, (report,) = build(tokenizer, tmp_path, rows, chat_template_kwargs='{"enable_thinking": false}')
    assert report.rows_kept == 2 and not report.dropped and report.turns_in_one_rendering == 0
    assert not [r for r in caplog.records if "empty user" in r.getMessage()]
    contexts = [tokenizer.apply_chat_template(to_messages(row, "messages")[:k], tools=row.get("tools"),
                                              add_generation_prompt=True, tokenize=False, enable_thinking=False)
                for row, k in ((rows[0], 1), (rows[0], 3), (rows[1], 1))]
    assert [context.endswith(end + "<|extra_0|><think>\n\n</think>\n") for context, end in zip(
        contexts, ["Bern?", "</tool_response>", "hello."])] == [True] * 3
    assert dict(trained_runs(tokenizer, examples)) == dict(zip(contexts, [
        '<tool_calls>[{"name": "get_weather", "arguments": {"city": "Bern"}}]</tool_calls><|eos|>',
        "Bern has 5 degrees.<|eos|>", "Hello!<|eos|>"]))
    assert len(trained_runs(tokenizer, examples)) == 3


MINISTRAL_SPECIALS = ["<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CALLS]",
                      "[ARGS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[THINK]", "[/THINK]", "[AVAILABLE_TOOLS]",
                      "[/AVAILABLE_TOOLS]"]


def test_ministral_reasoning_trains_traces_its_template_reads_as_thinking_blocks(tiny_model_dir, tmp_path) -> None:
    """Ministral-3-Reasoning's (and Magistral's) template writes a trace given as a content part
    `{"type": "thinking", "thinking": ...}` (`[THINK]trace[/THINK]answer`) and reads no reasoning field: a row's
    reasoning_content was left out under the model's own template (counted as reasoning the template does not write,
    'choose a template that writes it'), and a row in Mistral's own form, thinking parts, was refused ('content part 1
    is 'thinking'; only text parts ... can be trained on'). Both train the trace now, as the template writes it."""
    tokenizer = template_tokenizer(tiny_model_dir, "ministral_3_reasoning.jinja", MINISTRAL_SPECIALS, "</s>", "<s>")
    field = {"tools": TOOLS, "messages": [
        {"role": "user", "content": "How cold is Oslo?"},
        {"role": "assistant", "content": "", "reasoning_content": "I need the weather in Oslo.",
         "tool_calls": [call("get_weather", {"city": "Oslo"}, 1)]},
        tool('{"temp_c": -3}', 1), {"role": "assistant", "content": "-3 degrees.", "reasoning_content": "It said -3."}]}
    parts = {"messages": [{"role": "user", "content": "What is 6 times 7?"}, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Six sevens."}, {"type": "text", "text": "42."}]}]}
    examples, (report,) = build(tokenizer, tmp_path, [field, parts])
    assert report.reasoning_not_rendered == 0 and report.rows_kept == 2 and not report.dropped
    blocks = [dict(m) for m in field["messages"]]  # the field row as the template reads a trace: a thinking part
    for m in blocks:
        if m.get("reasoning_content"):
            m["content"] = [{"type": "thinking", "thinking": m.pop("reasoning_content")},
                            {"type": "text", "text": m["content"]}]
    contexts = [tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
                for messages, tools in ((blocks[:1], TOOLS), (blocks[:3], TOOLS), (parts["messages"][:1], None))]
    assert contexts[1].endswith('[/INST][THINK]I need the weather in Oslo.[/THINK][TOOL_CALLS]get_weather[ARGS]'
                                '{"city": "Oslo"}</s>[TOOL_RESULTS]{"temp_c": -3}[/TOOL_RESULTS]')
    assert dict(trained_runs(tokenizer, examples)) == dict(zip(contexts, [
        '[THINK]I need the weather in Oslo.[/THINK][TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}</s>',
        "[THINK]It said -3.[/THINK]-3 degrees.</s>", "[THINK]Six sevens.[/THINK]42.</s>"]))
    assert tokenizer.apply_chat_template(parts["messages"], tokenize=False).endswith(
        "[/INST][THINK]Six sevens.[/THINK]42.</s>")


def test_content_beside_calls_a_template_leaves_out_is_counted(tiny_model_dir, tmp_path, caplog) -> None:
    """Hermes' template writes a call turn's calls alone: the text a row gives beside them ('Let me check.') was
    neither trained nor said to be left out. Such rows are counted per source (content_not_rendered) and the first
    named in a warning; under a template that writes it (Qwen3's), not."""
    from tests.unit.data.test_reasoning_tool_calls import family_tokenizer

    said = {"tools": TOOLS, "messages": [{"role": "user", "content": "Weather in Bern?"}, {
        "role": "assistant", "content": "Let me check.", "tool_calls": [call("get_weather", {"city": "Bern"}, 1)]}]}
    hermes = template_tokenizer(tiny_model_dir, HERMES_SHAPE, ["<|im_start|>", "<|im_end|>"], "<|im_end|>",
                                "<|begin_of_text|>")
    with caplog.at_level("WARNING"):
        examples, (report,) = build(hermes, tmp_path, [HERMES_ROW, said])
    assert report.content_not_rendered == 1 and report.to_dict()["content_not_rendered"] == 1
    assert [run for _, run in trained_runs(hermes, examples)][-1] == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Bern"}}\n</tool_call><|im_end|>')
    warned = [r.getMessage() for r in caplog.records if "text beside the calls" in r.getMessage()]
    assert len(warned) == 1 and "1 row(s)" in warned[0] and "line 2)" in warned[0]
    qwen3 = family_tokenizer(tiny_model_dir, "qwen3")
    examples, (report,) = build(qwen3, tmp_path, [said])
    assert report.content_not_rendered == 0 and "Let me check." in trained_runs(qwen3, examples)[0][1]


def test_a_generation_block_whose_trace_the_labels_leave_out_disagrees(tiny_model_dir) -> None:
    """The check of the labels against SmolLM3's `{% generation %}` blocks let a block agree whatever it marked
    before the trained text, so long as that ended the context: labels leaving the turn's `<think>…</think>` out (a
    labelling bug) agreed. Only the generation prompt's text may come before the trained run now."""
    tokenizer = template_tokenizer(tiny_model_dir, SMOLLM3_SHAPE, ["<|im_start|>", "<|im_end|>"], "<|im_end|>")
    messages = to_messages(THOUGHT, "messages")
    rendered = row_examples(tokenizer, messages, "all_assistant", special_markers(tokenizer))
    (text, spans), = rendered.examples
    assert [text[a:b] for a, b in spans] == ["<think>\nSix sevens are forty-two.\n</think>\n42.<|im_end|>",
                                             "You are welcome.<|im_end|>"]
    assert not _tags_disagree(tokenizer, messages, rendered, DEFAULT_OPTIONS)
    (a, b), rest = spans[0], spans[1:]
    trace_untrained = [(text.index("42.", a), b), *rest]
    assert _tags_disagree(tokenizer, messages, RowRender([(text, trace_untrained)]), DEFAULT_OPTIONS)
