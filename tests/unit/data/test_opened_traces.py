"""Reasoning models whose own template leaves the trace out of every assistant turn it writes, the last one too,
while its generation prompt opens the think block (DeepSeek-R1 distills': tests/data/chat_templates/
deepseek_r1_distill.jinja; QwQ-32B's: qwq.jinja). Each turn trains what the model writes after that generation prompt:
its trace, `</think>`, the answer and the end of its turn (chat/opened_trace.py). They trained the answer alone, after
`<｜Assistant｜>` (R1) or after `<|im_start|>assistant\\n` (QwQ), a context the model never sees, and no trace.

Checked token by token against apply_chat_template: each example is the template's generation prompt for the turn
(the earlier turns as the template writes history) followed by the trained text, which is the text written here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import AddedToken
from transformers import AutoTokenizer

from open_sft.config.args import DataArguments
from open_sft.data.build import build_examples
from open_sft.data.labels import IGNORE_INDEX, trained_token_runs

TEMPLATES = Path(__file__).parents[2] / "data" / "chat_templates"
# per template: the file, its special tokens (bos, eos, others); <think> and </think> are added tokens, not special
FAMILIES = {"r1": ("deepseek_r1_distill.jinja", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
                   ["<｜User｜>", "<｜Assistant｜>"]),
            "qwq": ("qwq.jinja", None, "<|im_end|>", ["<|im_start|>", "<|endoftext|>"])}
END = {"r1": "<｜end▁of▁sentence｜>", "qwq": "<|im_end|>"}
QUESTION, TRACE, ANSWER = "What is 6 times 7?", "Six sevens are forty-two.", "42."
INLINE = {"role": "assistant", "content": f"<think>\n{TRACE}\n</think>\n\n{ANSWER}"}  # OpenR1-Math's form
OPEN_TAG_LEFT_OUT = {"role": "assistant", "content": f"{TRACE}\n</think>\n\n{ANSWER}"}  # R1's raw output's form
FIELD = {"role": "assistant", "content": ANSWER, "reasoning_content": TRACE}
NO_TRACE = {"role": "assistant", "content": ANSWER}


@pytest.fixture(params=sorted(FAMILIES))
def family(request):
    return request.param


def family_tokenizer(tiny_model_dir, family: str):
    template, bos, eos, specials = FAMILIES[family]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_special_tokens({**({"bos_token": bos} if bos else {}), "eos_token": eos,
                                  "additional_special_tokens": specials})
    tokenizer.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in ("<think>", "</think>")])
    tokenizer.chat_template = (TEMPLATES / template).read_text()
    return tokenizer


def build(tokenizer, tmp_path: Path, rows: list[dict], **flags):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"messages": row}) + "\n" for row in rows))
    return build_examples(DataArguments(dataset_mixer_list=[str(data), "1.0"], max_seq_length=4096, **flags),
                          tokenizer, 0)


def prompt_of(tokenizer, messages: list[dict]) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def expected(tokenizer, pieces: list[tuple[str, bool]]) -> tuple[list[int], list[int]]:
    """The token ids and labels of an example made of (text, trained) pieces, each tokenized on its own (what
    the model sees at inference: the prompt, then what it generates); the whole text must tokenize the same."""
    tokens = [ids(tokenizer, text) for text, _ in pieces]
    assert sum(tokens, []) == ids(tokenizer, "".join(text for text, _ in pieces))
    return sum(tokens, []), [t if trained else IGNORE_INDEX for (_, trained), part in zip(pieces, tokens) for t in part]


@pytest.mark.parametrize("turn, generated", [(INLINE, f"{TRACE}\n</think>\n\n{ANSWER}"),
                                             (OPEN_TAG_LEFT_OUT, f"{TRACE}\n</think>\n\n{ANSWER}"),
                                             (FIELD, f"{TRACE}\n</think>\n\n{ANSWER}"),
                                             (NO_TRACE, f"\n</think>\n\n{ANSWER}")],
                         ids=["inline", "inline_without_open_tag", "reasoning_content", "no_trace"])
def test_a_turn_trains_its_trace_after_the_generation_prompt(tiny_model_dir, tmp_path, family, turn,
                                                             generated) -> None:
    """One turn, each trace convention and none: the example is the generation prompt (`<think>\\n` included) then
    the trace, `</think>`, the answer and the end of turn, trained; a row without a trace trains the empty block the
    model has to write to close the one its prompt opened (`\\n</think>\\n\\n`, DeepSeek's and Qwen's empty block).
    Counted per source (reasoning_opened_by_prompt), not as reasoning the template does not write."""
    tokenizer = family_tokenizer(tiny_model_dir, family)
    messages = [{"role": "user", "content": QUESTION}, turn]
    examples, (report,) = build(tokenizer, tmp_path, [messages])
    prompt = prompt_of(tokenizer, messages[:1])
    assert prompt.endswith(("<｜Assistant｜><think>\n", "<|im_start|>assistant\n<think>\n"))
    (example,) = examples
    pieces = [(prompt, False), (generated + END[family], True)] + ([("\n", False)] if family == "qwq" else [])
    assert (example.input_ids, example.labels) == expected(tokenizer, pieces)
    assert (report.reasoning_opened_by_prompt, report.reasoning_not_rendered) == (1, 0)


def test_a_multi_turn_row_trains_each_turn_after_the_history_the_template_writes(tiny_model_dir, tmp_path,
                                                                                 family) -> None:
    """Two turns: the template drops the first turn's trace once another turn follows, so the second turn's context
    is the conversation as the template writes it (the first answer without its trace), as the model sees it at
    inference; the first turn trains in an example of its own, after its own generation prompt. (Both trained in the
    one rendering, answers alone.)"""
    tokenizer = family_tokenizer(tiny_model_dir, family)
    second = {"role": "assistant", "content": "48.", "reasoning_content": "Six eights are forty-eight."}
    messages = [{"role": "user", "content": QUESTION}, INLINE, {"role": "user", "content": "And 6 times 8?"}, second]
    examples, (report,) = build(tokenizer, tmp_path, [messages])
    after = [("\n", False)] if family == "qwq" else []
    first = [(prompt_of(tokenizer, messages[:1]), False), (f"{TRACE}\n</think>\n\n{ANSWER}" + END[family], True)]
    then = [(prompt_of(tokenizer, messages[:3]), False), ("Six eights are forty-eight.\n</think>\n\n48." + END[family],
                                                          True)]
    assert ANSWER in then[0][0] and TRACE not in then[0][0]
    assert [(e.input_ids, e.labels) for e in examples] == [expected(tokenizer, first + after),
                                                           expected(tokenizer, then + after)]
    assert (report.rows_split, report.examples, report.reasoning_opened_by_prompt) == (1, 2, 1)


def test_what_is_trained_is_what_the_model_generates(tiny_model_dir, tmp_path, family) -> None:
    """Invariance: the trained tokens of a turn decode to a text that, generated after the generation prompt and
    kept as the turn's content (the prompt's opening, then the text, less the end of turn: what `open_sft chat`
    keeps), the template writes in history exactly as it writes the row's turn (a row whose content is the answer
    alone: up to the whitespace before it, which R1's template writes as the content has it); and reply parsing
    splits it into the row's trace and answer."""
    from open_sft.export.reply import parse_reply

    tokenizer = family_tokenizer(tiny_model_dir, family)
    follow = {"role": "user", "content": "Thanks."}
    for turn in (INLINE, OPEN_TAG_LEFT_OUT, FIELD, NO_TRACE):
        messages = [{"role": "user", "content": QUESTION}, turn, follow]
        (example, *_), _ = build(tokenizer, tmp_path, [messages], train_on="last_assistant")
        (run,) = trained_token_runs(example.input_ids, example.labels)
        prompt = prompt_of(tokenizer, messages[:1])
        first = next(k for k, label in enumerate(example.labels) if label != IGNORE_INDEX)
        assert example.input_ids[:first] == ids(tokenizer, prompt)
        generated = tokenizer.decode(run)
        assert generated.endswith(END[family])
        kept = {"role": "assistant", "content": "<think>\n" + generated[: -len(END[family])]}
        as_kept = tokenizer.apply_chat_template([messages[0], kept, follow], tokenize=False)
        as_row = tokenizer.apply_chat_template(messages, tokenize=False)
        if turn in (FIELD, NO_TRACE):  # the row's content has no separator before its answer
            as_kept, as_row = as_kept.replace(f"\n\n{ANSWER}", ANSWER), as_row.replace(f"\n\n{ANSWER}", ANSWER)
        assert as_kept == as_row, turn
        parts = parse_reply(tokenizer, run, ids(tokenizer, prompt))
        assert (parts.reasoning, parts.answer, parts.answered) == (TRACE if turn is not NO_TRACE else "", ANSWER,
                                                                   True)


