"""The literal text of a special token in the data (special_tokens_in_text): the report and the warning name each
token with the rows holding it, in both builds; tokens the user added with --add_special_tokens / --add_tokens are
written in the data on purpose and are not counted (they still train as one token)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from open_sft.config.args import DataArguments
from open_sft.data.build import build_examples
from open_sft.data.cache_inputs import key_inputs
from open_sft.data.summary import format_data_report
from open_sft.model.added_tokens import add_tokens
from tests.unit.data.test_reasoning_tool_calls import build, family_tokenizer, trained_runs
from tests.unit.data.test_stream import in_memory, small_chunks, streamed  # noqa: F401 (small_chunks: a fixture)

WARNING = "literal text of a special token"


@pytest.fixture
def qwen3_with_tool_token(tiny_model_dir, tmp_path):
    """Qwen3's template and special tokens, plus `<tool_x>` added by --add_special_tokens FILE."""
    tokenizer = family_tokenizer(tiny_model_dir, "qwen3")
    listed = tmp_path / "tokens.txt"
    listed.write_text("<tool_x>\n<|im_end|>\n")  # the tokenizer's own <|im_end|> stays a special token's text
    add_tokens(tokenizer, str(listed), special=True, flag="--add_special_tokens")
    return tokenizer


def row(user: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}


def write(tmp_path, rows: list[dict]) -> DataArguments:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return DataArguments(dataset_mixer_list=[str(path), "1.0"], max_seq_length=256)


def test_a_token_the_user_added_is_not_special_text_and_trains_as_one_token(qwen3_with_tool_token, tmp_path,
                                                                             caplog) -> None:
    """Rows calling the user's `<tool_x>` are not warned about (they were the reason to add it); the token is one
    id, trained in the answer; a stray `<|im_end|>` in another answer is still counted and named."""
    tokenizer = qwen3_with_tool_token
    assert tokenizer.open_sft_user_tokens == ("<tool_x>",)
    rows = [row("Weather?", "<tool_x>oslo</tool_x>"), row("Again?", "Sure <tool_x>bergen"), row("Hi", "Hello")]
    with caplog.at_level("WARNING"):
        (example, *_), (report,) = build_examples(write(tmp_path, rows), tokenizer, 0)
    assert report.special_tokens_in_text == 0 and report.to_dict()["special_tokens_in_text_by_token"] == {}
    assert not [r for r in caplog.records if WARNING in r.getMessage()]
    tool_x = tokenizer.convert_tokens_to_ids("<tool_x>")
    ids, labels = np.asarray(example.input_ids), np.asarray(example.labels)
    assert tool_x >= 1024 and (ids == tool_x).sum() == 1 and labels[ids == tool_x].tolist() == [tool_x]
    assert tokenizer.decode(ids[ids == tool_x]) == "<tool_x>"

    caplog.clear()
    with caplog.at_level("WARNING"):
        _, (report,) = build_examples(write(tmp_path, [*rows, row("Hi", "Done<|im_end|> really")]), tokenizer, 0)
    assert report.to_dict()["special_tokens_in_text"] == 1
    assert report.to_dict()["special_tokens_in_text_by_token"] == {"<|im_end|>": 1}
    warned = [r.getMessage() for r in caplog.records if WARNING in r.getMessage()]
    assert len(warned) == 1 and "(<|im_end|> in 1 row)" in warned[0] and "line 4" in warned[0]


def test_the_warning_names_each_token_with_its_rows_in_both_builds(qwen3_with_tool_token, tmp_path, small_chunks,
                                                                    caplog) -> None:
    """Scraped answers with stray `<|im_end|>` (12 rows) and `<|endoftext|>` (3, one with both) among rows using the
    user's token: each token with its rows in data_report.json, the warning and the printed report, the streaming
    build's (several chunks) the same as the in-memory one's."""
    tokenizer = qwen3_with_tool_token
    rows = [row(f"Question {k}?", f"Answer {k} <tool_x>") for k in range(40)]
    for k in range(12):
        rows[3 * k] = row(f"Question {k}?", f"Answer {k}<|im_end|> more")
    for k in (1, 4, 6):
        rows[k] = row(f"What is <|endoftext|> {k}?", rows[k]["messages"][1]["content"])
    args = write(tmp_path, rows)
    with caplog.at_level("WARNING"):
        built = streamed(args, tokenizer, tmp_path)
    source = built[2][0]
    assert source["special_tokens_in_text"] == 14
    assert source["special_tokens_in_text_by_token"] == {"<|im_end|>": 12, "<|endoftext|>": 3}
    warned = [r.getMessage() for r in caplog.records if WARNING in r.getMessage()]
    assert len(warned) == 1 and "14 row(s)" in warned[0] and "(<|im_end|> in 12 rows, <|endoftext|> in 3 rows)" in \
        warned[0]
    memory = in_memory(args, tokenizer)
    assert memory[2] == built[2]
    assert all(np.array_equal(a, b) for a, b in zip(memory[0], built[0])) and len(memory[0]) == len(built[0]) == 40
    table = format_data_report({"sources": [source], "examples": 40, "tokens": source["tokens"],
                                "trained_tokens": source["trained_tokens"]})
    assert "special_tokens_in_text: 14 row(s) (<|im_end|> in 12 rows, <|endoftext|> in 3 rows)" in table


