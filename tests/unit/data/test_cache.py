"""The tokenization cache: key sensitivity, hits that never tokenize, races, crashes and damage.

The tests of this subject that launch real processes are in tests/integration/test_cache.py.
"""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
from transformers import AutoTokenizer

import open_sft.data.workers as workers
from conftest import SAMPLE
from open_sft.config.args import DataArguments
from open_sft.data import cache, cache_check
from open_sft.data.cache_inputs import key_inputs
from open_sft.data.prepare import prepare_data


GOLDEN_SAMPLE_SHA256 = "7dff9af9c58691a65e73901f866a413e931e950a7e464170757a021fb6aadf20"


@pytest.fixture()
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Each test its own cache: entries are keyed by the data's content, so the session's shared cache holds other
    tests' builds of the same sample (OPEN_SFT_CACHE overrides --dataset_local_cache_dir)."""
    monkeypatch.setenv("OPEN_SFT_CACHE", str(tmp_path / "cache"))


@pytest.fixture()
def data_file(tmp_path):
    path = tmp_path / "data.jsonl"
    shutil.copy(SAMPLE, path)
    return path


def args_for(path, cache_dir, **overrides) -> DataArguments:
    values = dict(dataset_mixer_list=[str(path), "0.1"], dataset_local_cache_dir=str(cache_dir), max_seq_length=256)
    values.update(overrides)
    return DataArguments(**values)


def key_of(args, tokenizer, seed=1) -> str:
    return cache.cache_key(key_inputs(args, tokenizer, seed))


def test_golden_hash_of_tokenized_sample(tokenizer, tmp_path) -> None:
    data = prepare_data(DataArguments(dataset_mixer_list=[str(SAMPLE), "1.0"], dataset_skip_cache=True), tokenizer, 42)
    digest = hashlib.sha256()
    for row in data.dataset:
        digest.update(json.dumps([row["input_ids"], row["labels"]]).encode())
    assert len(data) == 2000
    assert digest.hexdigest() == GOLDEN_SAMPLE_SHA256


def test_key_stable_and_sensitive(tokenizer, data_file, tmp_path, monkeypatch) -> None:
    args = args_for(data_file, tmp_path)
    base = key_of(args, tokenizer)
    assert key_of(args, tokenizer) == base
    changed = {
        "max_seq_length": key_of(args_for(data_file, tmp_path, max_seq_length=128), tokenizer),
        "seed": key_of(args, tokenizer, seed=2),
        "amount": key_of(args_for(data_file, tmp_path, dataset_mixer_list=[str(data_file), "0.2"]), tokenizer),
        "train_on": key_of(args_for(data_file, tmp_path, train_on="last_assistant"), tokenizer),
        "truncation": key_of(args_for(data_file, tmp_path, truncation="drop"), tokenizer),
    }
    template = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    template.chat_template = template.chat_template.replace("<|user|>", "<|user|> ")
    changed["chat_template"] = key_of(args, template)
    extra_token = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    extra_token.add_tokens(["<|tool|>"], special_tokens=True)
    changed["tokenizer_file"] = key_of(args, extra_token)
    with data_file.open("r+b") as handle:  # one byte of the data file
        handle.seek(100)
        byte = handle.read(1)
        handle.seek(100)
        handle.write(b"X" if byte != b"X" else b"Y")
    changed["file_byte"] = key_of(args, tokenizer)
    monkeypatch.setattr(cache, "CACHE_FORMAT_VERSION", cache.CACHE_FORMAT_VERSION + 1)
    changed["version"] = key_of(args, tokenizer)
    real_version = cache.importlib.metadata.version  # an upgraded tokenizer library may tokenize otherwise
    monkeypatch.setattr(cache.importlib.metadata, "version",
                        lambda name: "99.0" if name == "tokenizers" else real_version(name))
    changed["tokenizers_library"] = key_of(args, tokenizer)
    assert len(set(changed.values()) | {base}) == len(changed) + 1, changed
    assert set(key_inputs(args, tokenizer, 1)["libraries"]) == {"tokenizers", "transformers", "jinja2"}


