"""The streaming build gives the in-memory build's examples bit for bit, and its reports.

open_sft.data.in_memory.build_rows (every source read whole) is the reference; open_sft.data.build streams the same
sources a few rows at a time (chunks of 7 rows, blocks of 300 bytes, pieces of 400 tokens, shards of 2 kB), so every step meets chunk
boundaries: selection (fractions, counts, upsampling above 1.0, --dataset_mixer_unit tokens, --eval_split_ratio),
bad rows under --on_bad_row drop, truncation, and documents spliced into blocks across chunks."""

from __future__ import annotations

import json
import logging
import random
import re

import datasets
import numpy as np
import pytest
from transformers import AutoTokenizer

from conftest import SAMPLE
from open_sft.config.args import DataArguments
from open_sft.data import chunks, local_files, spill, stream
from open_sft.data.build import build_sources
from open_sft.data.in_memory import build_rows, mixture_specs
from open_sft.errors import UserError

LINES = SAMPLE.read_text().splitlines()[:120]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("corpora")
    rows = [json.loads(line) for line in LINES]
    rng = random.Random(0)
    texts = [{"text": " ".join(m["content"] for m in row["messages"]) * rng.randint(1, 4)} for row in rows]
    files = {"chat": root / "chat.jsonl", "text": root / "text.jsonl", "bad": root / "bad.jsonl",
             "crlf": root / "crlf.jsonl", "bad_text": root / "bad_text.jsonl", "render": root / "render.jsonl"}
    files["chat"].write_text("\n".join(LINES) + "\n")
    files["text"].write_text("\n".join(json.dumps(t) for t in texts))  # no newline at the end
    bad = list(LINES)
    bad[3], bad[17] = "{not json", json.dumps({"messages": "not a list"})
    bad[40] = json.dumps({"messages": [{"role": "user", "content": "no answer"}]})
    for at in (25, 60, 61, 90, 115):  # the tiny template does not write tool calls: a row that fails to render
        bad[at] = json.dumps({"messages": [{"role": "user", "content": "Weather in Oslo?"}, {
            "role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": {"city": "Oslo"}}}]}]})
    files["bad"].write_text("\n".join(bad[:10]) + "\n\n  \n" + "\n".join(bad[10:]) + "\n")
    files["crlf"].write_text("\r\n".join(LINES[:50]) + "\r\n")
    # JSON Lines in files named .json, as datasets.load_dataset("json") reads them (many datasets ship so)
    files["chat_json"], files["bad_json"] = root / "chat.json", root / "bad.json"
    files["chat_json"].write_text(files["chat"].read_text())
    files["bad_json"].write_text(files["bad"].read_text())
    files["render"].write_text("\n".join(line for k, line in enumerate(bad) if k not in (3, 17, 40)) + "\n")
    bad_text = [json.dumps(t) for t in texts[:60]]
    bad_text[5], bad_text[22] = "{oops", json.dumps({"text": "   "})
    files["bad_text"].write_text("\n".join(bad_text) + "\n")
    # a .txt file's documents are its blocks of non-blank lines: the same documents as text rows, blocks between
    # blank lines and lines of spaces, the file begun with blank lines and ended without a newline
    documents = ["\n".join(line for line in t["text"].split("\n") if line.strip()) for t in texts]
    documents = [d.replace(". ", ".\n", k % 3) for k, d in enumerate(documents)]  # documents of several lines
    files["txt"] = root / "corpus.txt"
    files["txt"].write_text("\n\n" + "".join(d + ("\n\n" if k % 4 else "\n  \n\n") for k, d in enumerate(documents))
                            .rstrip("\n"))
    files["txt_as_jsonl"] = root / "corpus.jsonl"
    files["txt_as_jsonl"].write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    datasets.Dataset.from_list(rows).to_parquet(str(root / "chat.parquet"))
    datasets.Dataset.from_list(texts).to_parquet(str(root / "text.parquet"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:70])}).save_to_disk(str(root / "saved"))
    return {**{k: str(v) for k, v in files.items()}, "chat_parquet": str(root / "chat.parquet"),
            "text_parquet": str(root / "text.parquet"), "saved": str(root / "saved")}


