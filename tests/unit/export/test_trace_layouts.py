"""Reasoning layouts a template shows without writing a reasoning field after its generation prompt
(open_sft.export.trace_layout): Gemma 4's thought channel (`<|channel>thought\\nTRACE<channel|>ANSWER`, which its
template reads out of a content and its generation prompt closes empty unless enable_thinking) and Apriel-1.6's trace
opened by the words of its generation prompt (`TRACE\\n[BEGIN FINAL RESPONSE]\\nANSWER`). generate, chat and compare
took either whole reply for the answer: Gemma 4's as `thought\\nTRACE ANSWER` (its markers decoded away), Apriel's
trace, marker and answer, both scored wrong against the right answer."""

from __future__ import annotations

import io

import pytest
from transformers import AutoTokenizer

from open_sft.export import compare
from open_sft.export.chat import chat
from open_sft.export.compare import score_tasks
from open_sft.export.generate import END_OF_TURN, generate_reply
from open_sft.export.reply import parse_reply
from open_sft.export.trace_layout import ReasoningLayout, reasoning_layout, writes_reasoning

from ..data.test_reasoning_tool_calls import TOOLS, build, call, trained_runs
from ..data.test_template_families import gemma4_tokenizer
from ..data.test_worded_opening import PREFIX, apriel_tokenizer
from .test_reasoning_replies import QUESTION, THOUGHT, generating, model, recording_prompts  # noqa: F401

TRACE, ANSWER = THOUGHT["reasoning_content"], THOUGHT["content"]
AGAIN = {"role": "user", "content": "Again?"}


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def gemma4_reply(tokenizer) -> str:
    """What Gemma 4 writes after its enable_thinking prompt (`<|turn>model\n`): the empty thought block its default
    prompt closes after that header, with the trace in it, then the answer."""
    thinking = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False, enable_thinking=True)
    default = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert thinking.endswith("<|turn>model\n")
    block = default[default.rindex("<|turn>model\n") + len("<|turn>model\n"):]
    assert block == "<|channel>thought\n<channel|>"
    return block.replace("<channel|>", TRACE + "<channel|>") + ANSWER


def apriel_reply(tokenizer) -> str:
    """What Apriel-1.6 writes after its generation prompt: its template's turn with THOUGHT where the prompt's words
    stand (the words left out)."""
    context = tokenizer.apply_chat_template(QUESTION, tokenize=False)
    turn = tokenizer.apply_chat_template(QUESTION + [THOUGHT], tokenize=False)[len(context):]
    assert turn.startswith("\n<|begin_assistant|>\n")
    return turn.removeprefix("\n<|begin_assistant|>\n")


# the shape of Mistral's reasoning templates (Magistral's, Ministral-3-Reasoning's): a trace is a `thinking` chunk of
# the content, written `[THINK]...[/THINK]` (special tokens), in history too; no generation prompt, eos after a turn
MISTRAL_THINK_SHAPE = (
    "{{- bos_token }}{%- for message in messages %}{%- if message['role'] == 'user' %}"
    "{{- '[INST]' + message['content'] + '[/INST]' }}{%- elif message['role'] == 'assistant' %}"
    "{%- if message['content'] is string %}{{- message['content'] }}{%- else %}{%- for block in message['content'] %}"
    "{%- if block['type'] == 'text' %}{{- block['text'] }}{%- elif block['type'] == 'thinking' %}"
    "{{- '[THINK]' + block['thinking'] + '[/THINK]' }}{%- endif %}{%- endfor %}{%- endif %}{{- eos_token }}"
    "{%- endif %}{%- endfor %}")
CHUNKED = {"role": "assistant", "content": [{"type": "thinking", "thinking": TRACE}, {"type": "text", "text": ANSWER}]}