def test_the_users_tokens_enter_the_cache_key(qwen3_with_tool_token, tiny_model_dir, tmp_path) -> None:
    """The same vocabulary with and without the file's tokens declared (a tokenizer saved by an earlier run that
    added them) counts other rows: another cache entry."""
    args = write(tmp_path, [row("Hi", "Hello")])
    declared = key_inputs(args, qwen3_with_tool_token, 0)
    assert declared["user_tokens"] == ["<tool_x>"]
    del qwen3_with_tool_token.open_sft_user_tokens
    assert "user_tokens" not in key_inputs(args, qwen3_with_tool_token, 0)


def test_magistral_trace_blocks_written_in_the_content_are_not_special_text(tiny_model_dir, tmp_path) -> None:
    """Magistral's (and Ministral-3-Reasoning's) template writes a trace `[THINK]trace[/THINK]answer`, special tokens
    both; a row storing its turn in that form trained right but was counted and warned about as holding the text of
    [THINK] and [/THINK] (a fake control token). Those two, where the template writes them (opening the content, and
    the first [/THINK] after), are the template's own now; anywhere else they are still counted."""
    from tests.unit.data.test_call_closers import template_tokenizer
    from tests.unit.data.test_more_families import MINISTRAL_SPECIALS
    from tests.unit.data.test_reasoning_tool_calls import build, trained_runs

    tokenizer = template_tokenizer(tiny_model_dir, "ministral_3_reasoning.jinja", MINISTRAL_SPECIALS, "</s>", "<s>")
    inline = row("What is 6 times 7?", "[THINK]Six sevens.[/THINK]42.")
    examples, (report,) = build(tokenizer, tmp_path, [inline])
    assert report.special_tokens_in_text == 0 and report.rows_kept == 1
    assert [run for _, run in trained_runs(tokenizer, examples)] == ["[THINK]Six sevens.[/THINK]42.</s>"]
    stray = [row("Say [/THINK] please.", "[THINK]Asked.[/THINK]Done."), row("Hi", "Hello [THINK]there"),
             row("Hi", "[THINK]One.[/THINK]Two.[/THINK]")]
    _, (report,) = build(tokenizer, tmp_path, [inline, *stray])
    assert report.special_tokens_in_text == 3
    assert dict(report.special_tokens_in_text_by_token) == {"[/THINK]": 2, "[THINK]": 1}
    # a trace given apart too: the template writes its block, and the content's is a second one, trained as text
    both = row("What is 6 times 7?", "[THINK]Six sevens.[/THINK]42.")
    both["messages"][-1]["reasoning_content"] = "Multiply."
    examples, (report,) = build(tokenizer, tmp_path, [both])
    assert [run for _, run in trained_runs(tokenizer, examples)] == [
        "[THINK]Multiply.[/THINK][THINK]Six sevens.[/THINK]42.</s>"]
    assert dict(report.special_tokens_in_text_by_token) == {"[/THINK]": 1, "[THINK]": 1}


def test_gpt_oss_channel_tokens_in_a_content_are_special_text_glms_own_think_block_is_not(tiny_model_dir,
                                                                                         tmp_path) -> None:
    """gpt-oss's template writes a trace between `<|message|>` and `<|end|>`, special tokens both, so the probe took
    them for its trace block: a content `<|message|>x<|end|>y`, which the template writes inside its final channel (a
    fake end of turn the model trains on), went uncounted. The block is the template's own only where it renders the
    inline form as it renders the trace given apart: GLM-4.5's does (it reads the trace out of the content), gpt-oss's
    does not."""
    fake = row("Hi", "<|message|>x<|end|>y")
    gpt_oss = family_tokenizer(tiny_model_dir, "gpt_oss")
    examples, (report,) = build(gpt_oss, tmp_path, [fake, row("Hi", "Hello")])
    assert report.rows_kept == 2 and report.special_tokens_in_text == 1
    assert dict(report.special_tokens_in_text_by_token) == {"<|end|>": 1, "<|message|>": 1}
    assert trained_runs(gpt_oss, examples)[0][1] == "<|channel|>final<|message|><|message|>x<|end|>y<|return|>"

    glm = family_tokenizer(tiny_model_dir, "glm")
    examples, (report,) = build(glm, tmp_path, [row("Hi", "<think>x</think>y"), row("Hi", "Hello </think>")])
    assert report.special_tokens_in_text == 1 and dict(report.special_tokens_in_text_by_token) == {"</think>": 1}
    assert trained_runs(glm, examples)[0][1] == "\n<think>x</think>\ny<|user|>"  # GLM ends a turn at the next header
