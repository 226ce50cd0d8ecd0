"""`open_sft compare`: exact-match scoring of two models on the same tasks, the table and the JSON it writes."""

from __future__ import annotations

import json

import pytest

from open_sft.__main__ import main as open_sft_main
from open_sft.embedded.demo_tasks import DEMO_HELD_OUT
from open_sft.export import compare
from open_sft.export.compare import TaskScore, exact_match, format_table, read_tasks, score_tasks
from open_sft.export.generate import END_OF_TURN, Generation

ROWS = [{"id": f"t{i}", "task": "pet", "answer": answer,
         "messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]}
        for i, (prompt, answer) in enumerate([("Ann has a cat. Which animal does Ann have?", "cat"),
                                              ("Translate to French: red dog", "chien rouge"),
                                              ("Tom lives in Oslo. Where does Tom live?", "Oslo")])]


@pytest.mark.parametrize("expected, generated, hit", [
    ("chien rouge", "chien rouge", True), ("chien rouge", "  chien \n rouge ", True),
    ("chien rouge", "Chien rouge", False), ("Oslo", "Oslo.", False), ("Oslo", "Oslo Oslo", False),
    ("Oslo", "", False), ("cat", "cats", False)])
def test_exact_match_counts_case_punctuation_and_words(expected, generated, hit) -> None:
    assert exact_match(expected, generated) is hit


def test_score_tasks_asks_each_prompt_without_its_answer(monkeypatch) -> None:
    seen = []

    def fake_generate(model, tokenizer, messages, max_new_tokens, raw=False, tools=None):
        seen.append((messages, max_new_tokens))
        return Generation({"Ann": "cat", "Tra": "chien rouge.", "Tom": "Oslo"}[messages[-1]["content"][:3]],
                          END_OF_TURN, 5, 2)

    monkeypatch.setattr("open_sft.export.generate.generate_reply", fake_generate)
    score = score_tasks(None, None, ROWS, max_new_tokens=5)
    assert score.answers == ["cat", "chien rouge.", "Oslo"] and score.correct == [True, False, True]
    assert (score.hits, round(score.accuracy, 4)) == (2, 0.6667)
    assert seen[0] == ([{"role": "user", "content": ROWS[0]["messages"][0]["content"]}], 5)
    assert TaskScore([], []).accuracy == 0.0


def test_table_marks_each_answer_and_cuts_long_ones() -> None:
    before = TaskScore(["okyo " * 20, "", "Oslo"], [False, False, True])
    after = TaskScore(["cat", "chien rouge", "Oslo"], [True, True, True])
    lines = format_table(ROWS, before, after, show=2).splitlines()
    assert len(lines) == 3 and lines[0].startswith("held-out task (never in training)")
    assert "✗ okyo okyo okyo okyo okyo …" in lines[1] and "✓ cat" in lines[1] and lines[1].endswith("cat")
    assert "✗ (nothing)" in lines[2] and "✓ chien rouge" in lines[2]
    assert compare.accuracy_line(before, after) == (
        "exact-answer accuracy on 3 held-out tasks: before 0.33 (1/3) -> after 1.00 (3/3)")


def test_a_multi_line_expected_answer_keeps_the_table_one_line_per_task() -> None:
    rows = [dict(ROWS[0], answer="def f():\n    return 1\n" + "x = 2\n" * 30)]
    lines = format_table(rows, TaskScore(["no"], [False]), TaskScore(["def f():"], [False]), show=1).splitlines()
    assert len(lines) == 2 and lines[1].endswith("def f(): return 1 x = 2 x = 2 x = 2 x = 2 x = 2 x = 2 x = 2…")


def test_a_file_that_is_not_tasks_is_named_with_its_line(tmp_path) -> None:
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n" + json.dumps({"messages": ROWS[0]["messages"]}) + "\n")
    with pytest.raises(ValueError, match=r"tasks.jsonl line 3: a task needs 'messages' ending with"):
        read_tasks(path)
    path.write_text("\n")
    with pytest.raises(ValueError, match="holds no tasks"):
        read_tasks(path)
    assert len(read_tasks(DEMO_HELD_OUT)) == 40


def test_compare_command_scores_both_models_and_writes_every_answer(tiny_model_dir, tmp_path, capsys) -> None:
    """Two random models: nothing right, every answer recorded; the command is `open_sft compare`."""
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    out = tmp_path / "scores.json"
    assert open_sft_main(["compare", str(tiny_model_dir), str(tiny_model_dir), "--tasks", str(tasks),
                          "--max_new_tokens", "3", "--json", str(out), "--show", "1"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 3 and printed[-1] == (
        "exact-answer accuracy on 3 held-out tasks: before 0.00 (0/3) -> after 0.00 (0/3)")
    scores = json.loads(out.read_text())
    assert scores["tasks"] == 3 and scores["before"]["accuracy"] == scores["after"]["accuracy"] == 0.0
    assert [r["expected"] for r in scores["rows"]] == ["cat", "chien rouge", "Oslo"]
    assert [r["before"] for r in scores["rows"]] == [r["after"] for r in scores["rows"]]  # greedy: same model


def test_compare_command_errors(tiny_model_dir, tmp_path, capsys) -> None:
    assert compare.main([str(tmp_path / "nope"), str(tiny_model_dir), "--tasks", str(DEMO_HELD_OUT)]) == 2
    assert "nope does not exist" in capsys.readouterr().err
    assert compare.main([str(tiny_model_dir), str(tiny_model_dir), "--tasks", str(tmp_path / "x.jsonl")]) == 2
    assert f"error: --tasks {tmp_path / 'x.jsonl'}: No such file or directory; give a JSON-lines file of held-out " \
           "tasks" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text(json.dumps(ROWS[0]) + "\n{not json\n")
    assert compare.main([str(tiny_model_dir), str(tiny_model_dir), "--tasks", str(tmp_path / "bad.jsonl")]) == 2
    assert f"error: --tasks {tmp_path / 'bad.jsonl'} line 2: not JSON (" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        compare.main([str(tiny_model_dir), str(tiny_model_dir), "--tasks", str(DEMO_HELD_OUT),
                      "--max_new_tokens", "0"])
    assert "--max_new_tokens must be at least 1" in capsys.readouterr().err



def test_a_model_without_a_chat_template_is_asked_with_the_others_or_plain_text(tiny_model_dir, tmp_path,
                                                                                  capsys) -> None:
    """A base model without a template (the fine-tune's came from --chat_template_name) answers the same prompts
    as the model that has one, through that template: the same weights then give the same answers. Where neither
    has one, each prompt is continued as plain text, as `generate --raw` would. Both are said on stderr."""
    import shutil

    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir, base)
    (base / "chat_template.jinja").unlink()
    config = json.loads((base / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    out = tmp_path / "scores.json"
    assert open_sft_main(["compare", str(base), str(tiny_model_dir), "--tasks", str(tasks),
                          "--max_new_tokens", "3", "--json", str(out)]) == 0
    assert f"{base}: its tokenizer has no chat template: it is asked with {tiny_model_dir}'s" in capsys.readouterr().err
    rows = json.loads(out.read_text())["rows"]
    assert [r["before"] for r in rows] == [r["after"] for r in rows]
    assert open_sft_main(["compare", str(base), str(base), "--tasks", str(tasks), "--max_new_tokens", "3",
                          "--json", str(out)]) == 0
    assert "neither model has a chat template: each task's prompt is continued as plain text" in capsys.readouterr().err
    assert len(json.loads(out.read_text())["rows"]) == 3