def test_the_same_file_by_another_path_is_the_same_entry_and_the_same_rows(tokenizer, data_file, tmp_path,
                                                                            monkeypatch) -> None:
    """A corpus reached by another path (relative, another mount: here a copy elsewhere) gives the same key and,
    for a fraction, the same rows (the draws are seeded by the content, not the spelling); built ahead from one
    path and found from the other, the report names the source as the run that found it does."""
    other = tmp_path / "mount" / "corpus.jsonl"
    other.parent.mkdir()
    shutil.copy(data_file, other)
    monkeypatch.chdir(tmp_path)
    cache_dir = tmp_path / "cache"
    spellings = [str(data_file), "data.jsonl", str(other)]
    assert len({key_of(args_for(path, cache_dir), tokenizer) for path in spellings}) == 1
    built = prepare_data(args_for(spellings[0], cache_dir), tokenizer, 1)
    found = prepare_data(args_for(spellings[2], cache_dir), tokenizer, 1)
    assert found.cache_hit and not built.cache_hit
    from open_sft.data.mixer import source_names

    assert found.report["sources"][0]["name"] == str(other) and found.source_names == source_names([str(other)])
    assert built.source_names == source_names([str(data_file)]) != found.source_names  # loss/<source> as named here
    streamed = prepare_data(args_for("data.jsonl", cache_dir, dataset_skip_cache=True), tokenizer, 1)
    assert list(streamed.dataset["input_ids"]) == list(built.dataset["input_ids"])  # built anew: the same rows
    assert key_of(args_for(str(data_file), cache_dir, dataset_mixer_list=[str(data_file), "0.2"]), tokenizer) != \
        key_of(args_for(str(other), cache_dir), tokenizer)


def test_hit_does_not_tokenize(tokenizer, data_file, tmp_path, monkeypatch) -> None:
    args = args_for(data_file, tmp_path / "cache")
    built = prepare_data(args, tokenizer, 1)
    assert not built.cache_hit and (built.cache_path / "COMPLETE").exists()
    key = json.loads((built.cache_path / "key.json").read_text())
    assert key["max_seq_length"] == 256 and key["sources"][0]["identity"].startswith("file:")

    def refuse(*_, **__):
        raise AssertionError("a cache hit must not tokenize")

    monkeypatch.setattr(workers, "label_batch", refuse)
    hit = prepare_data(args, tokenizer, 1)
    assert hit.cache_hit and hit.cache_path == built.cache_path
    assert hit.dataset["input_ids"] == built.dataset["input_ids"]
    assert hit.dataset["labels"] == built.dataset["labels"]
    assert hit.report == built.report


def test_interrupted_and_damaged_entries_are_rebuilt(tokenizer, data_file, tmp_path, caplog) -> None:
    args = args_for(data_file, tmp_path / "cache")
    good = prepare_data(args, tokenizer, 1)
    expected = good.dataset["input_ids"]
    entry = good.cache_path

    # Damage: one byte of an Arrow file changes.
    arrow = next(entry.glob("*.arrow"))
    raw = bytearray(arrow.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    arrow.write_bytes(bytes(raw))
    again = prepare_data(args, tokenizer, 1)
    assert not again.cache_hit and again.dataset["input_ids"] == expected
    assert "sha256 mismatch" in caplog.text

    # A killed build: a staging directory and an entry without COMPLETE.
    (entry / "COMPLETE").unlink()
    stale = entry.parent / f"{entry.name}.tmp-99999"
    stale.mkdir()
    (stale / "half.arrow").write_bytes(b"partial")
    rebuilt = prepare_data(args, tokenizer, 1)
    assert not rebuilt.cache_hit and rebuilt.dataset["input_ids"] == expected
    assert not stale.exists()
    assert "no COMPLETE marker" in caplog.text


@pytest.mark.parametrize("record", ["report.json", "key.json"])
@pytest.mark.parametrize("hashed", [True, False])
def test_an_entry_whose_report_or_key_record_is_damaged_is_rebuilt(tokenizer, data_file, tmp_path, caplog, record,
                                                                   hashed) -> None:
    """hunt C F4: report.json zeroed (same size) passed _verify (the records were left out of the manifest) and
    every launch crashed json-parsing it. Now its hash is in COMPLETE; an entry written before that (no
    "records") is still checked that its records parse."""
    args = args_for(data_file, tmp_path / "cache")
    good = prepare_data(args, tokenizer, 1)
    entry = good.cache_path
    if not hashed:  # as an entry built by an earlier open_sft was
        manifest = json.loads((entry / "COMPLETE").read_text())
        del manifest["records"]
        (entry / "COMPLETE").write_text(json.dumps(manifest))
    size = (entry / record).stat().st_size
    (entry / record).write_bytes(bytes(size))
    again = prepare_data(args, tokenizer, 1)
    assert not again.cache_hit
    assert again.dataset["input_ids"] == good.dataset["input_ids"] and again.report == good.report
    assert f"{record} is damaged" in caplog.text and "rebuilding it" in caplog.text
    assert json.loads((entry / record).read_text())
    if hashed:  # a change json still parses is damage too where the record is hashed
        (entry / "key.json").write_text((entry / "key.json").read_text().replace("256", "257"))
        assert not prepare_data(args, tokenizer, 1).cache_hit
        assert "key.json is damaged (sha256 mismatch)" in caplog.text


def test_key_ignores_how_the_tokenizer_was_loaded(tiny_model_dir, data_file, tmp_path) -> None:
    """HF_HUB_OFFLINE makes transformers record local_files_only in tokenizer_config.json; a relaunch
    with another environment must still hit the same cache (and resume)."""
    args = args_for(data_file, tmp_path)
    online = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=False)
    offline = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    assert key_of(args, online) == key_of(args, offline)