def test_reasoning_loss_mask_keeps_the_trace_as_context(tiny_model_dir, tmp_path, family) -> None:
    """--reasoning_loss mask: the trace the turn now carries is context; `</think>`, the answer and the end train."""
    tokenizer = family_tokenizer(tiny_model_dir, family)
    (example,), _ = build(tokenizer, tmp_path, [[{"role": "user", "content": QUESTION}, INLINE]],
                          reasoning_loss="mask")
    runs = [tokenizer.decode(run) for run in trained_token_runs(example.input_ids, example.labels)]
    assert TRACE in tokenizer.decode(example.input_ids) and TRACE not in "".join(runs)
    assert "".join(runs).strip() == f"</think>\n\n{ANSWER}{END[family]}"


def test_a_template_that_writes_the_last_trace_is_left_as_it_was(tiny_model_dir, tmp_path) -> None:
    """A Qwen3 Thinking-2507 model's template (Qwen3's, with `<think>\\n` in the generation prompt) writes the last
    turn's trace and a no-trace turn's empty block itself: its turns train as it writes them, as before, which is
    what an R1 turn now trains (the same `\\n</think>\\n\\n` block)."""
    tokenizer = family_tokenizer(tiny_model_dir, "qwq")
    qwen3 = (TEMPLATES / "qwen3.jinja").read_text()
    tokenizer.chat_template = qwen3.replace("{{- '<|im_start|>assistant\\n' }}",
                                            "{{- '<|im_start|>assistant\\n<think>\\n' }}")
    assert tokenizer.chat_template != qwen3
    examples, (report,) = build(tokenizer, tmp_path, [[{"role": "user", "content": QUESTION}, t]
                                                      for t in (INLINE, FIELD, NO_TRACE)])
    runs = [tokenizer.decode(run) for e in examples for run in trained_token_runs(e.input_ids, e.labels)]
    assert runs == [f"{TRACE}\n</think>\n\n{ANSWER}<|im_end|>"] * 2 + [f"\n</think>\n\n{ANSWER}<|im_end|>"]
    assert report.reasoning_opened_by_prompt == 0


