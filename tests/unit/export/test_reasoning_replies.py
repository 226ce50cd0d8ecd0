"""Replies of reasoning models under the templates their repositories ship (Qwen3, gpt-oss, GLM-4.5:
tests/data/chat_templates): `generate`, `chat` and `compare` split the reasoning from the answer as the template
writes it. The reply a model generates is here the template's own rendering of an assistant message (what a
model trained on it generates), handed to generate_reply through a model whose generate returns those tokens."""

from __future__ import annotations

import io

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from open_sft.export import compare
from open_sft.export.chat import chat
from open_sft.export.compare import reasoning_lines, score_tasks
from open_sft.export.generate import END_OF_TURN, TOKEN_LIMIT, generate_reply, score_sample
from open_sft.export.reply import parse_reply, reasoning_layout

from ..data.test_reasoning_tool_calls import family_tokenizer

QUESTION = [{"role": "user", "content": "What is 2+2?"}]
THOUGHT = {"role": "assistant", "content": "4.", "reasoning_content": "Two plus two is four."}
# what each family's model generates after the generation prompt, less the token that ends it
REPLIES = {"qwen3": "<think>\nTwo plus two is four.\n</think>\n\n4.",
           "gpt_oss": "<|channel|>analysis<|message|>Two plus two is four.<|end|><|start|>assistant<|channel|>final"
                      "<|message|>4.",
           "glm": "\n<think>Two plus two is four.</think>\n4."}
STOP = {"qwen3": "<|im_end|>", "gpt_oss": "<|return|>", "glm": "<|user|>"}
FOUR = [{"messages": [{"role": "assistant", "content": "4"}]}]  # a task expecting an answer, not a call


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


def generating(monkeypatch, model, tokenizer, replies: list[str]):
    """`model` made to generate `replies` in turn (each as the tokenizer encodes it) after any prompt."""
    queue = [tokenizer(reply, add_special_tokens=False)["input_ids"] for reply in replies]
    model.generation_config.eos_token_id = sorted({tokenizer.convert_tokens_to_ids(t) for t in STOP.values()}
                                                  - {tokenizer.unk_token_id, None})

    def generate(**kwargs):
        new = queue.pop(0)[:kwargs["max_new_tokens"]]
        return torch.cat([kwargs["input_ids"], torch.tensor([new], dtype=torch.long)], dim=1)

    monkeypatch.setattr(model, "generate", generate)
    return model


def recording_prompts(monkeypatch, tokenizer):
    """(the prompts the tokenizer's template renders from here on, as text; its own apply_chat_template)."""
    prompts = []
    real = tokenizer.apply_chat_template

    def recording(messages, **kwargs):
        prompts.append(real(messages, add_generation_prompt=True, tokenize=False))
        return real(messages, **kwargs)

    monkeypatch.setattr(tokenizer, "apply_chat_template", recording)
    return prompts, real


@pytest.mark.parametrize("family", sorted(REPLIES))
def test_the_template_itself_writes_the_reply_that_is_split(tiny_model_dir, family) -> None:
    """The replies above are what the template renders for THOUGHT after the generation prompt: the split reads
    the template, so it holds for what the model was trained to write."""
    tokenizer = family_tokenizer(tiny_model_dir, family)
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert tokenizer.apply_chat_template(QUESTION + [THOUGHT], tokenize=False)[len(prompt):].startswith(
        REPLIES[family])
    assert reasoning_layout(tokenizer.chat_template, tokenizer).answer_marker == {
        "qwen3": "</think>", "glm": "</think>", "gpt_oss": "<|channel|>final<|message|>"}[family]


@pytest.mark.parametrize("family", sorted(REPLIES))
def test_a_reasoning_reply_is_its_answer_and_the_trace_apart(tiny_model_dir, model, monkeypatch, family) -> None:
    """gpt-oss's reply came out as `analysisTwo plus two is four.assistantfinal4.` (its markers are special tokens,
    decoded away), Qwen3's as `<think>...</think>\\n\\n4.`: the answer is `4.`, the trace is `reasoning`."""
    tokenizer = family_tokenizer(tiny_model_dir, family)
    generating(monkeypatch, model, tokenizer, [REPLIES[family] + STOP[family]])
    reply = generate_reply(model, tokenizer, QUESTION, 64)
    assert (reply.text, reply.reasoning, reply.answered, reply.stop_reason, reply.stop_token) == (
        "4.", "Two plus two is four.", True, END_OF_TURN, STOP[family])
    assert reply.message() == THOUGHT


@pytest.mark.parametrize("family, cut_at", [("qwen3", "\n</think>"), ("glm", "</think>"),
                                            ("gpt_oss", "<|end|>"), ("gpt_oss", "sis<|message|>")])
def test_a_reply_cut_inside_its_reasoning_has_no_answer(tiny_model_dir, family, cut_at) -> None:
    tokenizer = family_tokenizer(tiny_model_dir, family)
    text = REPLIES[family][:REPLIES[family].index(cut_at)]
    parts = parse_reply(tokenizer, tokenizer(text, add_special_tokens=False)["input_ids"], [])
    assert (parts.answer, parts.answered) == ("", False)
    assert parts.reasoning == ("" if cut_at.startswith("sis") else "Two plus two is four.")