CASES = {
    "fraction": (["chat", "0.5"], {}),
    "all": (["chat", "1.0"], {}),
    "upsampled": (["chat", "2.5"], {}),
    "count_above_size": (["chat", "300"], {}),
    "tokens_fraction": (["chat", "0.3"], {"dataset_mixer_unit": "tokens"}),
    "tokens_count": (["chat", "4000"], {"dataset_mixer_unit": "tokens"}),
    "tokens_truncated": (["chat", "3000"], {"dataset_mixer_unit": "tokens", "max_seq_length": 40}),
    "tokens_long_dropped": (["chat", "2000"], {"dataset_mixer_unit": "tokens", "max_seq_length": 40,
                                                "truncation": "drop"}),
    "truncate": (["chat", "1.0"], {"max_seq_length": 40}),
    "drop_long": (["chat", "1.0"], {"max_seq_length": 40, "truncation": "drop"}),
    "last_assistant": (["chat", "0.7"], {"train_on": "last_assistant"}),
    "bad_rows_dropped": (["bad", "0.6"], {"on_bad_row": "drop"}),
    "bad_rows_dropped_by_tokens": (["bad", "0.6"], {"on_bad_row": "drop", "dataset_mixer_unit": "tokens"}),
    "render_errors_dropped": (["render", "0.4"], {"on_bad_row": "drop"}),
    "crlf": (["crlf", "1.0"], {}),
    "json_lines_named_json": (["chat_json", "0.5"], {}),
    "json_lines_named_json_bad_rows_dropped": (["bad_json", "0.6"], {"on_bad_row": "drop"}),
    "text_blocks": (["text", "1.0"], {"max_seq_length": 50}),
    "text_upsampled": (["text", "1.5"], {"max_seq_length": 64}),
    "text_tokens": (["text", "2000"], {"max_seq_length": 50, "dataset_mixer_unit": "tokens"}),
    "text_bad_rows_dropped": (["bad_text", "1.0"], {"max_seq_length": 50, "on_bad_row": "drop"}),
    "txt_blocks": (["txt", "1.0"], {"max_seq_length": 50}),
    "txt_upsampled": (["txt", "1.5"], {"max_seq_length": 64}),
    "txt_tokens": (["txt", "2000"], {"max_seq_length": 50, "dataset_mixer_unit": "tokens"}),
    "txt_as_jsonl": (["txt_as_jsonl", "1.0"], {"max_seq_length": 50}),
    "parquet_chat": (["chat_parquet", "0.5"], {}),
    "parquet_text": (["text_parquet", "1.0"], {"max_seq_length": 50}),
    "saved_to_disk": (["saved", "40"], {}),
    "mixture": (["chat", "0.5", "text", "1.0", "chat_parquet", "20"], {"max_seq_length": 64}),
    "share": (["chat", "0.25", "saved", "0.75"], {"dataset_mixer_unit": "share"}),
    "share_bad_rows_dropped": (["bad", "3", "crlf", "1"], {"dataset_mixer_unit": "share", "on_bad_row": "drop"}),
    "share_text": (["text", "0.6", "bad_text", "0.4"], {"dataset_mixer_unit": "share", "on_bad_row": "drop",
                                                        "max_seq_length": 50}),
}


def args_for(corpora, case: str, **more) -> DataArguments:
    mixer, extra = CASES[case]
    mixer = [corpora[item] if i % 2 == 0 else item for i, item in enumerate(mixer)]
    return DataArguments(dataset_mixer_list=mixer, **{"max_seq_length": 256, **extra, **more})


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(chunks, "CHUNK_ROWS", 7)
    monkeypatch.setattr(spill, "PIECE_TOKENS", 400)
    monkeypatch.setattr(local_files, "READ_BYTES", 300)
    monkeypatch.setattr(spill, "SHARD_BYTES", 2000)  # several Arrow shards, as save_to_disk splits big datasets
    monkeypatch.setattr(spill, "BATCH_TOKENS", 900)  # several record batches in each
    monkeypatch.setattr(stream, "TEXT_BATCH_ROWS", 3)  # documents tokenized a few at a time within a chunk
    monkeypatch.setattr(stream, "TEXT_BATCH_CHARS", 1500)