def mistral_tokenizer(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_special_tokens({"bos_token": "<s>", "eos_token": "</s>", "additional_special_tokens": [
        "[INST]", "[/INST]", "[THINK]", "[/THINK]"]})
    tokenizer.chat_template = MISTRAL_THINK_SHAPE
    return tokenizer


def mistral_reply(tokenizer) -> str:
    """What the template writes for a turn with a thinking chunk after the prompt, less the eos it stops at."""
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    return tokenizer.apply_chat_template(QUESTION + [CHUNKED], tokenize=False)[len(prompt):].removesuffix("</s>")


FAMILIES = {"gemma4": (gemma4_tokenizer, gemma4_reply, "<turn|>"),
            "apriel": (apriel_tokenizer, apriel_reply, "<|end|>"),
            "mistral": (mistral_tokenizer, mistral_reply, "</s>")}


def test_the_layouts_are_read_off_the_templates(tiny_model_dir) -> None:
    gemma, apriel, mistral = (make(tiny_model_dir) for make in (gemma4_tokenizer, apriel_tokenizer, mistral_tokenizer))
    assert reasoning_layout(gemma.chat_template, gemma) == ReasoningLayout(
        "<|channel>thought", "<channel|>", "<channel|>", closed=True)
    assert reasoning_layout(apriel.chat_template, apriel) == ReasoningLayout(
        "", "[BEGIN FINAL RESPONSE]", "[BEGIN FINAL RESPONSE]", opened=True)
    assert reasoning_layout(mistral.chat_template, mistral) == ReasoningLayout(
        "[THINK]", "[/THINK]", "[/THINK]", chunks=True)
    assert (gemma4_reply(gemma), apriel_reply(apriel), mistral_reply(mistral)) == (
        "<|channel>thought\nTwo plus two is four.<channel|>4.", "Two plus two is four.\n[BEGIN FINAL RESPONSE]\n4.",
        "[THINK]Two plus two is four.[/THINK]4.")
    # Gemma 4's default prompt closes the trace (its replies are answers: compare's default budget); Apriel's opens it
    assert [writes_reasoning(t.chat_template, t) for t in (gemma, apriel, mistral)] == [False, True, True]


def test_a_template_that_writes_a_content_list_as_json_has_no_chunk_layout(tiny_model_dir) -> None:
    """GigaChat3's writes a list content as JSON (`[{"type": "thinking", ...}]`): no trace it reads."""
    from ..data.test_reasoning_tool_calls import TEMPLATES

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = (TEMPLATES / "gigachat3.jinja").read_text()
    assert '"thinking": "' in tokenizer.apply_chat_template(QUESTION + [CHUNKED], tokenize=False)
    assert reasoning_layout(tokenizer.chat_template, tokenizer) is None


def test_a_template_that_keeps_such_a_block_in_the_content_has_no_layout(tiny_model_dir) -> None:
    """Gemma 4's template without its strip_thinking (the content written as given): the empty block its prompt
    closes is no trace the template reads, so replies stay text."""
    tokenizer = gemma4_tokenizer(tiny_model_dir)
    tokenizer.chat_template = tokenizer.chat_template.replace("strip_thinking(message['content'])",
                                                              "message['content'] | trim")
    assert reasoning_layout(tokenizer.chat_template, tokenizer) is None
    reply = gemma4_reply(tokenizer)
    assert parse_reply(tokenizer, _ids(tokenizer, reply), []).reasoning is None


@pytest.mark.parametrize("family", ["apriel", "gemma4"])
def test_generate_splits_the_reply_and_chat_keeps_history_as_training_did(tiny_model_dir, model, monkeypatch, tmp_path,
                                                                          family) -> None:
    """The answer is `4.`, the trace `reasoning`; chat's next prompt is what training shows as the context of a
    second turn (the data side's own example: Apriel's history writes `4.\\n<|end|>\\n` where the model wrote
    `4.<|end|>`, as its template writes history in training too)."""
    make, written, stop = FAMILIES[family]
    tokenizer = make(tiny_model_dir)
    generating(monkeypatch, model, tokenizer, [written(tokenizer) + stop] * 3)
    reply = generate_reply(model, tokenizer, QUESTION, 64)
    assert (reply.text, reply.reasoning, reply.answered, reply.stop_reason, reply.stop_token) == (
        ANSWER, TRACE, True, END_OF_TURN, stop)
    assert reply.message() == THOUGHT
    prompts, real = recording_prompts(monkeypatch, tokenizer)
    lines, out = iter(["What is 2+2?", "Again?"]), io.StringIO()
    assert chat(model, tokenizer, lambda: next(lines, None), out, max_new_tokens=64) == 2
    assert out.getvalue().startswith(f"[reasoning]\n{TRACE}\n[/reasoning]\n{ANSWER}\n[end of turn ({stop})")
    monkeypatch.setattr(tokenizer, "apply_chat_template", real)
    examples, _ = build(tokenizer, tmp_path, [{"messages": QUESTION + [THOUGHT, AGAIN, {
        "role": "assistant", "content": "Still 4."}]}])
    second_context = trained_runs(tokenizer, examples)[-1][0]
    assert prompts[-1] == second_context
    assert prompts[-1].endswith({"gemma4": "<|turn>model\n4.<turn|>\n<|turn>user\nAgain?<turn|>\n<|turn>model\n"
                                           "<|channel>thought\n<channel|>",
                                 "apriel": "\n<|begin_assistant|>\n4.\n<|end|>\n<|begin_user|>\nAgain?" + "\n" + PREFIX
                                 }[family])


def test_a_mistral_trace_is_split_and_kept_in_history_as_the_model_wrote_it(tiny_model_dir, model, monkeypatch) -> None:
    """`[THINK]TRACE[/THINK]ANSWER` was the answer `TRACEANSWER` (its special tokens decoded away). The reply's message
    holds the trace as the thinking chunk the template writes, so chat's next prompt is the first one, the reply as
    the model wrote it and its eos, then the new user turn."""
    tokenizer = mistral_tokenizer(tiny_model_dir)
    written = mistral_reply(tokenizer)
    generating(monkeypatch, model, tokenizer, [written + "</s>"] * 3)
    reply = generate_reply(model, tokenizer, QUESTION, 64)
    assert (reply.text, reply.reasoning, reply.answered, reply.stop_token) == (ANSWER, TRACE, True, "</s>")
    assert reply.message() == CHUNKED
    prompts, _ = recording_prompts(monkeypatch, tokenizer)
    lines, out = iter(["What is 2+2?", "Again?"]), io.StringIO()
    assert chat(model, tokenizer, lambda: next(lines, None), out, max_new_tokens=64) == 2
    assert out.getvalue().startswith(f"[reasoning]\n{TRACE}\n[/reasoning]\n{ANSWER}\n[end of turn (</s>)")
    assert prompts == [prompts[0], prompts[0] + written + "</s>[INST]Again?[/INST]"]
    cut = parse_reply(tokenizer, _ids(tokenizer, "[THINK]Two plus"), _ids(tokenizer, prompts[0]))
    assert (cut.answered, cut.message()) == (False, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Two plus"}]})  # a trace cut short stays the template's chunk too
    assert prompts[-1] == "<s>[INST]What is 2+2?[/INST][THINK]Two plus two is four.[/THINK]4.</s>[INST]Again?[/INST]"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_reply_cut_at_any_token_is_never_a_wrong_answer(tiny_model_dir, family) -> None:
    """Cut at --max_new_tokens anywhere: before the answer's marker the reply stopped in its reasoning (no answer,
    the trace so far); past it, the answer so far. Never the trace or its markup as the answer."""
    make, written, _ = FAMILIES[family]
    tokenizer = make(tiny_model_dir)
    ids = _ids(tokenizer, written(tokenizer))
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False,
                                           **({"enable_thinking": True} if family == "gemma4" else {}))
    marker = reasoning_layout(tokenizer.chat_template, tokenizer).answer_marker
    seen = set()
    for cut in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:cut], skip_special_tokens=False)
        parts = parse_reply(tokenizer, ids[:cut], _ids(tokenizer, prompt))
        if marker in text:
            assert (parts.answered, parts.reasoning) == (True, TRACE) and ANSWER.startswith(parts.answer), cut
            seen.add("answer")
        else:
            assert (parts.answered, parts.answer) == (False, ""), cut
            assert parts.reasoning in "thought\n" + TRACE + "\n[BEGIN FINAL RESPONSE]", cut
            seen.add("reasoning")
    assert seen == {"answer", "reasoning"}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_compare_scores_the_answer_after_the_trace(tiny_model_dir, model, monkeypatch, family) -> None:
    make, written, stop = FAMILIES[family]
    tokenizer = make(tiny_model_dir)
    rows = [{"messages": QUESTION + [THOUGHT], "answer": ANSWER}] * 2
    generating(monkeypatch, model, tokenizer, [written(tokenizer) + stop, written(tokenizer)[:12]])
    score = score_tasks(model, tokenizer, rows, max_new_tokens=64)
    assert (score.answers, score.correct, score.cut) == ([ANSWER, ""], [True, False], [False, True])
    assert compare.format_table(rows, score, score, 2).splitlines()[2].count("(stopped in its reasoning)") == 2


