"""Compressed local data files (.gz, .bz2, .xz, .zst): read as the inner suffix says, decompressed a block at a time,
giving the plain file's examples bit for bit; a bad line named by its line in the decompressed text; a cut-short
or damaged archive a UserError naming the file."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import random
import zlib

import datasets
import pytest
import zstandard
from transformers import AutoTokenizer

from conftest import SAMPLE
from open_sft.config.args import DataArguments
from open_sft.data import chunks, local_files, spill
from open_sft.data.build import build_sources
from open_sft.data.in_memory import build_rows
from open_sft.data.mixer import source_names
from open_sft.data.sources import parse_mixer_list, read_source, source_identity
from open_sft.errors import UserError

LINES = SAMPLE.read_text().splitlines()[:40]
COMPRESS = {"gz": gzip.compress, "bz2": lambda data: bz2.compress(data, 3), "xz": lzma.compress,
            "zst": lambda data: zstandard.ZstdCompressor().compress(data)}
NAMES = {"gz": "gzip", "bz2": "bzip2", "xz": "xz", "zst": "Zstandard"}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(chunks, "CHUNK_ROWS", 7)
    monkeypatch.setattr(local_files, "READ_BYTES", 300)
    monkeypatch.setattr(spill, "SHARD_BYTES", 2000)


def write(path, text: str, kind: str | None = None):
    data = text.encode()
    path.write_bytes(COMPRESS[kind](data) if kind else data)
    return str(path)


def built(files: list[str], tokenizer, tmp_path, streamed: bool, **more):
    args = DataArguments(dataset_mixer_list=[x for f in files for x in (f, "1.0")], max_seq_length=64, **more)
    if streamed:
        writer, reports = build_sources(args, tokenizer, 3, None, tmp_path / "data", tmp_path / "spill")
        writer.finish("")
        table = datasets.load_from_disk(str(tmp_path / "data")).data.table
        ids, labels = table["input_ids"].to_pylist(), table["labels"].to_pylist()
    else:
        rows, reports = build_rows(args, tokenizer, 3)
        ids = [rows.ids[rows.bounds[r]: rows.bounds[r + 1]].tolist() for r in range(len(rows))]
        labels = [rows.labels[rows.bounds[r]: rows.bounds[r + 1]].tolist() for r in range(len(rows))]
    return ids, labels, [{**r.to_dict(), "name": "x"} for r in reports]


@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize("kind", sorted(COMPRESS))
def test_a_compressed_file_gives_the_plain_files_examples(kind, streamed, tokenizer, tmp_path, small_chunks) -> None:
    """chat.jsonl.KIND (chat rows), web.json.KIND (Dolma: one object per line in a .json file) and corpus.txt.KIND
    (blank-line-separated documents) give the tokens, labels and reports of the same files uncompressed."""
    web = "".join(json.dumps({"id": f"d{k}", "text": f"Document {k}. " * (k % 5 + 1)}) + "\n" for k in range(30))
    corpus = "\n\n".join(f"Paragraph {k} line one.\nline two of {k}." for k in range(25)) + "\n"
    plain = [write(tmp_path / "chat.jsonl", "\n".join(LINES) + "\n"), write(tmp_path / "web.json", web),
             write(tmp_path / "corpus.txt", corpus)]
    packed = [write(tmp_path / f"chat.jsonl.{kind}", "\n".join(LINES) + "\n", kind),
              write(tmp_path / f"web.json.{kind}", web, kind), write(tmp_path / f"corpus.txt.{kind}", corpus, kind)]
    (tmp_path / "plain").mkdir(), (tmp_path / "packed").mkdir()
    expected = built(plain, tokenizer, tmp_path / "plain", streamed)
    got = built(packed, tokenizer, tmp_path / "packed", streamed)
    assert len(got[0]) > 0 and got == expected
    assert [(r["format"], r["rows_in"]) for r in got[2]] == [("messages", 40), ("text", 30), ("text", 25)]
    # the first chat row's tokens, decoded: the compressed file's text, rendered by the tiny chat template
    assert tokenizer.decode(got[0][0]) == tokenizer.decode(expected[0][0])
    assert got[0][0] == expected[0][0] and got[1][0] == expected[1][0]


def test_rows_and_their_line_numbers_and_names(tmp_path) -> None:
    text = "\n\n".join(["first doc\n  its second line", "second doc", "third"]) + "\n"
    spec, = parse_mixer_list([write(tmp_path / "c.txt.xz", text, "xz"), "1.0"], ["train"])
    source = read_source(spec)
    assert source.rows == [{"text": "first doc\n  its second line"}, {"text": "second doc"}, {"text": "third"}]
    assert source.line_numbers == [1, 4, 6]
    assert source_names(["data/web.jsonl.gz", "web.json.zst", "notes.txt.bz2", "a.b.jsonl"]) == \
        ["web", "web_2", "notes", "a.b"]


@pytest.mark.parametrize("kind", sorted(COMPRESS))
def test_a_bad_line_is_named_by_its_line_in_the_decompressed_text(kind, tokenizer, tmp_path, small_chunks) -> None:
    bad = list(LINES)
    bad[12] = "{not json"
    path = write(tmp_path / f"bad.jsonl.{kind}", "\n".join(bad) + "\n", kind)
    args = DataArguments(dataset_mixer_list=[path, "1.0"], max_seq_length=64)
    message = rf"bad\.jsonl\.{kind} line 13: not valid JSON"
    with pytest.raises(UserError, match=message):
        build_sources(args, tokenizer, 3, None, tmp_path / "data", tmp_path / "spill")
    with pytest.raises(UserError, match=message):
        build_rows(args, tokenizer, 3)
    latin = "\n".join(LINES[:5]).encode() + b"\n" + '{"text": "caf\u00e9"}\n'.encode("latin1")
    (tmp_path / f"latin.jsonl.{kind}").write_bytes(COMPRESS[kind](latin))
    spec, = parse_mixer_list([str(tmp_path / f"latin.jsonl.{kind}"), "1.0"], ["train"])
    unpack = {"gz": "zcat", "bz2": "bzcat", "xz": "xzcat", "zst": "zstdcat"}[kind]
    pack = {"gz": "gzip", "bz2": "bzip2", "xz": "xz", "zst": "zstd"}[kind]
    with pytest.raises(UserError, match=rf"latin\.jsonl\.{kind} line 6: not UTF-8 \(byte 0xe9 at column 14\); data "
                                        rf"files must be UTF-8: re-encode it, e\.g\. {unpack} \S+latin\.jsonl\.{kind} "
                                        rf"\| iconv -f latin1 -t utf-8 \| {pack} > latin\.utf8\.jsonl\.{kind}$"):
        read_source(spec)


@pytest.mark.parametrize("kind", sorted(COMPRESS))
def test_a_cut_short_archive_says_so_naming_the_file(kind, tokenizer, tmp_path, small_chunks) -> None:
    """Half of the compressed bytes: the stream ends inside, after some of its 2,000 lines (how many depends on the
    compressor's blocks), never a traceback nor rows cut off in silence; streamed and read whole alike."""
    rng = random.Random(0)
    words = [f"w{k}" for k in range(5000)]
    text = "".join(json.dumps({"text": " ".join(rng.choices(words, k=80))}) + "\n" for _ in range(2000))
    whole = COMPRESS[kind](text.encode())  # 0.95 MB of text; bzip2 (level 3) in 4 blocks
    path = tmp_path / f"cut.jsonl.{kind}"
    path.write_bytes(whole[:len(whole) // 2])
    args = DataArguments(dataset_mixer_list=[str(path), "1.0"], max_seq_length=64)
    message = (rf"cut\.jsonl\.{kind}: the {NAMES[kind]} stream ends before its end \(after line [1-9]\d* of its "
               r"text\): the file is cut short \(an interrupted download or copy\); fetch it again")
    with pytest.raises(UserError, match=message):
        build_sources(args, tokenizer, 3, None, tmp_path / "data", tmp_path / "spill")
    with pytest.raises(UserError, match=message):
        build_rows(args, tokenizer, 3)
    assert not (tmp_path / "data").exists() or not list((tmp_path / "data").glob("*.arrow"))


# bytes cut off the end, inside the archive's trailer (gzip's CRC and size, bzip2's end-of-stream marker and CRC,
# xz's index and footer, the content checksum the zstd command writes): all of the text can be decompressed
TRAILER_CUT = {"gz": 6, "bz2": 6, "xz": 6, "zst": 3}


@pytest.mark.parametrize("kind", sorted(COMPRESS))
def test_a_small_archive_cut_in_its_trailer_names_its_last_whole_line(kind, tmp_path) -> None:
    """300 short JSON lines, all decompressed before the end is found missing: the read that hit the end threw away
    what it had decompressed, and the message said the stream ends 'at its start'. That text is handed back first;
    the next read raises, after line 300."""
    text = "".join(json.dumps({"text": f"row {k}"}) + "\n" for k in range(300)).encode()
    whole = zstandard.ZstdCompressor(write_checksum=True).compress(text) if kind == "zst" else COMPRESS[kind](text)
    path = tmp_path / f"cut.jsonl.{kind}"
    path.write_bytes(whole[:-TRAILER_CUT[kind]])
    spec, = parse_mixer_list([str(path), "1.0"], ["train"])
    with pytest.raises(UserError, match=rf"cut\.jsonl\.{kind}: the {NAMES[kind]} stream ends before its end \(after "
                                        r"line 300 of its text\): the file is cut short"):
        read_source(spec)


@pytest.mark.parametrize("kind, detail", [("gz", "Not a gzipped file"), ("bz2", "Invalid data stream"),
                                          ("xz", "Input format not supported by decoder"),
                                          ("zst", "Unknown frame descriptor")])
def test_a_file_that_is_not_its_compression_is_named(kind, detail, tmp_path) -> None:
    """A plain JSON Lines file named .KIND: what the decompressor says, and that an uncompressed file drops it."""
    spec, = parse_mixer_list([write(tmp_path / f"plain.jsonl.{kind}", "\n".join(LINES) + "\n"), "1.0"], ["train"])
    with pytest.raises(UserError, match=rf"plain\.jsonl\.{kind}: not a readable {NAMES[kind]} file \(.*{detail}.*; "
                                        rf"at its start\); check the file: a damaged copy, or another format named "
                                        rf"\.{kind} \(an uncompressed file is named without it\)"):
        read_source(spec)


def test_the_cache_key_is_the_compressed_bytes_and_other_suffixes_are_refused(tmp_path) -> None:
    text = "\n".join(LINES) + "\n"
    keys = {kind: source_identity(parse_mixer_list([write(tmp_path / f"a.jsonl.{kind}", text, kind), "1.0"],
                                                   ["train"])[0]) for kind in COMPRESS}
    assert len(set(keys.values())) == 4  # the same rows compressed otherwise: another key (another file)
    (tmp_path / "b.jsonl.gz").write_bytes((tmp_path / "a.jsonl.gz").read_bytes())
    assert source_identity(parse_mixer_list([str(tmp_path / "b.jsonl.gz"), "1.0"], ["train"])[0]) == keys["gz"]
    datasets.Dataset.from_list([{"text": "x"}]).to_parquet(str(tmp_path / "t.parquet"))
    (tmp_path / "t.parquet.gz").write_bytes(gzip.compress((tmp_path / "t.parquet").read_bytes()))
    spec, = parse_mixer_list([str(tmp_path / "t.parquet.gz"), "1.0"], ["train"])
    with pytest.raises(UserError, match=r"t\.parquet\.gz: unsupported file type '\.parquet\.gz' \(parquet compresses "
                                        r"its columns itself: decompress the file\); use one of \.jsonl, \.json, "
                                        r"\.parquet, \.txt .*may be compressed \(\.gz/\.bz2/\.xz/\.zst\)"):
        read_source(spec)
    spec, = parse_mixer_list([str(tmp_path / "gone.jsonl.zst"), "1.0"], ["train"])
    with pytest.raises(UserError, match=r"data file .*gone\.jsonl\.zst does not exist; check the path"):
        read_source(spec)


def test_a_directory_of_compressed_shards_reads_all_their_rows(tmp_path) -> None:
    """A Dolma directory (shards of .json.gz, one object per line) goes to datasets' JSON loader, which
    decompresses them: every row of every shard."""
    (tmp_path / "dolma").mkdir()
    for shard in range(2):
        write(tmp_path / "dolma" / f"part-{shard}.json.gz", "".join(json.dumps(
            {"id": f"{shard}-{k}", "text": f"doc {shard} {k}"}) + "\n" for k in range(3)), "gz")
    spec, = parse_mixer_list([str(tmp_path / "dolma"), "1.0"], ["train"])
    assert sorted(row["id"] for row in read_source(spec).rows) == ["0-0", "0-1", "0-2", "1-0", "1-1", "1-2"]


def test_a_damaged_shard_of_a_directory_is_named_with_its_last_whole_line(tokenizer, tmp_path, monkeypatch,
                                                                           caplog) -> None:
    """A directory of .jsonl.gz shards, one cut short: datasets' JSON loader said only "Compressed file ended before
    the end-of-stream marker was reached". The error names the shard, the last whole line of its text (as many as
    zlib decompresses from the cut bytes) and the fix; the build leaves no cache entry. A shard with a line that is
    not JSON is named with that line (datasets said "JSON parse error: ... in row 12", naming no file)."""
    from open_sft.data.prepare import prepare_data

    monkeypatch.setenv("OPEN_SFT_CACHE", str(tmp_path / "cache"))
    shards = tmp_path / "data"
    shards.mkdir()
    for shard in range(4):
        text = "".join(json.dumps({"id": f"{shard}-{k}", "text": f"document {k} of shard {shard}. " * 4}) + "\n"
                       for k in range(300))
        write(shards / f"train-{shard:05d}.jsonl.gz", text, "gz")
    cut = (shards / "train-00002.jsonl.gz").read_bytes()
    cut = cut[:len(cut) // 2]
    (shards / "train-00002.jsonl.gz").write_bytes(cut)
    whole = zlib.decompressobj(31).decompress(cut).count(b"\n")  # the lines gzip's own decompressor gets back
    assert 0 < whole < 300
    args = DataArguments(dataset_mixer_list=[str(shards), "1.0"], max_seq_length=64)
    with pytest.raises(UserError) as info, caplog.at_level("INFO", logger="open_sft.data.damaged_files"):
        prepare_data(args, tokenizer, 3)
    # said before the files are read again (a large corpus takes a while)
    assert f"{shards}: datasets could not read one of its 4 data files and does not say which: reading them " \
           "again, in its order, to name it" in caplog.text
    assert str(info.value) == (
        f"{shards}/train-00002.jsonl.gz: the gzip stream ends before its end (after line {whole} of its text): the "
        "file is cut short (an interrupted download or copy); fetch it again; or move that file out of the directory "
        f"{shards} to train on its other files")
    assert not [path for path in (tmp_path / "cache").iterdir() if not path.name.endswith(".lock")]

    lines = [json.dumps({"text": f"line {k}"}) for k in range(20)]
    lines[11] = '{"text": "cut here'
    write(shards / "train-00002.jsonl.gz", "\n".join(lines) + "\n", "gz")
    spec, = parse_mixer_list([str(shards), "1.0"], ["train"])
    with pytest.raises(UserError, match=rf"^{shards}/train-00002\.jsonl\.gz line 12: not valid JSON \(Unterminated "
                                        r"string starting at column 10\); each line must be one JSON object; datasets' "
                                        r"JSON loader, .* stops there \(--on_bad_row drop cannot skip it\): fix or "
                                        r"remove that line; or move that file out of the directory"):
        read_source(spec)


def test_a_cut_short_zstd_shard_of_a_directory_is_refused_not_read_short(tmp_path) -> None:
    """zstandard's stream reader (datasets' for .zst) takes a file cut inside a frame for a whole one: a directory
    whose shard was cut where its decompressed text ends with a whole line (here inside the second of two blocks)
    trained on the 3 whole shards and that shard's first 300 of 600 rows without a word. The shards are walked
    frame by frame from their headers before datasets reads them; the cut one is named with its last whole line."""
    shards = tmp_path / "data"
    shards.mkdir()
    lines = [json.dumps({"text": f"document {k}: " + "words of it " * (k % 40)}) + "\n" for k in range(600)]
    for shard in range(4):
        write(shards / f"part-{shard}.jsonl.zst", "".join(lines), "zst")
    stream = zstandard.ZstdCompressor(write_checksum=True).compressobj()
    first = stream.compress("".join(lines[:300]).encode()) + stream.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK)
    rest = stream.compress("".join(lines[300:]).encode()) + stream.flush()  # each under a block's 128 kB
    (shards / "part-1.jsonl.zst").write_bytes(first + rest[:len(rest) // 2])
    spec, = parse_mixer_list([str(shards), "1.0"], ["train"])
    with pytest.raises(UserError) as info:
        read_source(spec)
    assert str(info.value) == (
        f"{shards}/part-1.jsonl.zst: the Zstandard stream ends before its end (after line 300 of its text): the "
        "file is cut short (an interrupted download or copy); fetch it again; or move that file out of the directory "
        f"{shards} to train on its other files")


def test_a_zstd_file_ends_inside_a_frame_wherever_it_is_cut(tmp_path) -> None:
    """Frames with and without a checksum and content size, a skippable frame, RLE blocks, a frame of two compressed
    blocks: whole, the walk ends at the file's end; cut anywhere but between two frames (each byte near a frame's
    ends, every 97th elsewhere), it ends inside one."""
    from open_sft.data.damaged_files import ends_inside_a_frame

    def frames(tmp, parts: list[bytes]) -> list[int]:
        path = tmp / "x.jsonl.zst"
        data = b"".join(parts)
        path.write_bytes(data)
        assert not ends_inside_a_frame(path)
        bounds = {sum(len(p) for p in parts[:k]) for k in range(len(parts) + 1)}
        cut_inside = []
        for end in (end for end in range(1, len(data)) if end % 97 == 0 or min(abs(end - b) for b in bounds) <= 16):
            path.write_bytes(data[:end])
            if ends_inside_a_frame(path) != (end not in bounds):
                cut_inside.append(end)
        return cut_inside

    text = ("".join(json.dumps({"text": f"doc {k} " * 9}) + "\n" for k in range(2000))).encode()  # 178 kB: 2 blocks
    plain = zstandard.ZstdCompressor(write_checksum=False, write_content_size=False).compress(text[:5000])
    checked = zstandard.ZstdCompressor(level=1, write_checksum=True).compress(text)
    rle = zstandard.ZstdCompressor(write_checksum=True).compress(b"a" * 300_000)
    skippable = (0x184D2A53).to_bytes(4, "little") + (5).to_bytes(4, "little") + b"12345"
    assert frames(tmp_path, [checked, skippable, plain, rle]) == []
    (tmp_path / "y.jsonl.zst").write_bytes(b"not zstd at all")
    assert not ends_inside_a_frame(tmp_path / "y.jsonl.zst")


def test_a_shard_that_is_not_utf8_in_a_directory_is_named_not_a_traceback(tokenizer, tmp_path) -> None:
    """datasets' JSON loader takes a Latin-1 line into its Arrow strings without a word; reading that row raised
    UnicodeDecodeError out of the build (a traceback). The streamed and the in-memory build name the shard, its line
    and column, and the re-encoding."""
    shards = tmp_path / "data"
    shards.mkdir()
    for shard in range(3):
        rows = [json.dumps({"text": f"document {k} of shard {shard}"}, ensure_ascii=False) for k in range(20)]
        if shard == 1:
            rows[4] = json.dumps({"text": "un caf\u00e9 noir"}, ensure_ascii=False)
        (shards / f"part-{shard}.jsonl").write_bytes(("\n".join(rows) + "\n").encode("latin1"))
    message = (rf"^{shards}/part-1\.jsonl line 5: not UTF-8 \(byte 0xe9 at column 17\); data files must be UTF-8: "
               r"re-encode it, e\.g\. iconv -f latin1 -t utf-8 .*; or move that file out of the directory")
    args = DataArguments(dataset_mixer_list=[str(shards), "1.0"], max_seq_length=64)
    with pytest.raises(UserError, match=message):
        build_sources(args, tokenizer, 3, None, tmp_path / "out", tmp_path / "spill")
    spec, = parse_mixer_list([str(shards), "1.0"], ["train"])
    with pytest.raises(UserError, match=message):
        read_source(spec)


def test_a_directory_of_files_with_other_columns_is_not_read_again(tmp_path, monkeypatch) -> None:
    """datasets' CastError (one shard of documents, one of conversations) damages no file: its own message, with the
    hint, comes at once, without reading every shard again to look for damage."""
    from open_sft.data import sources

    shards = tmp_path / "data"
    shards.mkdir()
    write(shards / "a.jsonl.gz", json.dumps({"text": "a document"}) + "\n", "gz")
    write(shards / "b.jsonl.gz", LINES[0] + "\n", "gz")
    monkeypatch.setattr(sources, "damaged_file", lambda directory: pytest.fail(f"{directory} read again"))
    spec, = parse_mixer_list([str(shards), "1.0"], ["train"])
    with pytest.raises(UserError, match=r"could not be loaded: .*a local directory's data files must share one set of "
                                        r"columns \(one format\)$"):
        read_source(spec)