def streamed(args, tokenizer, tmp_path, holdout=None):
    writer, reports = build_sources(args, tokenizer, 3, holdout, tmp_path / "data", tmp_path / "spill")
    writer.finish("")
    table = datasets.load_from_disk(str(tmp_path / "data")).data.table
    return [np.asarray(x, dtype=np.int32) for x in table["input_ids"].to_pylist()], \
        [np.asarray(x, dtype=np.int32) for x in table["labels"].to_pylist()], [r.to_dict() for r in reports]


def in_memory(args, tokenizer, holdout=None):
    rows, reports = build_rows(args, tokenizer, 3, holdout)
    ids = [rows.ids[rows.bounds[r]: rows.bounds[r + 1]] for r in range(len(rows))]
    labels = [rows.labels[rows.bounds[r]: rows.bounds[r + 1]] for r in range(len(rows))]
    return ids, labels, [r.to_dict() for r in reports]


def test_the_cases_meet_what_they_are_named_for(corpora, tokenizer) -> None:
    """Bad rows of each kind are dropped where a case says so; the render errors counted are the selected rows'."""
    reports = {case: in_memory(args_for(corpora, case), tokenizer)[2][0]["rows_dropped"]
               for case in ("bad_rows_dropped", "render_errors_dropped", "text_bad_rows_dropped")}
    assert reports["bad_rows_dropped"]["invalid_json"] == 1 and reports["bad_rows_dropped"]["tool_calls_not_rendered"]
    # the render file's tool-call rows (the bad file's 25, 60, 61, 90, 115 less the three lines it leaves out) that
    # the seeded 40 % sample takes: which they are follows the file's content (the mixer seeds a local source with
    # it), so the count is computed, not assumed
    from open_sft.data.mixer import select_indices

    spec, = mixture_specs(DataArguments(dataset_mixer_list=[corpora["render"], "0.4"], dataset_skip_cache=True))
    taken = set(select_indices(spec, len(LINES) - 3, 3)) & {23, 57, 58, 87, 112}
    assert reports["render_errors_dropped"].get("tool_calls_not_rendered", 0) == len(taken)
    assert reports["text_bad_rows_dropped"] == {"invalid_json": 1, "empty_text": 1}
    # --dataset_mixer_unit share: round(share × N) rows of each, N = min(usable rows / share): chat 120 and saved 70
    # rows, N = 93.3; the bad file's 117 rows that parse and convert (its 5 that fail to render are selected, then
    # dropped) and crlf's 50, N = 156; text's 120 and bad_text's 58, N = 145
    selected = {case: [r["rows_selected"] for r in in_memory(args_for(corpora, case), tokenizer)[2]]
                for case in ("share", "share_bad_rows_dropped", "share_text")}
    assert selected == {"share": [23, 70], "share_bad_rows_dropped": [117 - 5, 39], "share_text": [87, 58]}


def assert_same(a, b) -> None:
    assert len(a[0]) == len(b[0]) > 0
    for x, y in zip(a[0] + a[1], b[0] + b[1]):
        assert np.array_equal(x, y)
    assert a[2] == b[2]


@pytest.mark.parametrize("case", sorted(CASES))
def test_streaming_equals_the_in_memory_build(case, corpora, tokenizer, tmp_path, small_chunks) -> None:
    args = args_for(corpora, case)
    assert_same(streamed(args, tokenizer, tmp_path), in_memory(args, tokenizer))


@pytest.mark.parametrize("case, same_as", [("json_lines_named_json", "fraction"),
                                           ("json_lines_named_json_bad_rows_dropped", "bad_rows_dropped")])
def test_json_lines_in_a_json_file_are_read_as_the_jsonl_file(case, same_as, corpora, tokenizer) -> None:
    """A .json file holding JSON Lines gives what the same lines in a .jsonl file give (its report but for the
    name): the rows, the seeded selection, the bad lines dropped and counted."""
    named, jsonl = in_memory(args_for(corpora, case), tokenizer), in_memory(args_for(corpora, same_as), tokenizer)
    assert_same(named[:2] + ([{**r, "name": "x"} for r in named[2]],),
                jsonl[:2] + ([{**r, "name": "x"} for r in jsonl[2]],))