def test_a_large_entry_is_checked_by_sizes_and_edges_on_a_hit(tokenizer, data_file, tmp_path, caplog,
                                                               monkeypatch) -> None:
    """Above FULL_CHECK_BYTES a hit reads each file's size and first and last MiB, not every byte (a second per GB
    before training): a changed edge or a cut file is caught; the build itself hashed every byte."""
    monkeypatch.setattr(cache_check, "FULL_CHECK_BYTES", 0)
    args = args_for(data_file, tmp_path / "cache")
    entry = prepare_data(args, tokenizer, 1).cache_path
    manifest = json.loads((entry / "COMPLETE").read_text())
    assert set(manifest) == {"key", "files", "sizes", "edges", "records"}
    assert prepare_data(args, tokenizer, 1).cache_hit
    arrow = next(entry.glob("*.arrow"))
    raw = bytearray(arrow.read_bytes())
    raw[-10] ^= 0xFF
    arrow.write_bytes(bytes(raw))
    assert not prepare_data(args, tokenizer, 1).cache_hit
    assert "sha256 mismatch of its first and last MiB" in caplog.text
    arrow = next(entry.glob("*.arrow"))
    arrow.write_bytes(arrow.read_bytes()[:-100])
    assert not prepare_data(args, tokenizer, 1).cache_hit
    assert "is damaged (size " in caplog.text


