"""Every kind of source --dataset_mixer_list takes is loaded, with its split and config: a .jsonl, a .json (a list,
one object holding the list, or JSON Lines as `datasets.load_dataset("json")` takes them), a
.parquet, a directory `Dataset.save_to_disk` wrote, one `DatasetDict.save_to_disk` wrote (split by
--dataset_mixer_list_splits), and a directory laid out as a Hub dataset repository, read offline by
`datasets.load_dataset` (data/<split>-*.parquet; and a README whose YAML names two configs, chosen by
--dataset_config_name); the config enters the cache key."""

from __future__ import annotations

import json

import datasets
import pytest

from open_sft.data.sources import parse_mixer_list, read_source, source_identity
from open_sft.errors import UserError

TRAIN = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
         for i in range(5)]
TEST = [{"messages": [{"role": "user", "content": f"t{i}"}, {"role": "assistant", "content": f"b{i}"}]}
        for i in range(3)]


def rows_of(name: str, split: str = "train", config: str | None = None) -> list[dict]:
    spec, = parse_mixer_list([name, "1.0"], [split], config_name=config)
    return read_source(spec).rows


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in TRAIN))
    (root / "rows.json").write_text(json.dumps(TRAIN))
    (root / "pretty.json").write_text(json.dumps({"train": TRAIN}, indent=2))
    (root / "one_row.json").write_text(json.dumps(TRAIN[0], indent=1))  # an object that is a row
    (root / "pretty_lines.json").write_text("\n".join(json.dumps(r, indent=2) for r in TRAIN))  # objects in turn
    (root / "lines.json").write_text("".join(json.dumps(r) + "\r\n" * (1 + (i == 2)) for i, r in enumerate(TRAIN)))
    datasets.Dataset.from_list(TRAIN).to_parquet(str(root / "rows.parquet"))
    datasets.Dataset.from_list(TRAIN).save_to_disk(str(root / "saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(TRAIN),
                          "test": datasets.Dataset.from_list(TEST)}).save_to_disk(str(root / "saved_dict"))
    hub = root / "hub_repo"
    (hub / "data").mkdir(parents=True)
    datasets.Dataset.from_list(TRAIN).to_parquet(str(hub / "data" / "train-00000-of-00001.parquet"))
    datasets.Dataset.from_list(TEST).to_parquet(str(hub / "data" / "test-00000-of-00001.parquet"))
    configs = root / "hub_configs"
    for name, rows in (("small", TEST), ("full", TRAIN)):
        (configs / name).mkdir(parents=True)
        (configs / name / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (configs / "README.md").write_text(
        "---\nconfigs:\n- config_name: full\n  data_files:\n  - split: train\n    path: full/train.jsonl\n"
        "  default: true\n- config_name: small\n  data_files:\n  - split: train\n    path: small/train.jsonl\n---\n")
    return root


@pytest.mark.parametrize("name", ["rows.jsonl", "rows.json", "pretty.json", "lines.json", "pretty_lines.json",
                                  "rows.parquet", "saved", "saved_dict", "hub_repo"])
def test_each_kind_loads_its_train_rows(sources, name) -> None:
    assert rows_of(str(sources / name)) == TRAIN


def test_a_json_object_that_is_a_row_is_one_row(sources) -> None:
    """{"messages": [...]} is a row (its one key a row's column), not a mapping of a split to its rows."""
    assert rows_of(str(sources / "one_row.json")) == TRAIN[:1]


def test_splits_of_a_dataset_dict_and_a_hub_layout(sources) -> None:
    assert rows_of(str(sources / "saved_dict"), "test") == TEST
    assert rows_of(str(sources / "hub_repo"), "test") == TEST
    with pytest.raises(UserError, match="no split 'validation' \\(it has train, test\\).*--dataset_mixer_list_splits"):
        rows_of(str(sources / "saved_dict"), "validation")
    with pytest.raises(UserError, match="split 'validation'.*--dataset_mixer_list_splits"):
        rows_of(str(sources / "hub_repo"), "validation")


def test_config_of_a_hub_layout_and_the_cache_key(sources) -> None:
    path = str(sources / "hub_configs")
    assert rows_of(path) == TRAIN  # the default config
    assert rows_of(path, config="small") == TEST
    with pytest.raises(UserError, match="config 'missing'.*--dataset_config_name"):
        rows_of(path, config="missing")


def test_dataset_config_name_enters_the_cache_key(sources, tiny_model_dir) -> None:
    """Another config is another cache entry; without the flag the key's inputs are what they were (caches built
    before the flag existed stay valid)."""
    from transformers import AutoTokenizer

    from open_sft.config.args import DataArguments
    from open_sft.data.cache import cache_key
    from open_sft.data.cache_inputs import key_inputs

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    keys = {}
    for config in (None, "small", "full"):
        args = DataArguments(dataset_mixer_list=[str(sources / "hub_configs"), "1.0"], dataset_config_name=config)
        inputs = key_inputs(args, tokenizer, 0)
        assert ("config" in inputs["sources"][0]) is (config is not None)
        keys[config] = cache_key(inputs)
    assert len(set(keys.values())) == 3


def test_a_directory_whose_files_differ_in_columns_says_which(tmp_path) -> None:
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "a.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "a"}]}) + "\n")
    (folder / "b.jsonl").write_text(json.dumps({"conversations": [{"from": "human", "value": "a"}]}) + "\n")
    with pytest.raises(UserError) as refused:
        rows_of(str(folder))
    message = str(refused.value)
    # datasets' own cause (behind its generic "error occurred while generating"), then the way out
    assert "CastError" in message and "column names don't match" in message and "conversations" in message
    assert "a local directory's data files must share one set of columns" in message


def test_a_split_asked_of_a_single_local_file(tmp_path, caplog) -> None:
    """A local file is one split: a split named for it alone is refused; one split for every source (a Hub
    dataset's test split, say) reads the file whole and says so."""
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(TRAIN[0]) + "\n")
    with pytest.raises(UserError, match=r"--dataset_mixer_list_splits: split 'test' for .*d.jsonl: a local file is one"):
        parse_mixer_list([str(data), "1.0", "org/ds", "1.0"], ["test", "test"])
    caplog.set_level("WARNING", logger="open_sft.data.sources")
    spec, = parse_mixer_list([str(data), "1.0"], ["test"])
    assert "d.jsonl is a local file, one split: all its rows are read" in caplog.text
    assert parse_mixer_list([str(data), "1.0"], ["train"])[0].split == "train"