def test_an_apriel_call_is_read_after_the_marker_and_one_inside_the_trace_is_reasoning(tiny_model_dir) -> None:
    """Its call turn as the template writes it (`TRACE\\n[BEGIN FINAL RESPONSE]\\n\\n<tool_calls>[...]</tool_calls>`):
    the call, the trace apart; before, the trace was the answer. A call the trace muses about was read as a call
    made up from the reasoning, and the trace as the answer."""
    tokenizer = apriel_tokenizer(tiny_model_dir)
    asked = [{"role": "user", "content": "Weather in Oslo?"}]
    prompt = _ids(tokenizer, tokenizer.apply_chat_template(asked, tools=TOOLS, add_generation_prompt=True,
                                                           tokenize=False))
    assert tokenizer.decode(prompt).endswith(PREFIX)
    message = {"role": "assistant", "content": "", "reasoning_content": "Need weather.",
               "tool_calls": [call("get_weather", {"city": "Oslo"}, 1)]}
    context = tokenizer.apply_chat_template(asked, tools=TOOLS, tokenize=False)
    turn = tokenizer.apply_chat_template(asked + [message], tools=TOOLS, tokenize=False)[len(context):]
    written = turn.removeprefix("\n<|begin_assistant|>\n")
    assert written == ('Need weather.\n[BEGIN FINAL RESPONSE]\n\n<tool_calls>[{"name": "get_weather", "arguments": '
                       '{"city": "Oslo"}}]</tool_calls>')
    parts = parse_reply(tokenizer, _ids(tokenizer, written), prompt, TOOLS, "<|end|>")
    expected = ({"name": "get_weather", "arguments": {"city": "Oslo"}},)
    assert (parts.tool_calls, parts.reasoning, parts.answer, parts.unreadable_call) == (
        expected, "Need weather.", "", None)
    musing = ('Maybe <tool_calls>[{"name": "get_weather", "arguments": {"city": "Oslo"}}]</tool_calls> no.\n'
              '[BEGIN FINAL RESPONSE]\nCold.')
    parts = parse_reply(tokenizer, _ids(tokenizer, musing), prompt, TOOLS, "<|end|>")
    assert (parts.tool_calls, parts.answer, parts.unreadable_call) == ((), "Cold.", None)
    assert parts.reasoning == musing.split("\n[BEGIN")[0]
    ids = _ids(tokenizer, written)
    for cut in range(1, len(ids)):  # cut anywhere: never a call; past the call's marker, an unreadable one
        parts = parse_reply(tokenizer, ids[:cut], prompt, TOOLS, "")
        text = tokenizer.decode(ids[:cut])
        assert parts.tool_calls == () and "<tool_calls>".startswith(parts.answer), cut  # "<": text so far
        called = text[text.index("<tool_calls>"):].strip() if "<tool_calls>" in text else None
        assert parts.unreadable_call == called, cut
        assert parts.reasoning == ("Need weather." if "[BEGIN FINAL RESPONSE]" in text else text.strip()), cut
