#!/usr/bin/env python
"""Data preparation speed: tokenization-cache build (rows/s, tokens/s) against the raw tokenizer's batch
encode of the same rendered text, and the cache-hit load time.

    python scripts/benchmark_data.py                              # 100k generated rows, the embedded tokenizer
    python scripts/benchmark_data.py --tokenizer DIR --data rows.jsonl --chat_template_name tulu

The machine may be shared, so each repeat times the raw encode right before its build (into a fresh
cache directory); the reported times are medians and the ratio is that of the medians. The raw encode
is timed twice per repeat, as Python runs it by default and with the garbage collector paused (as the
build runs, and faster): `build_over_raw_tokenizer` is against the paused time, the physical limit, and
`build_over_raw_tokenizer_gc_on` against the default.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # open_sft from this checkout, installed or not
from open_sft.config.whole_flags import WholeFlagParser  # noqa: E402


def training_tokenizer(path: str, chat_template_name: str | None):
    """The tokenizer as finetune.py loads it (open_sft.model.tokenizer.load_tokenizer: a bare tokenizer.json's eos
    and pad filled in, so templates end turns with eos as training's do) with the run's chat template. A
    `tokenizers` JSON file (which finetune.py refuses) is loaded as the directory holding only it that its refusal
    says to make."""
    import shutil

    from open_sft.config.args import ModelArguments
    from open_sft.data.chat.templates import apply_chat_template_choice
    from open_sft.model.tokenizer import load_tokenizer

    if Path(path).is_file():
        with tempfile.TemporaryDirectory() as directory:
            shutil.copy(path, Path(directory) / "tokenizer.json")
            tokenizer = load_tokenizer(ModelArguments(model_name_or_path=directory))
    else:
        tokenizer = load_tokenizer(ModelArguments(model_name_or_path=path))
    apply_chat_template_choice(tokenizer, chat_template_name, None)
    return tokenizer


def main() -> int:
    parser = WholeFlagParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: build the embedded one)")
    parser.add_argument("--data", default=None,
                        help="messages/alpaca/sharegpt/text JSONL or JSON (default: generated rows)")
    parser.add_argument("--rows", type=int, default=100_000, help="rows to generate when --data is not given")
    parser.add_argument("--chat_template_name", default=None)
    parser.add_argument("--max_seq_length", type=int, default=2048)
    parser.add_argument("--preprocessing_num_workers", type=int, default=None,
                        help="as finetune.py's (default: unset, one per usable core)")
    parser.add_argument("--repeat", type=int, default=5, help="timed builds (each after a timed raw encode)")
    args = parser.parse_args()

    from open_sft.config.args import DataArguments
    from open_sft.data.documents import to_text
    from open_sft.data.format_detect import detect_format
    from open_sft.data.formats import to_messages
    from open_sft.data.prepare import prepare_data
    from open_sft.data.chat.render import render
    from open_sft.data.sources import parse_mixer_list, read_source

    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        if args.tokenizer is None:
            from open_sft.embedded.factory import build_embedded_default

            args.tokenizer = str(build_embedded_default(tmp_path / "model", hidden_size=32, num_layers=1))
        tokenizer = training_tokenizer(args.tokenizer, args.chat_template_name)
        if args.data is None:
            from open_sft.embedded.sample_data import generate_examples, write_jsonl

            args.data = str(write_jsonl(generate_examples(args.rows, seed=7), tmp_path / "rows.jsonl"))

        rows = read_source(parse_mixer_list([args.data, "1.0"], ["train"])[0]).rows
        fmt = detect_format(rows[0], args.data)
        if fmt == "text":  # documents for continual pretraining: encoded as they are
            texts = [to_text(r) for r in rows]
        else:
            texts = [render(tokenizer, m, tools=m.tools) for m in (to_messages(r, fmt) for r in rows)]
        del rows  # the raw encode runs with only the texts alive, so the collector has little to walk

        raw_times, raw_gc_times, build_times = [], [], []
        for attempt in range(args.repeat):
            started = time.perf_counter()
            encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
            raw_gc_times.append(time.perf_counter() - started)
            del encoded
            gc.disable()
            started = time.perf_counter()
            encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
            raw_times.append(time.perf_counter() - started)
            gc.enable()
            raw_tokens = sum(len(ids) for ids in encoded)
            del encoded  # the build runs without the raw encode's millions of objects alive (its workers fork)
            data_args = DataArguments(dataset_mixer_list=[args.data, "1.0"], max_seq_length=args.max_seq_length,
                                      dataset_local_cache_dir=str(tmp_path / f"cache{attempt}"),
                                      preprocessing_num_workers=args.preprocessing_num_workers)
            started = time.perf_counter()
            built = prepare_data(data_args, tokenizer, 0)
            build_times.append(time.perf_counter() - started)
        started = time.perf_counter()
        hit = prepare_data(data_args, tokenizer, 0)
        _ = hit.dataset[len(hit) - 1]  # touch the memory map
        hit_s = time.perf_counter() - started

    build_s, raw_s, raw_gc_s = (statistics.median(t) for t in (build_times, raw_times, raw_gc_times))
    tokens = built.report["tokens"]
    rows = sum(source["rows_in"] for source in built.report["sources"])  # read; examples: made (text: blocks)
    print(json.dumps({
        "rows": rows, "examples": len(built), "tokens": tokens,
        "build_s": round(build_s, 2), "build_rows_per_s": round(rows / build_s),
        "build_tokens_per_s": round(tokens / build_s),
        "raw_tokenizer_tokens_per_s": round(raw_tokens / raw_s),
        "build_over_raw_tokenizer": round((tokens / build_s) / (raw_tokens / raw_s), 3),
        "build_over_raw_tokenizer_gc_on": round((tokens / build_s) / (raw_tokens / raw_gc_s), 3),
        # each repeat's ratio (its raw encode ran just before its build): how much the machine's noise moves it
        "build_over_raw_each": [round(raw / build, 3) for raw, build in zip(raw_times, build_times)],
        "build_s_each": [round(t, 2) for t in build_times], "raw_s_each": [round(t, 2) for t in raw_times],
        "raw_gc_on_s_each": [round(t, 2) for t in raw_gc_times],
        "cache_hit_load_s": round(hit_s, 3), "cache_hit": hit.cache_hit,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
