#!/usr/bin/env python
"""Streaming build at growing corpus sizes: peak memory and throughput of the tokenization-cache build.

    python scripts/benchmark_data_scaling.py --sizes_mb 256,512,1024 --data rows.json --tokenizer tokenizer.json \
        --chat_template_name tulu

A JSON Lines corpus of each size is written from the given rows (alpaca, messages or text), repeated with
variation (each copy's first user turn or text gets the copy's number); each is built by a fresh process
exactly as `finetune.py --cache_dataset_only` builds it (prepare_data with the same arguments), which reports
its own peak RSS and its workers' (the build's only processes), its peak anonymous memory (sampled: RSS
also counts the pages of memory-mapped files it has read, which the kernel reclaims), its time, rows/s and
tokens/s. The raw
tokenizer's batch encode of the rendered text of the first rows of the corpus (all of them, up to
--raw_rows) gives the reference throughput, measured in one more process before the build and again after it
(the ratio is to their mean); then a fresh process loads the
finished cache (the start of the training run that follows). One line of JSON per size, and a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # open_sft from this checkout, installed or not
from open_sft.config.whole_flags import WholeFlagParser  # noqa: E402

BUILD = r"""
import json, resource, sys, threading, time
sys.path.insert(0, sys.argv[1])

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

peak_anon, done = [0], threading.Event()

def sample():  # the heap and arrays; RSS also counts the pages of memory-mapped files read (reclaimable)
    while not done.wait(0.2):
        peak_anon[0] = max(peak_anon[0], status("RssAnon"))

threading.Thread(target=sample, daemon=True).start()
from scripts.benchmark_data_scaling import load_tokenizer
from open_sft.config.args import DataArguments
from open_sft.data.prepare import prepare_data
tokenizer = load_tokenizer(sys.argv[2], sys.argv[3])
args = DataArguments(dataset_mixer_list=[sys.argv[4], "1.0"], max_seq_length=int(sys.argv[5]),
                     dataset_local_cache_dir=sys.argv[6])