def test_a_local_file_read_whole_for_a_split_is_said_once(tmp_path, caplog) -> None:
    """The data phases each parse the mixer list (the build, the summary, the cache key): a run said the same
    warning three times; it is said once."""
    data = tmp_path / "once.jsonl"
    data.write_text(json.dumps(TRAIN[0]) + "\n")
    caplog.set_level("WARNING", logger="open_sft.data.sources")
    for _ in range(3):
        spec, = parse_mixer_list([str(data), "1.0"], ["validation"])
    assert caplog.text.count("once.jsonl is a local file, one split: all its rows are read") == 1


def test_a_utf8_byte_order_mark_opening_a_file_is_not_text(tmp_path) -> None:
    """A BOM at a file's start (Windows editors write one) is read as utf-8-sig: a .txt file's first document did
    start with U+FEFF (trained as a token) while a .jsonl file was refused (Unexpected UTF-8 BOM). Whole reads and
    the streamed chunks alike; a U+FEFF inside the text is kept."""
    from open_sft.data.local_files import line_chunks, text_blocks

    bom = "\ufeff".encode()
    lines = "".join(json.dumps(row) + "\n" for row in TRAIN)
    for name, body, expected in (("a.jsonl", lines, TRAIN), ("b.json", json.dumps(TRAIN), TRAIN),
                                 ("c.txt", "first doc\n\nsecond \ufeff doc\n", [{"text": "first doc"},
                                                                                 {"text": "second \ufeff doc"}])):
        path = tmp_path / name
        path.write_bytes(bom + body.encode())
        assert rows_of(str(path)) == expected, name
    assert [json.loads(line) for chunk, _ in line_chunks(tmp_path / "a.jsonl", rows=2) for line in chunk] == TRAIN
    assert [text for chunk, _ in text_blocks(tmp_path / "c.txt", rows=1) for text in chunk][0] == "first doc"