def test_a_large_files_hash_is_remembered_while_its_stat_is_unchanged(tmp_path, monkeypatch) -> None:
    """The key's sha256 of a large source is read back from <cache>/file_hashes/ on the next launch (no byte of
    the file read); new contents (a new mtime, the same size) are hashed again; small files are always hashed."""
    import os

    from open_sft.data import cache

    monkeypatch.setattr(cache, "MEMO_BYTES", 100)
    corpus, small = tmp_path / "corpus.jsonl", tmp_path / "small.jsonl"
    corpus.write_bytes(b"a" * 200)
    small.write_bytes(b"b" * 50)
    expected = cache.sha256_file(corpus)
    assert cache.content_hash(corpus, tmp_path / "c") == expected
    assert len(list((tmp_path / "c" / "file_hashes").iterdir())) == 1
    real = cache.sha256_file
    monkeypatch.setattr(cache, "sha256_file", lambda path: (_ for _ in ()).throw(AssertionError(f"read {path}")))
    assert cache.content_hash(corpus, tmp_path / "c") == expected  # remembered
    with pytest.raises(AssertionError, match="read"):
        cache.content_hash(small, tmp_path / "c")  # below MEMO_BYTES: always hashed
    monkeypatch.setattr(cache, "sha256_file", real)
    corpus.write_bytes(b"c" * 200)
    stat = corpus.stat()
    os.utime(corpus, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert cache.content_hash(corpus, tmp_path / "c") == cache.sha256_file(corpus) != expected
    assert cache.content_hash(corpus, None) == cache.sha256_file(corpus)  # --dataset_skip_cache: no memo


def test_new_contents_with_the_old_size_and_mtime_put_back_are_hashed_again(tmp_path, monkeypatch) -> None:
    """cp -p or rsync --inplace -t onto a corpus (or touch -r after an edit) writes new contents of the same size
    into the same inode and puts its old mtime back: the remembered hash was read, and the run trained on the old
    entry's tokens. The status-change time, which no tool can set, is in the memo's stamp too."""
    import os
    import time

    from open_sft.data import cache

    monkeypatch.setattr(cache, "MEMO_BYTES", 100)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_bytes(b'{"text": "the first corpus"}\n' * 8)
    old = cache.sha256_file(corpus)
    assert cache.content_hash(corpus, tmp_path / "c") == old
    before = corpus.stat()
    while corpus.stat().st_ctime_ns == before.st_ctime_ns:  # a coarse clock: let the ctime move
        time.sleep(0.01)
        with corpus.open("r+b") as handle:  # in place: the same inode
            handle.write(b'{"text": "the other corpus"}\n' * 8)
        os.utime(corpus, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = corpus.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    new = cache.sha256_file(corpus)
    assert new != old
    assert cache.content_hash(corpus, tmp_path / "c") == new
    assert cache.content_hash(corpus, tmp_path / "c") == new  # and remembered under its new stamp
    assert len(list((tmp_path / "c" / "file_hashes").iterdir())) == 2


def test_an_entry_another_rank_built_while_this_one_waited_is_not_called_loaded_from_cache(tmp_path) -> None:
    """A 2-rank launch logged "tokenized data loaded from cache" for the entry its other rank had just built."""
    import os

    from open_sft.data.prepare import how_found

    entry = tmp_path / "entry"
    entry.mkdir()
    (entry / "COMPLETE").write_text("{}")
    os.utime(entry / "COMPLETE", (1000.0, 1000.0))
    assert how_found(False, entry, 2000.0) == "built"
    assert how_found(True, entry, 2000.0) == "loaded from cache"  # finished before this process asked
    assert how_found(True, entry, 500.0) == "built by another process while this one waited"


def test_cache_dataset_only_builds_the_evaluation_set_too(tiny_model_dir, data_file, tmp_path, capsys) -> None:
    """--cache_dataset_only (scripts/prepare_data.sh) builds the evaluation entry as well (here --eval_split_ratio's
    held-out rows), names it, and keeps the training entry's path on the last line: the training job only loads."""
    from open_sft.run import main

    code = main(["--model_name_or_path", str(tiny_model_dir), "--dataset_mixer_list", str(data_file), "0.1",
                 "--eval_split_ratio", "0.1", "--cache_dataset_only", "--output_dir", str(tmp_path / "out")])
    assert code == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-2].startswith("evaluation cache: ")
    train, held = lines[-1], lines[-2].removeprefix("evaluation cache: ")
    assert train != held
    for path, rows in ((train, 180), (held, 200)):
        assert (tmp_path / "cache" / path.split("/")[-1] / cache.COMPLETE).exists()
        assert json.loads((tmp_path / "cache" / path.split("/")[-1] / "report.json").read_text())[
            "sources"][0]["rows_kept"] == rows


def test_a_launch_waiting_on_another_build_of_its_entry_says_so_and_keeps_saying_it(tmp_path, caplog) -> None:
    """A second job with the same data waited on the first one's build (hours for a large corpus) without a word,
    looking hung: one line when the wait starts names the entry, its lock and the build holding it, and one line
    every `say_s` seconds while it lasts; the lock is taken once the holder lets go."""
    import fcntl
    import logging
    import threading
    import time

    key = "ab" * 32
    lock = cache.lock_path(tmp_path, key)
    (tmp_path / f"{key}.tmp-4242").mkdir()  # the other build's staging directory
    other = cache.open_lock(lock)  # another open file: flock conflicts as with another process
    got = []
    with caplog.at_level(logging.INFO, logger="open_sft.data.cache"):
        waiter = threading.Thread(target=lambda: got.append(cache.wait_for_lock(lock, poll_s=0.01, say_s=0.1)))
        waiter.start()
        deadline = time.monotonic() + 60
        while sum("still waiting" in r.getMessage() for r in caplog.records) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not got  # still waiting
        fcntl.flock(other, fcntl.LOCK_UN)
        other.close()
        waiter.join(timeout=10)
    assert got and not waiter.is_alive()
    got[0].close()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == (f"waiting for the tokenization cache entry {tmp_path / key}, being built by process 4242 in "
                        f"{tmp_path / (key + '.tmp-4242')} (lock {lock}); it is used once built")
    building = "being built by process 4242 in " + str(tmp_path / f"{key}.tmp-4242")
    assert sum(line.startswith(f"still waiting for the tokenization cache entry {tmp_path / key} (")
               and line.endswith(building) for line in lines) >= 2
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="open_sft.data.cache"):
        cache.wait_for_lock(lock).close()  # free: taken at once, nothing said
    assert not caplog.records