def test_a_txt_file_is_its_documents_as_text_rows(corpora, tokenizer, tmp_path, small_chunks) -> None:
    """A .txt file's blocks between blank lines are the documents of the equivalent {"text": ...} rows: the same
    examples, streamed (its blocks read 300 bytes at a time, 7 documents a chunk) or read whole."""
    txt, jsonl = in_memory(args_for(corpora, "txt_blocks"), tokenizer), in_memory(args_for(corpora, "txt_as_jsonl"),
                                                                                 tokenizer)
    assert_same(txt[:2] + ([{**r, "name": "corpus"} for r in txt[2]],), jsonl[:2] + (
        [{**r, "name": "corpus"} for r in jsonl[2]],))
    assert txt[2][0]["format"] == "text" and txt[2][0]["rows_in"] == len(LINES)
    assert_same(streamed(args_for(corpora, "txt_blocks"), tokenizer, tmp_path), txt)


def test_text_blocks_splits_at_blank_lines(tmp_path, monkeypatch) -> None:
    path = tmp_path / "docs.txt"
    path.write_bytes(b"\n \nfirst line\r\n  indented second\r\n\r\n\n\t\nnext doc\n\nlast\n  ")
    whole = list(local_files.text_blocks(path))
    assert whole == [(["first line\n  indented second", "next doc", "last"], [3, 8, 10])]
    monkeypatch.setattr(local_files, "READ_BYTES", 5)  # blocks, and \r\n pairs, across reads
    assert list(local_files.text_blocks(path, rows=2)) == [(["first line\n  indented second", "next doc"], [3, 8]),
                                                       (["last"], [10])]


def test_a_txt_file_without_text_and_an_unknown_suffix_say_what_is_read(tmp_path, tokenizer) -> None:
    (tmp_path / "blank.txt").write_text("\n  \n\n")
    with pytest.raises(UserError, match=r"blank\.txt: the file has no rows \(a \.txt file's documents are its "
                                        r"blocks of non-blank lines\)"):
        build_sources(DataArguments(dataset_mixer_list=[str(tmp_path / "blank.txt"), "1.0"]), tokenizer, 3, None,
                      tmp_path / "data", tmp_path / "spill")
    (tmp_path / "rows.csv").write_text("a,b\n")
    with pytest.raises(UserError, match=r"unsupported file type '\.csv'; use one of \.jsonl, \.json, \.parquet, \.txt "
                                        r"\(\.txt: plain text, one document per blank-line-separated block\)"):
        build_sources(DataArguments(dataset_mixer_list=[str(tmp_path / "rows.csv"), "1.0"]), tokenizer, 3, None,
                      tmp_path / "data", tmp_path / "spill")


@pytest.mark.parametrize("side", ["train", "eval"])
@pytest.mark.parametrize("case", ["mixture", "share"])
def test_streaming_holds_out_the_same_rows(side, case, corpora, tokenizer, tmp_path, small_chunks) -> None:
    args = args_for(corpora, case)
    holdout = (side, 0.2)
    assert_same(streamed(args, tokenizer, tmp_path, holdout), in_memory(args, tokenizer, holdout))


@pytest.mark.parametrize("file, message", [
    ("bad", r"bad\.jsonl line 4: not valid JSON"),
    ("bad_text", r"bad_text\.jsonl line 6: not valid JSON"),
    ("bad_json", r"bad\.json line 4: not valid JSON"),
])
def test_a_bad_row_stops_the_streaming_build_naming_its_line(file, message, corpora, tokenizer, tmp_path,
                                                             small_chunks) -> None:
    args = DataArguments(dataset_mixer_list=[corpora[file], "1.0"], max_seq_length=64)
    with pytest.raises(UserError, match=message):
        build_sources(args, tokenizer, 3, None, tmp_path / "data", tmp_path / "spill")
    with pytest.raises(UserError, match=message):
        build_rows(args, tokenizer, 3)


def test_a_chunk_of_rows_is_all_a_build_holds(corpora, tokenizer, tmp_path, monkeypatch, small_chunks) -> None:
    """The workers see one chunk at a time: no call labels more than CHUNK_ROWS rows."""
    sizes = []
    original = stream.label_rows
    monkeypatch.setattr(stream, "label_rows", lambda tok, work, *a, **k: sizes.append(len(work)) or original(
        tok, work, *a, **k))
    released = []  # the heap a chunk used goes back to the system after each chunk, not once at the end: glibc
    monkeypatch.setattr(stream, "_release_heap", lambda: released.append(len(sizes)))  # kept ~0.4 GB more
    build_sources(args_for(corpora, "all"), tokenizer, 3, None, tmp_path / "data", tmp_path / "spill")
    assert max(sizes) == 7 and sum(sizes) == len(LINES)
    assert released == list(range(1, len(sizes) + 1))