@pytest.mark.parametrize("damage", ["json_lines", "cut_short"])
def test_a_parquet_file_that_does_not_read_is_named(sources, tmp_path, damage) -> None:
    """A .parquet that is not one (JSON Lines renamed, a copy cut short): an error naming the file, not pyarrow's
    ArrowInvalid traceback."""
    good = (sources / "rows.parquet").read_bytes()
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b'{"messages": []}\n' if damage == "json_lines" else good[:len(good) // 2])
    with pytest.raises(UserError, match=f"^{bad}: not a readable parquet file \\(Parquet magic bytes not found"):
        rows_of(str(bad))


def test_a_json_syntax_error_says_its_line_and_column_once(tmp_path) -> None:
    """json's "Unterminated string starting at" read "... starting at at column 118"; a .json file gave no column."""
    from open_sft.data.formats import RowError
    from open_sft.data.local_files import parse_json_line, read_json

    with pytest.raises(RowError) as info:
        parse_json_line('{"text": "abc')
    assert str(info.value).startswith("not valid JSON (Unterminated string starting at column 10); ")
    (tmp_path / "cut.json").write_text('[\n  {"text": "abc\n')
    with pytest.raises(UserError) as error:
        read_json(tmp_path / "cut.json")
    assert f"{tmp_path / 'cut.json'} line 2: not valid JSON (Invalid control character at column 16)" in str(
        error.value)


@pytest.mark.parametrize("text, lines", [
    ('[\n  {"a": 1},\n  {"a": 2,\n   "b": 3},\n\n  {"a": [1,\n 2]}\n]\n', [2, 3, 6]),  # a list
    ('{\n "train": [\n  {"a": 1},\n  {"a": 2}\n ]\n}\n', [3, 4]),  # one object holding the list
    ('{ "data"  :\n\n [ {"a": 1} , {"a": 2} ] }', [3, 3]),
    ('\n\n{"a": 1, "b": [2]}\n', [3]),  # one object, a row
    ('{"a": 1}\n{\n "a": 2\n}\n', [1, 2]),  # objects one after another
])
def test_a_json_documents_rows_know_the_line_they_begin_on(tmp_path, text, lines) -> None:
    """read_json decodes a list an element at a time to learn where each row begins; the rows are json's own."""
    from open_sft.data.local_files import read_json

    (tmp_path / "rows.json").write_text(text)
    rows, numbers = read_json(tmp_path / "rows.json")
    assert numbers == lines
    decoder, values, at = json.JSONDecoder(), [], 0
    while text[at:].strip():
        value, at = decoder.raw_decode(text, len(text[at:]) - len(text[at:].lstrip()) + at)
        values.append(value)
    whole = values[0] if len(values) == 1 else values
    whole = whole.get("train", whole.get("data", whole)) if isinstance(whole, dict) else whole
    assert rows == (whole if isinstance(whole, list) else [whole])


@pytest.mark.parametrize("text, error", [
    ('[\n {"a": 1}\n {"a": 2}\n]', "line 3: not valid JSON (Expecting ',' delimiter at column 2)"),
    ('[\n {"a": 1},\n]', "line 3: not valid JSON (Expecting value at column 1)"),
    ('[\n {"a": 1},', "line 2: not valid JSON (Expecting value at column 11)"),
    ('[\n {"a": 1},\n 5\n]', "line 3: expected a JSON object, got number"),
])
def test_a_json_lists_errors_name_the_line_json_names(tmp_path, text, error) -> None:
    """Decoding a list an element at a time keeps json's own message and place (checked against json.loads)."""
    from open_sft.data.local_files import read_json

    (tmp_path / "rows.json").write_text(text)
    with pytest.raises(UserError) as refused:
        read_json(tmp_path / "rows.json")
    assert str(refused.value).startswith(f"{tmp_path / 'rows.json'} {error}")
    if "not valid JSON" in error:
        with pytest.raises(json.JSONDecodeError) as raised:
            json.loads(text)
        assert f"line {raised.value.lineno}: " in error and f"column {raised.value.colno})" in error


def test_a_hub_dataset_offline_outside_the_cache_says_so_and_how_to_give_a_local_copy(monkeypatch) -> None:
    """datasets said "Couldn't reach ... (OfflineModeIsEnabled) <- ... is not cached in None"."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    spec, = parse_mixer_list(["open-sft-nobody/no-such-dataset", "1.0"], ["test"])
    with pytest.raises(UserError) as raised:
        source_identity(spec)
    assert str(raised.value) == (
        "dataset 'open-sft-nobody/no-such-dataset' (split 'test'): HF_HUB_OFFLINE is set and the local Hugging Face "
        "caches do not hold it, so it cannot be loaded. Give a local copy instead: a .jsonl, .json or .parquet file, "
        "or a directory of them (on a machine with network: `hf download open-sft-nobody/no-such-dataset "
        "--repo-type dataset --local-dir DIR`, then --dataset_mixer_list DIR AMOUNT); or unset HF_HUB_OFFLINE where "
        "the Hub can be reached. If it is meant to be a local path, check it")


def test_a_utf16_file_is_named_as_such_with_its_conversion(tmp_path) -> None:
    """It read 'not UTF-8 (byte 0xff at column 1) ... iconv -f latin1', a conversion that would garble it."""
    path = tmp_path / "u16.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in TRAIN), encoding="utf-16")
    with pytest.raises(UserError) as raised:
        rows_of(str(path))
    assert str(raised.value) == (f"{path} line 1: not UTF-8 (it is UTF-16 (its byte order mark says so)); data files "
                                 f"must be UTF-8: re-encode it, e.g. iconv -f utf-16 -t utf-8 {path} > u16.utf8.jsonl")


@pytest.mark.parametrize("line, name", [("null", "null"), ('"a row"', "string"), ("7", "number"),
                                        ("true", "boolean"), ("[1, 2]", "list")])
def test_a_row_that_is_no_object_is_named_by_its_json_type(tmp_path, line, name) -> None:
    """A `null` line read 'expected a JSON object, got NoneType'."""
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(TRAIN[0]) + "\n" + line + "\n")
    with pytest.raises(UserError, match=f"rows.jsonl line 2: expected a JSON object, got {name}; --on_bad_row drop "
                       r"skips such rows \(each counted in the data report\)$"):
        rows_of(str(path))
    listed = tmp_path / "rows.json"
    listed.write_text(f"[{json.dumps(TRAIN[0])},\n{line}]")
    with pytest.raises(UserError, match=f"rows.json line 2: expected a JSON object, got {name}$"):
        rows_of(str(listed))


def test_a_missing_directory_path_is_named_as_a_path_not_a_hub_dataset(tmp_path, monkeypatch) -> None:
    """./data_typo (no suffix) went to datasets as a Hub id: 'HF_HUB_OFFLINE is set ... hf download ./data_typo'."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for name in ("./no_such_data_dir", str(tmp_path / "gone")):
        spec, = parse_mixer_list([name, "1.0"], ["train"])
        with pytest.raises(UserError) as raised:
            source_identity(spec)
        assert str(raised.value) == f"--dataset_mixer_list: data directory {name} does not exist; check the path"