def test_a_text_only_mixture_is_one_entry_whatever_the_chat_template(tokenizer, tmp_path) -> None:
    """Continual pretraining on documents: no chat template renders them (each is its tokens + eos), yet the key held
    the template, so --chat_template_name tulu then zephyr tokenized the corpus twice into equal entries. A mixture
    whose every source is known for documents before the build (a .txt file, JSON Lines whose first row is a
    document, --dataset_format text) leaves the template out of its key: the other template finds the entry; a chat
    source in the mixture, or a source read whole before its first row (a directory laid out as a Hub dataset), keeps
    the template in the key."""
    import datasets

    texts = [f"document {k}: " + "some words " * (k % 7) for k in range(30)]
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("first paragraph\nof the corpus\n\nsecond paragraph\n")
    other = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    other.chat_template = other.chat_template.replace("<|user|>", "<|user|> ")
    cache_dir = tmp_path / "cache"
    documents = args_for(docs, cache_dir, dataset_mixer_list=[str(docs), "1.0", str(corpus), "1.0"])
    assert key_of(documents, tokenizer) == key_of(documents, other)
    assert "chat_template" not in key_inputs(documents, tokenizer, 1)
    built, found = prepare_data(documents, tokenizer, 1), prepare_data(documents, other, 1)
    assert (built.cache_hit, found.cache_hit, found.cache_path) == (False, True, built.cache_path)
    uncached = prepare_data(args_for(docs, cache_dir, dataset_mixer_list=documents.dataset_mixer_list,
                                     dataset_skip_cache=True), other, 1)  # what the other template builds
    ids = [list(row["input_ids"]) for row in built.dataset]
    assert ids == [list(row["input_ids"]) for row in uncached.dataset]
    eos = tokenizer.eos_token_id
    expected = [token for text in texts for token in tokenizer(text)["input_ids"] + [eos]]
    expected += tokenizer("first paragraph\nof the corpus")["input_ids"] + [eos] + tokenizer("second paragraph")[
        "input_ids"] + [eos]
    assert [token for example in ids for token in example] == expected

    chat = args_for(docs, cache_dir, dataset_mixer_list=[str(docs), "1.0", str(SAMPLE), "1.0"])
    assert key_of(chat, tokenizer) != key_of(chat, other)
    hub_layout = tmp_path / "hub_layout"
    hub_layout.mkdir()
    datasets.Dataset.from_list([{"text": text} for text in texts]).to_parquet(str(hub_layout / "train.parquet"))
    assert key_of(args_for(hub_layout, cache_dir), tokenizer) != key_of(args_for(hub_layout, cache_dir), other)
    forced = args_for(hub_layout, cache_dir, dataset_format="text")
    assert key_of(forced, tokenizer) == key_of(forced, other)


def test_a_parquet_file_or_saved_dataset_of_documents_is_one_entry_whatever_the_chat_template(tokenizer,
                                                                                             tmp_path) -> None:
    """A parquet file or a `save_to_disk` directory of documents kept the template in its key (their rows were read
    only by loading them whole: datasets converts a parquet file into its own cache), so another
    --chat_template_name tokenized the corpus again. Their first row is read cheaply as the build reads it (the
    parquet file's first record batch; the saved dataset memory-mapped): documents leave the template out; chat rows,
    and a directory laid out as a Hub dataset (datasets picks and unifies its files as it loads them), keep it."""
    import datasets

    texts = [f"document {k}: " + "some words " * (k % 5) for k in range(12)]
    documents = datasets.Dataset.from_list([{"text": text, "url": f"u{k}"} for k, text in enumerate(texts)])
    parquet, saved = tmp_path / "docs.parquet", tmp_path / "saved"
    documents.to_parquet(str(parquet))
    datasets.DatasetDict({"train": documents}).save_to_disk(str(saved))
    chat = datasets.Dataset.from_list([json.loads(line) for line in SAMPLE.read_text().splitlines()[:4]])
    chat.to_parquet(str(tmp_path / "chat.parquet"))
    chat.save_to_disk(str(tmp_path / "chat_saved"))
    other = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    other.chat_template = other.chat_template.replace("<|user|>", "<|user|> ")
    cache_dir = tmp_path / "cache"
    for source in (parquet, saved):
        args = args_for(source, cache_dir, dataset_mixer_list=[str(source), "1.0"])
        assert "chat_template" not in key_inputs(args, tokenizer, 1) and key_of(args, tokenizer) == key_of(args, other)
        built, found = prepare_data(args, tokenizer, 1), prepare_data(args, other, 1)
        assert (built.cache_hit, found.cache_hit, found.cache_path) == (False, True, built.cache_path)
        eos = tokenizer.eos_token_id
        assert [token for row in found.dataset for token in row["input_ids"]] == [
            token for text in texts for token in tokenizer(text)["input_ids"] + [eos]]
    for source in (tmp_path / "chat.parquet", tmp_path / "chat_saved", parquet):
        mixture = [str(source), "1.0"] + ([str(tmp_path / "chat.parquet"), "1.0"] if source == parquet else [])
        args = args_for(source, cache_dir, dataset_mixer_list=mixture)
        assert key_inputs(args, tokenizer, 1)["chat_template"] == tokenizer.chat_template
        assert key_of(args, tokenizer) != key_of(args, other)
