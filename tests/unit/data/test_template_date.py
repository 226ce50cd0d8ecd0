"""A chat template that writes today's date (Llama 3.1/3.2's "Today Date: 06 Dec 2026", transformers'
strftime_now) makes other tokens every day: the cache key holds the date it writes, and a resume on another day
keeps its own data (reused from the cache, or built again and the resume goes on), not refused for the date."""

from __future__ import annotations

import datetime
import json

import pytest
from transformers import AutoTokenizer
from transformers.utils import chat_template_utils

from open_sft.config.args import DataArguments
from open_sft.data import cache
from open_sft.data.cache_inputs import key_inputs
from open_sft.data.prepare import ResumedDataDiffer, prepare_data
from open_sft.data.template_date import dates_of

DATED = ("{{ bos_token }}{% set today = strftime_now('%d %b %Y') %}"
         "{% for m in messages %}<|{{ m.role }}|>Today Date: {{ today }}\n{{ m.content }}{{ eos_token }}{% endfor %}"
         "{% if add_generation_prompt %}<|assistant|>Today Date: {{ today }}\n{% endif %}")


def on_day(monkeypatch, day: int) -> None:
    """transformers' strftime_now reads its module's datetime.now(): that day of December 2026."""
    class Day(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime.datetime(2026, 12, day, 9, 0, 0)
    monkeypatch.setattr(chat_template_utils, "datetime", Day)


@pytest.fixture()
def dated(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = DATED
    return tokenizer


@pytest.fixture()
def args(tmp_path, monkeypatch) -> DataArguments:
    monkeypatch.setenv("OPEN_SFT_CACHE", str(tmp_path / "cache"))
    rows = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return DataArguments(dataset_mixer_list=[str(data), "1.0"], dataset_local_cache_dir=str(tmp_path / "cache"))


def test_the_cache_key_holds_the_date_the_template_writes(dated, tiny_model_dir, args, monkeypatch, caplog) -> None:
    """The key ignored the date: a rebuild on day 2 (a requeue onto a node-local cache) made other tokens under
    day 1's key, and a shared cache served day 1's tokens on day 2. A template without a clock: the key as before."""
    keys = []
    for day in (6, 6, 7):
        on_day(monkeypatch, day)
        with caplog.at_level("INFO", logger="open_sft.data.template_date"):
            inputs = key_inputs(args, dated, 0)
        keys.append(cache.cache_key(inputs))
    assert inputs["template_date"] == {"%d %b %Y": "07 Dec 2026"}
    assert keys[0] == keys[1] != keys[2]
    assert "the chat template writes today's date into every example" in caplog.text
    plain = AutoTokenizer.from_pretrained(tiny_model_dir)
    plain.chat_template = DATED.replace("strftime_now('%d %b %Y')", "'26 Jul 2024'")
    assert "template_date" not in key_inputs(args, plain, 0)


def test_a_resume_on_another_day_keeps_its_data(dated, args, monkeypatch, caplog) -> None:
    """Day 1 builds; the checkpoint records the key and the date (run_identity, from dates_of). Day 2's resume: the
    entry is reused (day 1's tokens, the run's key); without it in the cache, today's are built and the resume goes
    on under the run's key, with a warning. Another change (max_seq_length) is not taken for the date."""
    on_day(monkeypatch, 6)
    first = prepare_data(args, dated, 0)
    assert "06 Dec 2026" in dated.decode(first.dataset[0]["input_ids"])
    resuming = {"identity": {"dataset_cache_key": first.cache_key, "template_date": dates_of(first.cache_key)}}
    on_day(monkeypatch, 7)
    assert prepare_data(args, dated, 0).cache_key != first.cache_key  # a fresh run: today's entry
    with caplog.at_level("INFO", logger="open_sft.data.prepare"):
        resumed = prepare_data(args, dated, 0, resuming=resuming)
    assert (resumed.cache_key, resumed.cache_path, resumed.cache_hit) == (first.cache_key, first.cache_path, True)
    assert "06 Dec 2026" in dated.decode(resumed.dataset[0]["input_ids"]) and "are reused" in caplog.text
    import shutil

    shutil.rmtree(first.cache_path)
    rebuilt = prepare_data(args, dated, 0, resuming=resuming)
    assert rebuilt.cache_key == first.cache_key and rebuilt.cache_path != first.cache_path
    assert "07 Dec 2026" in dated.decode(rebuilt.dataset[0]["input_ids"]) and "the resume goes on" in caplog.text
    with pytest.raises(ResumedDataDiffer) as info:  # refused before tokenizing (open_sft.run names the flag)
        prepare_data(DataArguments(**{**vars(args), "max_seq_length": 100}), dated, 0, resuming=resuming)
    assert info.value.recorded == first.cache_key != info.value.key


def test_the_checkpoint_records_the_date_and_a_resume_does_not_compare_it(dated, args, monkeypatch) -> None:
    """run_identity carries the dates of the run's own key (what the resume above reads), and check_compatible
    does not compare them: the key alone says whether the data are the run's."""
    from open_sft.config.parse import parse_config
    from open_sft.distributed.parallelism import Parallelism
    from open_sft.training.resume import check_compatible, run_identity

    on_day(monkeypatch, 6)
    key = prepare_data(args, dated, 0).cache_key
    config = parse_config(["--model_name_or_path", "m", "--dataset_mixer_list", "d.jsonl", "1.0", "--output_dir", "o"])
    identity = run_identity(config, key, Parallelism("single"))
    assert identity["template_date"] == {"%d %b %Y": "06 Dec 2026"}
    assert "template_date" not in run_identity(config, "another key", Parallelism("single"))
    check_compatible(args.dataset_local_cache_dir, {**identity, "template_date": {"%d %b %Y": "05 Dec 2026"}}, identity)


def test_a_run_whose_data_build_crosses_midnight_writes_one_date(dated, args, monkeypatch) -> None:
    """The clock was read for the key and again by every render: a build crossing midnight wrote the next day into
    examples whose key (and checkpoint record) held the day before, and an evaluation side built after midnight
    another date than the training side. The run reads the clock once: its key, its training and its evaluation
    examples hold that one date."""
    from open_sft.data.prepare import prepare_run_data

    reads = iter(range(10**6))

    class Midnight(datetime.datetime):  # the first reading is the last second of 6 December, the rest the 7th
        @classmethod
        def now(cls, tz=None):
            return datetime.datetime(2026, 12, 6, 23, 59, 59) if next(reads) == 0 else datetime.datetime(2026, 12, 7)
    monkeypatch.setattr(chat_template_utils, "datetime", Midnight)
    rows = [{"messages": [{"role": "user", "content": f"Hi {n}"}, {"role": "assistant", "content": "Hello"}]}
            for n in range(20)]
    data = args.dataset_mixer_list[0]
    with open(data, "w") as out:
        out.write("".join(json.dumps(r) + "\n" for r in rows))
    train, evaluation = prepare_run_data(DataArguments(**{**vars(args), "eval_split_ratio": 0.25}), dated, 0)
    texts = [dated.decode(ids) for prepared in (train, evaluation) for ids in prepared.dataset["input_ids"]]
    assert len(texts) == 20 and all("06 Dec 2026" in text and "07 Dec" not in text for text in texts)
    assert dates_of(train.cache_key) == dates_of(evaluation.cache_key) == {"%d %b %Y": "06 Dec 2026"}
    assert chat_template_utils.datetime is Midnight  # the live clock is back after the builds


def test_a_rank_that_read_the_next_day_takes_the_main_ranks_data(dated, args, monkeypatch, caplog) -> None:
    """Ranks read the clock at the data phase, before they can talk: a rank started just after midnight made data
    of the 7th while the main rank's were of the 6th. Once there is a process group (the main rank's clock
    broadcast), that rank takes the main rank's data: its cache entry, the same key; a rank of the same day keeps
    its own."""
    from open_sft.data import prepare
    from open_sft.distributed import collectives

    main = datetime.datetime(2026, 12, 6, 23, 59, 59)
    on_day(monkeypatch, 6)
    main_data, _ = prepare.prepare_run_data(args, dated, 0, clock=main)  # the main rank's build
    on_day(monkeypatch, 7)
    late, _ = prepare.prepare_run_data(args, dated, 0)
    assert late.cache_key != main_data.cache_key
    monkeypatch.setattr(collectives, "broadcast_object", lambda value: main)  # what rank 0 sends
    with caplog.at_level("WARNING", logger="open_sft.data.prepare"):
        taken, _ = prepare.on_main_clock(args, dated, 0, None, late, None)
    assert (taken.cache_key, taken.cache_hit) == (main_data.cache_key, True) and "main rank's data" in caplog.text
    assert "06 Dec 2026" in dated.decode(taken.dataset[0]["input_ids"])
    same_day = prepare.prepare_run_data(args, dated, 0, clock=datetime.datetime(2026, 12, 6, 23, 59, 58))[0]
    assert prepare.on_main_clock(args, dated, 0, None, same_day, None)[0] is same_day