def test_a_text_chunk_is_tokenized_a_batch_at_a_time(corpora, tokenizer, tmp_path, monkeypatch) -> None:
    """A chunk of documents is tokenized and spilled TEXT_BATCH_ROWS documents (about TEXT_BATCH_CHARS characters)
    at a time, as arrays: the whole chunk's tokens as Python lists were ~2 GB at 64 MB of text."""
    monkeypatch.setattr(chunks, "CHUNK_ROWS", 50)
    monkeypatch.setattr(stream, "TEXT_BATCH_ROWS", 8)
    monkeypatch.setattr(stream, "TEXT_BATCH_CHARS", 800)
    appended = []
    original = spill.Spill.append
    monkeypatch.setattr(spill.Spill, "append", lambda self, index, rows, *a: appended.append(rows) or original(
        self, index, rows, *a))
    build_sources(args_for(corpora, "text_blocks"), tokenizer, 3, None, tmp_path / "data", tmp_path / "spill")
    texts = [json.loads(line)["text"] for line in open(corpora["text"])]
    assert sum(len(rows) for rows in appended) == len(texts) and max(len(rows) for rows in appended) == 8
    assert all(isinstance(rows.ids, np.ndarray) and rows.ids.dtype == np.int32 for rows in appended)
    # a batch of several documents holds about TEXT_BATCH_CHARS characters' tokens (the tiny tokenizer: at most a
    # token a character, and the document's bos and eos)
    assert all(len(rows.ids) <= 800 + max(len(t) for t in texts) + 2 * len(rows) for rows in appended if len(rows) > 1)
    assert len(appended) > len(texts) / 8 + 2  # the characters cut some batches short


def test_the_building_rank_says_how_fast_and_how_long(corpora, tokenizer, tmp_path, monkeypatch, caplog,
                                                      small_chunks) -> None:
    monkeypatch.setattr(chunks, "PROGRESS_EVERY_S", 0.0)
    with caplog.at_level(logging.INFO, logger="open_sft.data.build_progress"):
        build_sources(args_for(corpora, "text_blocks"), tokenizer, 3, None, tmp_path / "data", tmp_path / "spill")
    lines = [r.getMessage() for r in caplog.records if r.name == "open_sft.data.build_progress"]
    # a line a batch of documents (3 of a chunk's 7), not only a chunk's end: a 64 MB chunk took minutes
    assert re.fullmatch(r"building .*text\.jsonl: 3/120 rows, \d+ rows/s, \d+ tokens/s, eta \d+s", lines[0])
    assert re.fullmatch(r"building .*text\.jsonl: 120/120 rows, \d+ rows/s, \d+ tokens/s in [\d.]+s", lines[-1])
    assert len(lines) >= 120 // 3 + 1


