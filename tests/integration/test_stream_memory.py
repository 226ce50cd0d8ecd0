"""A streaming build's memory is bounded by its chunk, not by the corpus.

Two corpora, one six times the other and each many chunks long (chunks of 200 rows), are built each in a
fresh process that samples its own anonymous memory (RssAnon: the heap and arrays, not the file pages of
memory-mapped data) above its level after a warm-up build; the in-memory build of the same corpora, measured the
same way, is the control that shows the measurement sees a corpus held whole."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT, child_env

MEASURE = r"""
import json, sys, tempfile, threading, time
from pathlib import Path
from transformers import AutoTokenizer
from open_sft.config.args import DataArguments
from open_sft.data import chunks, in_memory, local_files, prepare, spill
from open_sft.data.build import build_sources

def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024

def peak(fn):
    best, done = [anon()], threading.Event()
    def sample():
        while not done.wait(0.005):
            best.append(anon())
    thread = threading.Thread(target=sample)
    thread.start()
    start = anon()
    try:
        fn()
    finally:
        done.set()
        thread.join()
    return max(best) - start

chunks.CHUNK_ROWS = 200
local_files.READ_BYTES = 1 << 16  # blocks read far smaller than the corpus, as for a corpus of many GB
spill.BATCH_TOKENS = 1 << 12  # Arrow batches written far smaller than the corpus (4 M tokens: a bounded ~130 MB)
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
row = json.loads(open(sys.argv[2]).readline())
mode, rows = sys.argv[3], int(sys.argv[4])

def corpus(rows):
    path = Path(tempfile.mkdtemp()) / f"corpus{rows}.jsonl"
    with path.open("w") as handle:
        for i in range(rows):
            # varied rows from a bounded set of words: the tokenizer's own word cache (bounded, ~10k words)
            # fills up with every new word, which is not the build's memory
            turns = [dict(m, content=f"{m['content']} {i % 97} " * (20 + i % 5)) for m in row["messages"]]
            handle.write(json.dumps({"messages": turns}) + "\n")
    return DataArguments(dataset_mixer_list=[str(path), "1.0"], max_seq_length=4096, preprocessing_num_workers=1)

def build(args):
    with prepare._gc_paused():  # as prepare_data builds
        if mode == "stream":
            tmp = Path(tempfile.mkdtemp())
            build_sources(args, tokenizer, 0, None, tmp / "data", tmp / "spill")[0].finish("")
        else:
            in_memory.build_rows(args, tokenizer, 0)

build(corpus(400))  # one-time allocations (the tokenizer's tables, the template, imports) before the baseline
args = corpus(rows)
print(json.dumps({"peak": peak(lambda: build(args)), "bytes": Path(args.dataset_mixer_list[0]).stat().st_size}))
"""


def measure(tiny_model_dir, mode: str, rows: int) -> dict:
    from conftest import SAMPLE

    result = subprocess.run([sys.executable, "-c", MEASURE, str(tiny_model_dir), str(SAMPLE), mode, str(rows)],
                            cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_streaming_memory_does_not_grow_with_the_corpus(tiny_model_dir) -> None:
    m = {(mode, rows): measure(tiny_model_dir, mode, rows) for mode in ("stream", "memory") for rows in (2000, 12000)}
    corpus_growth = m["stream", 12000]["bytes"] - m["stream", 2000]["bytes"]
    held_growth = m["memory", 12000]["peak"] - m["memory", 2000]["peak"]
    stream_growth = m["stream", 12000]["peak"] - m["stream", 2000]["peak"]
    # the control: holding the corpus whole costs at least half its extra bytes more
    assert held_growth > corpus_growth / 2, m
    # streaming: 50 extra chunks cost less than a tenth of what holding them does (a few numbers per row)
    assert stream_growth < held_growth / 10, m
    print(json.dumps({f"{mode}_{rows}": v for (mode, rows), v in m.items()}))