def test_a_template_without_reasoning_keeps_the_reply_as_generated(tiny_model_dir, model, monkeypatch) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert reasoning_layout(tokenizer.chat_template, tokenizer) is None
    generating(monkeypatch, model, tokenizer, [" 4. \n" + tokenizer.eos_token])
    reply = generate_reply(model, tokenizer, QUESTION, 64)
    assert (reply.text, reply.reasoning) == (" 4. \n", None)  # as generated, whitespace kept
    assert reply.message() == {"role": "assistant", "content": " 4. \n"}


@pytest.mark.parametrize("family", sorted(REPLIES))
def test_compare_scores_the_answer_and_says_what_was_set_aside(tiny_model_dir, model, monkeypatch, family) -> None:
    """Every reasoning model scored 0 on right answers (the think block, the analysis channel were compared too);
    a reply cut inside its reasoning is a miss that says so, with the fix."""
    tokenizer = family_tokenizer(tiny_model_dir, family)
    rows = [{"messages": QUESTION + [THOUGHT], "answer": "4."}] * 2
    endless = REPLIES[family][:REPLIES[family].index("Two")] + " Two plus two" * 40  # cut off at 64 tokens
    generating(monkeypatch, model, tokenizer, [REPLIES[family] + STOP[family], endless])
    score = score_tasks(model, tokenizer, rows, max_new_tokens=64)
    assert (score.answers[0], score.correct, score.cut, score.limited) == ("4.", [True, False], [False, True],
                                                                            [False, True])
    assert reasoning_lines("after (out)", score, 9) == [
        "after (out): 2 of 2 replies began with the reasoning their chat template writes (a think block, an analysis "
        "channel): it was set aside and the answer after it scored",
        "after (out): 1 of 2 replies stopped inside their reasoning, before any answer (scored as misses); 1 of them "
        "cut off at --max_new_tokens 9: raise it"]
    table = compare.format_table(rows, score, score, 2).splitlines()
    assert "✓ 4. " in table[1] and "✗ (stopped in its reasoning)" in table[2]
    assert compare.default_limits("out", tokenizer, tokenizer.chat_template, FOUR) == [
        compare.REASONING_MAX_NEW_TOKENS]
    plain = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert compare.default_limits("base", plain, plain.chat_template, FOUR) == [compare.MAX_NEW_TOKENS]


def test_score_sample_scores_the_answer(tiny_model_dir, model, monkeypatch) -> None:
    tokenizer = family_tokenizer(tiny_model_dir, "qwen3")
    rows = [{"messages": [{"role": "user", "content": "What is 7 plus 5?"}, {"role": "assistant", "content": "12"}],
             "answer": "12"}] * 2
    generating(monkeypatch, model, tokenizer, ["<think>\n\n</think>\n\n12<|im_end|>", "<think>\nSeven and"])
    assert score_sample(model, tokenizer, rows, 32) == {"held_out_tasks": 2, "exact_answer_accuracy": 0.5,
                                                        "reasoning_set_aside": 2, "cut_before_answer": 1}


@pytest.mark.parametrize("family", sorted(REPLIES))
def test_chat_shows_the_trace_apart_and_keeps_history_as_the_template_renders_it(tiny_model_dir, model,
                                                                                 monkeypatch, family) -> None:
    """chat stored the decoded text as the content: gpt-oss's next turn rendered `analysisTwo plus two is
    four.assistantfinal4.` as a final message, GLM's lost its think tags. The history now holds the answer and its
    trace as the template reads them, so the second prompt is what the template renders for the conversation."""
    tokenizer = family_tokenizer(tiny_model_dir, family)
    generating(monkeypatch, model, tokenizer, [REPLIES[family] + STOP[family]] * 2)
    prompts, real = recording_prompts(monkeypatch, tokenizer)
    lines, out = iter(["What is 2+2?", "Again?"]), io.StringIO()
    assert chat(model, tokenizer, lambda: next(lines, None), out, max_new_tokens=64) == 2
    assert out.getvalue().startswith("[reasoning]\nTwo plus two is four.\n[/reasoning]\n4.\n[end of turn (")
    expected = real(QUESTION + [THOUGHT, {"role": "user", "content": "Again?"}], add_generation_prompt=True,
                    tokenize=False)
    assert prompts[-1] == expected
    assert "analysisTwo" not in prompts[-1] and TOKEN_LIMIT not in out.getvalue()