def test_deepseek_v3_1_in_thinking_mode_trains_its_trace_right_after_the_opened_tag(tiny_model_dir, tmp_path) -> None:
    """DeepSeek-V3.1's template (tests/data/chat_templates/deepseek_v3_1.jinja) opens `<think>`, no newline, in its
    thinking mode's generation prompt and writes a turn `</think>answer`: the turn trains the trace, `</think>` and
    the answer right after `<think>` (a row without a trace: `</think>` and the answer), no whitespace added, as its
    template writes the block. Without thinking its generation prompt closes the block (`</think>`) and the turns
    train their answer after it, as before."""
    tokenizer = family_tokenizer(tiny_model_dir, "r1")
    tokenizer.chat_template = (TEMPLATES / "deepseek_v3_1.jinja").read_text()
    inline = {"role": "assistant", "content": f"{TRACE}</think>{ANSWER}"}  # V3.1's own output's form
    rows = [[{"role": "user", "content": QUESTION}, turn] for turn in (inline, FIELD, NO_TRACE)]
    examples, (report,) = build(tokenizer, tmp_path, rows, chat_template_kwargs='{"thinking": true}')
    prompt = tokenizer.apply_chat_template(rows[0][:1], add_generation_prompt=True, tokenize=False, thinking=True)
    assert prompt.endswith("<｜Assistant｜><think>")
    generated = [f"{TRACE}</think>{ANSWER}"] * 2 + [f"</think>{ANSWER}"]
    assert [(e.input_ids, e.labels) for e in examples] == [
        expected(tokenizer, [(prompt, False), (text + END["r1"], True)]) for text in generated]
    assert (report.reasoning_opened_by_prompt, report.reasoning_not_rendered) == (3, 0)
    examples, (report,) = build(tokenizer, tmp_path, rows)
    assert [tokenizer.decode(run) for e in examples for run in trained_token_runs(e.input_ids, e.labels)] == [
        ANSWER + END["r1"]] * 3
    assert report.reasoning_opened_by_prompt == 0


def test_a_trace_that_recurs_in_the_answer_still_trains(tiny_model_dir, tmp_path, family) -> None:
    """A short trace that the answer repeats ("42", then "The answer is 42."): the turn trains the trace, the
    closer and the answer after the opened block as any other (it fell back to the answer alone, uncounted, because
    the trace was looked for in the whole of what the template writes for the turn, the answer included)."""
    tokenizer = family_tokenizer(tiny_model_dir, family)
    answer = "The answer is 42."
    turns = ({"role": "assistant", "content": answer, "reasoning_content": "42"},
             {"role": "assistant", "content": f"<think>\n42\n</think>\n\n{answer}"})
    examples, (report,) = build(tokenizer, tmp_path, [[{"role": "user", "content": QUESTION}, t] for t in turns])
    runs = [tokenizer.decode(run) for e in examples for run in trained_token_runs(e.input_ids, e.labels)]
    assert [run.strip() for run in runs] == [f"42\n</think>\n\n{answer}{END[family]}"] * 2
    assert report.reasoning_opened_by_prompt == 2
