"""The data report says each source's share of the mixture, and amounts that look like shares (0.7 and 0.3) get
one line saying what they mean: `alpaca.json 0.7 sample.jsonl 0.3` gave 699 and 600 rows, ~95/5 by tokens, silently."""

from __future__ import annotations

from open_sft.config.args import DataArguments
from open_sft.data.summary import format_data_report, shares_note


def source(name: str, examples: int, tokens: int) -> dict:
    return {"name": name, "format": "messages", "rows_in": examples, "rows_kept": examples, "rows_dropped": {},
            "truncated": 0, "examples": examples, "tokens": tokens, "trained_tokens": tokens // 2}


REPORT = {"sources": [source("alpaca.json", 699, 190_000), source("sample.jsonl", 600, 10_000)], "examples": 1299,
          "tokens": 200_000, "trained_tokens": 100_000}


def test_each_source_says_its_share_of_the_mixtures_examples_and_tokens() -> None:
    lines = format_data_report(REPORT).splitlines()
    assert lines[1].split()[-5:] == ["trained", "%", "ex", "%", "tok"]
    assert lines[3].split()[-2:] == ["53.8%", "95.0%"] and lines[4].split()[-2:] == ["46.2%", "5.0%"]
    assert lines[-1].split()[-2:] == ["100.0%", "100.0%"]


def test_fractions_that_look_like_shares_are_explained() -> None:
    def note(*mixer: str):
        return shares_note(REPORT, DataArguments(dataset_mixer_list=list(mixer)))

    said = note("alpaca.json", "0.7", "sample.jsonl", "0.3")
    assert said.startswith("--dataset_mixer_list amounts 0.7 and 0.3 are fractions of each source's rows")
    assert "alpaca.json 699 examples (54% of them, 95% of the tokens)" in said
    assert "For shares of the mixture's examples, give --dataset_mixer_unit share" in said
    assert "count of tokens with --dataset_mixer_unit tokens" in said
    assert shares_note(REPORT, DataArguments(dataset_mixer_list=["alpaca.json", "0.7", "sample.jsonl", "0.3"],
                                             dataset_mixer_unit="share")) is None  # they are the shares asked for
    assert note("alpaca.json", "700", "sample.jsonl", "300") is None  # row counts: the shares asked for
    assert note("alpaca.json", "1.0") is None and note("alpaca.json", "0.5", "sample.jsonl", "1.0") is None


def test_a_long_format_name_keeps_the_columns_aligned() -> None:
    """GSM8K's and LMSYS's format names (question_answer, messages:conversation) overran the 9-character format
    column: every number after them stood one to twelve characters right of its heading."""
    report = {**REPORT, "sources": [source("gsm8k.jsonl", 699, 190_000), source("lmsys.jsonl", 600, 10_000),
                                    source("chat.jsonl", 1, 10)]}
    report["sources"][0]["format"], report["sources"][1]["format"] = "question_answer", "messages:conversation"
    lines = format_data_report(report).splitlines()
    heading = lines[1]
    rows_in_ends = heading.index("rows in") + len("rows in")
    for line, format_, rows in ((lines[3], "question_answer", "699"), (lines[4], "messages:conversation", "600"),
                                (lines[5], "messages", "1")):
        assert line.split()[1:3] == [format_, rows]
        assert line.index(f" {rows} ") + 1 + len(rows) == rows_in_ends  # the count under its heading
        assert len(line) == len(heading)  # and so every column after it
    assert len(lines[2]) == len(lines[-1]) == len(heading)


def test_cache_dataset_only_says_the_notes_too(capsys, caplog) -> None:
    """`scripts/prepare_data.sh ... --dataset_mixer_list a 0.7 b 0.3` (--cache_dataset_only, the README's way to build a
    large corpus ahead) printed the data report without the note on amounts that look like shares, which only the
    training run then said; the notes are logged either way, the table printed where the caller asks for it."""
    import logging
    from types import SimpleNamespace

    from open_sft.data.summary import report_data

    args = DataArguments(dataset_mixer_list=["alpaca.json", "0.7", "sample.jsonl", "0.3"])
    data = SimpleNamespace(report=REPORT)
    with caplog.at_level(logging.WARNING, logger="open_sft.data.summary"):
        report_data(data, None, args, tokenizer=None, table=False)
    assert capsys.readouterr().out == ""  # --cache_dataset_only prints the table itself, the cache path last
    assert [r.getMessage() for r in caplog.records] == [shares_note(REPORT, args)]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="open_sft.data.summary"):
        report_data(data, None, args, tokenizer=None)
    assert capsys.readouterr().out == format_data_report(REPORT) + "\n"
    assert [r.getMessage() for r in caplog.records] == [shares_note(REPORT, args)]
