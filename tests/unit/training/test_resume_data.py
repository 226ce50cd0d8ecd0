"""A resume whose tokenized data are not its checkpoint's (another --dataset_mixer_list) is refused before the data
are tokenized and the model loaded, naming the flag with its value in the checkpoint and now beside the other
differences: it was refused after both, as 'the tokenized data (cache key of --dataset_mixer_list, ...):
checkpoint '9dcf…', now '666d…''."""

from __future__ import annotations

import json

import pytest

from open_sft.config.args import DataArguments
from open_sft.config.parse import parse_config
from open_sft.data import prepare
from open_sft.distributed.parallelism import Parallelism
from open_sft.errors import UserError
from open_sft.training.resume import changed_data_refusal, check_compatible, run_identity
from open_sft.training.run_settings import settings

ONE = Parallelism(engine="single")
KEY_LINE = "the tokenized data (cache key of --dataset_mixer_list, tokenizer, chat template, --max_seq_length, ...)"
WAYS = ("Relaunch with the checkpoint's settings to continue that run, or start over with --resume_from_checkpoint "
        "none (earlier checkpoints are moved aside) or another --output_dir.")


def test_other_data_are_refused_before_they_are_tokenized_naming_the_flag(tmp_path, tiny_model_dir,
                                                                          monkeypatch) -> None:
    from transformers import AutoTokenizer

    monkeypatch.setenv("OPEN_SFT_CACHE", str(tmp_path / "cache"))
    rows = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}]
    for name in ("chat.jsonl", "math.jsonl"):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows * 3))
    chat, math = str(tmp_path / "chat.jsonl"), str(tmp_path / "math.jsonl")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}"
    first = prepare.prepare_data(DataArguments(dataset_mixer_list=[chat, "1.0"]), tokenizer, 0)

    def config(*flags: str):
        return parse_config(["--model_name_or_path", str(tiny_model_dir), "--output_dir", str(tmp_path / "out"),
                             "--dataset_mixer_list", *flags])

    then = config(chat, "1.0")
    state = {"step": 10, "identity": run_identity(then, first.cache_key, ONE), "peeked_from": "out/checkpoints/step_10",
             "config": {**then.to_dict(), "settings_by_steps": [{"from_step": 1, "settings": settings(then)}]}}
    now = config(chat, "1.0", math, "1.0", "--per_device_train_batch_size", "4")
    monkeypatch.setattr(prepare, "build_dataset", lambda *a: pytest.fail("tokenized data a resume refuses"))
    with pytest.raises(prepare.ResumedDataDiffer) as info:
        prepare.prepare_run_data(now.data, tokenizer, 0, resuming=state)
    assert (info.value.recorded, info.value.key != first.cache_key) == (first.cache_key, True)
    refusal = changed_data_refusal(state, settings(now), run_identity(now, info.value.key, ONE))
    assert str(refusal) == (
        "cannot resume from out/checkpoints/step_10: it was written with different settings:\n"
        f"  - --dataset_mixer_list: {[chat, '1.0']!r} in the checkpoint, {[chat, '1.0', math, '1.0']!r} now\n"
        f"  - --per_device_train_batch_size: checkpoint 8, now 4\n{WAYS}")
    # what the resume itself says, after the data and the model, of the same two (the same list, the keys)
    with pytest.raises(UserError) as late:
        check_compatible("out/checkpoints/step_10", state["identity"], run_identity(now, info.value.key, ONE))
    assert str(late.value).splitlines()[1] == f"  - {KEY_LINE}: checkpoint {first.cache_key!r}, now {info.value.key!r}"
    assert str(late.value).splitlines()[2:] == str(refusal).splitlines()[2:]
    # the same flags, a source's contents changed: the keys, said so
    refusal = changed_data_refusal(state, settings(then), run_identity(then, "666d", ONE))
    assert f"  - {KEY_LINE}: checkpoint {first.cache_key!r}, now '666d' (no flag that shapes them changed: a " \
           "source file's contents, the tokenizer's files or the chat template did, or open_sft's tokenized data " \
           "changed with an upgrade (its cache format, or a text-only mixture's key without the chat template: since " \
           "cache format 43 for .txt and JSON Lines sources, since a later upgrade for parquet files and save_to_disk " \
           "directories))\n" in str(refusal)
    # another --seed (it enters the key, and is an identity setting of its own): named once, no keys
    seeded = config(chat, "1.0", "--seed", "7")
    refusal = str(changed_data_refusal(state, settings(seeded), run_identity(seeded, "666d", ONE)))
    assert refusal.count("--seed") == 1 and "--seed: 42 in the checkpoint, 7 now" in refusal and KEY_LINE not in refusal
    # a run with betas of its own (an OLMo-core line's --adam_beta2 0.95) whose source changed: no flag named, the
    # keys (the settings a refusal of data compares are the data's: the betas were named, the cause left out)
    own = config(chat, "1.0", "--adam_beta2", "0.95")
    beta_state = {**state, "config": {**own.to_dict(), "settings_by_steps": [{"from_step": 1,
                                                                              "settings": settings(own)}]}}
    refusal = str(changed_data_refusal(beta_state, settings(own), run_identity(own, "666d", ONE)))
    assert "adam" not in refusal and "(no flag that shapes them changed: a source file's contents" in refusal
    # the checkpoint's own data: no refusal, its cache entry
    assert prepare.prepare_run_data(then.data, tokenizer, 0, resuming=state)[0].cache_key == first.cache_key


def test_every_flag_the_cache_key_reads_is_one_a_changed_data_refusal_names(tmp_path, tiny_model_dir,
                                                                            monkeypatch) -> None:
    """resume.DATA_FLAGS is kept beside cache_inputs.key_inputs by hand: a flag the key reads that it lacks would be
    refused by two SHA-256 keys instead of by name. Every DataArguments field key_inputs reads (through the chat
    options and the mixer list too) is in DATA_FLAGS, but where the cache lives."""
    import dataclasses

    from transformers import AutoTokenizer

    from open_sft.data.cache_inputs import key_inputs
    from open_sft.training.resume import DATA_FLAGS

    monkeypatch.setenv("OPEN_SFT_CACHE", str(tmp_path / "cache"))
    (tmp_path / "chat.jsonl").write_text('{"messages": [{"role": "user", "content": "Hi"}]}\n')
    args = DataArguments(dataset_mixer_list=[str(tmp_path / "chat.jsonl"), "1.0"])
    read: set[str] = set()

    class Reading:
        def __getattr__(self, name: str):
            read.add(name)
            return getattr(args, name)

    key_inputs(Reading(), AutoTokenizer.from_pretrained(tiny_model_dir), 0, holdout=("train", 0.1))
    fields = {field.name for field in dataclasses.fields(DataArguments)}
    where_the_cache_lives = {"dataset_skip_cache", "dataset_local_cache_dir"}
    assert read & fields >= {"dataset_mixer_list", "max_seq_length", "train_on"}  # the probe sees the reads
    assert (read & fields) - where_the_cache_lives <= DATA_FLAGS, sorted((read & fields) - DATA_FLAGS)