started = time.perf_counter()
data = prepare_data(args, tokenizer, 0)
seconds = time.perf_counter() - started
mine, workers = (resource.getrusage(who).ru_maxrss * 1024 for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
done.set()
print(json.dumps({"seconds": seconds, "hit": data.cache_hit, "rows": data.report["sources"][0]["rows_in"],
                  "tokens": data.report["tokens"], "examples": len(data), "peak_rss": mine, "worker_peak_rss": workers,
                  "peak_anon": max(peak_anon[0], status("RssAnon")), "rss_file_at_end": status("RssFile")}))
"""

RAW = r"""
import json, gc, sys, time
sys.path.insert(0, sys.argv[1])
from scripts.benchmark_data_scaling import load_tokenizer
from open_sft.data.chat.render import render
from open_sft.data.documents import to_text
from open_sft.data.format_detect import detect_format
from open_sft.data.formats import to_messages
tokenizer = load_tokenizer(sys.argv[2], sys.argv[3])
rows = []
with open(sys.argv[4]) as handle:
    for line in handle:
        rows.append(json.loads(line))
        if len(rows) == int(sys.argv[5]):
            break
fmt = detect_format(rows[0], sys.argv[4])
texts = [to_text(r) for r in rows] if fmt == "text" else [render(tokenizer, to_messages(r, fmt)) for r in rows]
del rows
gc.disable()
started = time.perf_counter()
encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
seconds = time.perf_counter() - started
print(json.dumps({"rows": len(texts), "tokens": sum(map(len, encoded)), "seconds": seconds}))
"""


def load_tokenizer(path: str, template: str):
    """A tokenizer directory, or a `tokenizers` JSON file, as finetune.py loads it (benchmark_data's), with
    --chat_template_name applied."""
    from scripts.benchmark_data import training_tokenizer

    return training_tokenizer(path, template or None)


def write_corpus(rows: list[dict], path: Path, size: int) -> int:
    """Rows repeated, each copy's first user turn (or text) given the copy's number, to `size` bytes."""
    written = copy = count = 0
    with path.open("w") as handle:
        while written < size:
            for row in rows:
                varied = dict(row)
                for key in ("instruction", "text"):
                    if isinstance(varied.get(key), str):
                        varied[key] = f"{varied[key]} ({copy})"
                        break
                else:
                    messages = [dict(m) for m in varied.get("messages", [])]
                    if messages:
                        messages[0]["content"] = f"{messages[0]['content']} ({copy})"
                    varied["messages"] = messages
                line = json.dumps(varied) + "\n"
                handle.write(line)
                written += len(line.encode())
                count += 1
                if written >= size:
                    break
            copy += 1
    return count


def run(code: str, *args: str) -> dict:
    result = subprocess.run([sys.executable, "-c", code, str(ROOT), *args], capture_output=True, text=True,
                            cwd=ROOT)
    if result.returncode:
        raise SystemExit(result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = WholeFlagParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes_mb", default="64,128,256", help="corpus sizes in MB (1 MB = 2^20 bytes)")
    parser.add_argument("--data", required=True, help="rows to repeat: JSON list or JSON Lines")
    parser.add_argument("--tokenizer", required=True, help="tokenizer directory or tokenizers JSON file")
    parser.add_argument("--chat_template_name", default="")
    parser.add_argument("--max_seq_length", type=int, default=2048)
    parser.add_argument("--raw_rows", type=int, default=100_000, help="rows of the raw tokenizer reference")
    parser.add_argument("--workdir", default=None, help="where corpora and caches go (default: a temp dir)")
    args = parser.parse_args()

    text = Path(args.data).read_text()
    rows = json.loads(text) if args.data.endswith(".json") else [json.loads(line) for line in text.splitlines()]
    results = []
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        for size_mb in (int(s) for s in args.sizes_mb.split(",")):
            corpus = Path(tmp) / f"corpus_{size_mb}mb.jsonl"
            count = write_corpus(rows, corpus, size_mb << 20)
            raw = run(RAW, args.tokenizer, args.chat_template_name, str(corpus), str(args.raw_rows))
            cache = Path(tmp) / f"cache_{size_mb}"
            build = run(BUILD, args.tokenizer, args.chat_template_name, str(corpus), str(args.max_seq_length),
                        str(cache))
            after = run(RAW, args.tokenizer, args.chat_template_name, str(corpus), str(args.raw_rows))
            started = time.perf_counter()
            hit = run(BUILD, args.tokenizer, args.chat_template_name, str(corpus), str(args.max_seq_length),
                      str(cache))
            hit_wall = time.perf_counter() - started
            # the raw reference, measured before and after the build: their mean (one measurement drifts with the
            # machine's clock and load by as much as the ratio's target)
            reference = (raw["tokens"] / raw["seconds"] + after["tokens"] / after["seconds"]) / 2
            result = {"corpus_mb": size_mb, "rows": count, "tokens": build["tokens"],
                      "build_s": round(build["seconds"], 1),
                      "rows_per_s": round(build["rows"] / build["seconds"]),
                      "tokens_per_s": round(build["tokens"] / build["seconds"]),
                      "raw_tokenizer_tokens_per_s": [round(r["tokens"] / r["seconds"]) for r in (raw, after)],
                      "build_over_raw": round(build["tokens"] / build["seconds"] / reference, 3),
                      "peak_rss_mb": round(build["peak_rss"] / 2**20), "worker_peak_rss_mb": round(build["worker_peak_rss"] / 2**20),
                      "peak_anon_mb": round(build["peak_anon"] / 2**20), "rss_file_at_end_mb": round(build["rss_file_at_end"] / 2**20),
                      "cache_hit_load_s": round(hit["seconds"], 2), "cache_hit_process_s": round(hit_wall, 1),
                      "hit": hit["hit"]}
            print(json.dumps(result), flush=True)
            results.append(result)
            corpus.unlink()
    print("\n| corpus | rows | tokens | build | rows/s | tokens/s | × raw tokenizer | peak RSS (main / a worker) | "
          "peak anonymous (main) | cache hit load |\n|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['corpus_mb']} MB | {r['rows']:,} | {r['tokens']:,} | {r['build_s']} s | {r['rows_per_s']:,} | "
              f"{r['tokens_per_s']:,} | {r['build_over_raw']} | {r['peak_rss_mb']} / {r['worker_peak_rss_mb']} MB | "
              f"{r['peak_anon_mb']} MB | {r['cache_hit_load_s']} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