@pytest.mark.parametrize("workers", [1, 2])
def test_a_file_read_whole_says_its_progress_too(workers, corpora, tokenizer, tmp_path, monkeypatch, caplog) -> None:
    """A JSON list file (read whole: the in-memory build) logs the streaming build's progress lines as its parts
    are labelled (a part of the workers', or of one process's) and its documents tokenized a batch at a time:
    100k rows of one were silent for 5 minutes. A streaming chunk's parts are told as they come too."""
    from open_sft.data import workers as worker_pool

    monkeypatch.setattr(chunks, "PROGRESS_EVERY_S", 0.0)
    monkeypatch.setattr(worker_pool, "_IN_PROCESS_CHUNK", 16)
    monkeypatch.setattr(worker_pool, "_MIN_ROWS_PER_WORKER", 10)
    monkeypatch.setattr(worker_pool, "_MIN_ROWS_PER_CHUNK", 8)
    monkeypatch.setattr(stream, "TEXT_BATCH_ROWS", 25)
    (tmp_path / "chat_list.json").write_text(json.dumps([json.loads(line) for line in LINES], indent=1))
    (tmp_path / "text_list.json").write_text(json.dumps([json.loads(line) for line in open(corpora["text"])]))
    mixer = [str(tmp_path / "chat_list.json"), "1.0", str(tmp_path / "text_list.json"), "1.0", corpora["chat"], "1.0"]
    args = DataArguments(dataset_mixer_list=mixer, max_seq_length=64, preprocessing_num_workers=workers)
    with caplog.at_level(logging.INFO, logger="open_sft.data.build_progress"):
        build_sources(args, tokenizer, 3, None, tmp_path / "data", tmp_path / "spill")
    said = [r.getMessage() for r in caplog.records if r.name == "open_sft.data.build_progress"]
    for name in ("chat_list.json", "text_list.json", "chat.jsonl"):
        lines = [line for line in said if f"{name}: " in line]
        rows = [int(re.search(r": (\d+)/120 rows", line).group(1)) for line in lines]
        assert len(lines) >= 4 and rows == sorted(rows) and rows[0] < rows[-2] == rows[-1] == 120, (name, lines)
        assert re.fullmatch(r"building .*: \d+/120 rows, \d+ rows/s, \d+ tokens/s, eta \d+s", lines[0])
        assert re.fullmatch(r"building .*: 120/120 rows, \d+ rows/s, \d+ tokens/s in [\d.]+s", lines[-1])


@pytest.mark.parametrize("batch_tokens", [900, None])
def test_record_batches_hold_batch_tokens(tokenizer, tmp_path, monkeypatch, batch_tokens) -> None:
    """The entry's Arrow record batches hold BATCH_TOKENS tokens each (the last one of the entry less): loading
    reads each batch's header, so a corpus's entry has few of them (datasets' default is 1,000 rows a batch)."""
    import pyarrow as pa

    if batch_tokens:
        monkeypatch.setattr(spill, "BATCH_TOKENS", batch_tokens)
    args = DataArguments(dataset_mixer_list=[str(SAMPLE), "1.0"], max_seq_length=256)
    writer, _ = build_sources(args, tokenizer, 3, None, tmp_path / "data", tmp_path / "spill")
    writer.finish("")
    batches = [batch for shard in sorted((tmp_path / "data").glob("*.arrow"))
               for batch in pa.ipc.open_stream(pa.memory_map(str(shard))).read_all().to_batches()]
    tokens = [int(pa.compute.sum(batch.column("length")).as_py()) for batch in batches]
    if batch_tokens:
        assert len(tokens) > 10 and all(batch_tokens - 41 < t <= batch_tokens for t in tokens[:-1])  # rows <= 41
        assert 0 < tokens[-1] <= batch_tokens and sum(tokens) == 43524
    else:  # the sample's 2,000 examples, 43,524 tokens: one batch
        assert len(tokens) == 1 and tokens[0] == 43524


def test_documents_holding_a_special_tokens_text_are_counted_and_named(tokenizer, tmp_path, small_chunks,
                                                                       caplog) -> None:
    """An `<|endoftext|>` inside a web page encodes as the control token (a fake document end, trained): counted
    per source, the same in both builds, and warned about naming the first rows; the tokens are not changed."""
    eos = tokenizer.eos_token
    docs = [f"page {k} talks about tokenizers and their many special strings" for k in range(30)]
    for k in (4, 11, 12, 26):
        docs[k] += f" such as {eos} in the middle"
    path = tmp_path / "web.jsonl"
    path.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in docs))
    args = DataArguments(dataset_mixer_list=[str(path), "1.0"], max_seq_length=64)
    with caplog.at_level("WARNING"):
        built = streamed(args, tokenizer, tmp_path)
    assert built[2][0]["special_tokens_in_text"] == 4 and built[2][0]["special_tokens_in_text_by_token"] == {eos: 4}
    warned = [r.getMessage() for r in caplog.records if "literal text of a special token" in r.getMessage()]
    assert len(warned) == 1 and "4 row(s)" in warned[0] and "row 5" in warned[0] and "row 27" in warned[0]
    assert f"({eos} in 4 rows)" in warned[0]
    assert_same(built, in_memory(args, tokenizer))
    ids = np.concatenate(built[0])
    assert (ids == tokenizer.eos_token_id).sum() == 30 + 4  # one after each document, and the four in the text