def test_a_tokenizer_with_a_response_template_parses_with_transformers(tiny_model_dir, monkeypatch) -> None:
    """A tokenizer that ships a response_template (transformers 5's parse_response) is parsed by it, not by the
    layout read from the template."""
    tokenizer = family_tokenizer(tiny_model_dir, "qwen3")
    tokenizer.response_template = {"start_anchor": "<|im_start|>assistant\n", "fields": {
        "reasoning_content": {"open": "<think>", "close": "</think>", "optional": True}, "content": {}}}
    calls = []
    parse = tokenizer.parse_response
    monkeypatch.setattr(tokenizer, "parse_response", lambda *a, **k: calls.append(a) or parse(*a, **k))
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)["input_ids"]
    ids = tokenizer(REPLIES["qwen3"], add_special_tokens=False)["input_ids"]
    parts = parse_reply(tokenizer, ids, prompt)
    assert (parts.answer, parts.reasoning, parts.answered, len(calls)) == ("4.", "Two plus two is four.", True, 1)
    assert parse_reply(tokenizer, ids[:5], prompt).answered is False


def test_a_trace_the_generation_prompt_opens_is_set_aside_and_kept_in_the_content(tiny_model_dir, model,
                                                                                   monkeypatch) -> None:
    """Templates with no reasoning field whose generation prompt opens `<think>` (open-instruct's thinker and
    r1_simple_chat templates, DeepSeek-R1 distills): the reply continues the trace, and its answer follows
    `</think>`. chat kept it as {content, reasoning_content}, which these templates drop: the next turn's history
    lost the trace its training rows hold (`<think>trace</think>answer` in the content), and the model wrote
    garbage there; a reply cut before `</think>` was scored as a wrong answer, at compare's 16 tokens."""
    from open_sft.data.chat.templates import OPEN_INSTRUCT_TEMPLATES

    tokenizer = family_tokenizer(tiny_model_dir, "qwen3")
    tokenizer.chat_template = OPEN_INSTRUCT_TEMPLATES["olmo_thinker"][0]
    assert tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False).endswith("<think>")
    trained = {"role": "assistant", "content": "<think>Two plus two is four.</think>4."}  # as a training row holds it
    generating(monkeypatch, model, tokenizer, ["Two plus two is four.</think>4.<|im_end|>"] * 2)
    prompts, real = recording_prompts(monkeypatch, tokenizer)
    lines, out = iter(["What is 2+2?", "Again?"]), io.StringIO()
    assert chat(model, tokenizer, lambda: next(lines, None), out, max_new_tokens=64) == 2
    assert out.getvalue().startswith("[reasoning]\nTwo plus two is four.\n[/reasoning]\n4.\n[end of turn (")
    assert prompts[-1] == real(QUESTION + [trained, {"role": "user", "content": "Again?"}],
                               add_generation_prompt=True, tokenize=False)
    monkeypatch.setattr(tokenizer, "apply_chat_template", real)
    cut = parse_reply(tokenizer, tokenizer("Two plus two", add_special_tokens=False)["input_ids"],
                      tokenizer(real(QUESTION, add_generation_prompt=True, tokenize=False))["input_ids"])
    assert (cut.answer, cut.reasoning, cut.answered) == ("", "Two plus two", False)
    assert compare.default_limits("out", tokenizer, tokenizer.chat_template, FOUR) == [
        compare.REASONING_MAX_NEW_TOKENS]


@pytest.mark.parametrize("family", ["r1", "qwq"])
def test_a_reply_as_trained_under_a_prompt_that_opens_the_trace(tiny_model_dir, model, monkeypatch, tmp_path,
                                                                family) -> None:
    """DeepSeek-R1 distills' and QwQ's turns train the trace after the generation prompt's `<think>\\n`
    (data/chat/opened_trace.py). The reply a model trained on a one-row R1-style set generates, its trained tokens,
    is read back by generate and chat: the trace apart, the answer after `</think>`, the end of turn its stop; and
    chat's next prompt writes it in history as the template writes the training row."""
    from ..data.test_opened_traces import END, INLINE, QUESTION as ASKED, TRACE, build, family_tokenizer as opened
    from open_sft.data.labels import trained_token_runs

    tokenizer = opened(tiny_model_dir, family)
    asked = [{"role": "user", "content": ASKED}]
    (example,), _ = build(tokenizer, tmp_path, [asked + [INLINE]])
    (run,) = trained_token_runs(example.input_ids, example.labels)
    generated = tokenizer.decode(run)
    generating(monkeypatch, model, tokenizer, [generated] * 3)
    reply = generate_reply(model, tokenizer, asked, 64)
    assert (reply.text, reply.reasoning, reply.answered, reply.stop_reason, reply.stop_token) == (
        "42.", TRACE, True, END_OF_TURN, END[family])
    prompts, real = recording_prompts(monkeypatch, tokenizer)
    lines, out = iter([ASKED, "Again?"]), io.StringIO()
    assert chat(model, tokenizer, lambda: next(lines, None), out, max_new_tokens=64) == 2
    assert out.getvalue().startswith(f"[reasoning]\n{TRACE}\n[/reasoning]\n42.\n[end of turn (")
    again = {"role": "user", "content": "Again?"}
    assert prompts[-1] == real(asked + [INLINE, again], add_generation_prompt=True, tokenize=False)
