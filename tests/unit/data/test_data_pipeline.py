"""Data pipeline: built-in templates' labels, formats, bad-row handling, mixer arithmetic, text blocks.

The tests of this subject that launch real processes are in tests/integration/test_data_pipeline.py.
"""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from transformers import AutoTokenizer

from open_sft.config.args import DataArguments
from open_sft.data.mixer import select_by_tokens, select_indices
from open_sft.data.build import build_examples
from open_sft.data.prepare import prepare_data
from open_sft.data.sources import SourceSpec, parse_mixer_list
from open_sft.data.chat.templates import BUILTIN_TEMPLATES, apply_chat_template_choice
from open_sft.data.labels import trained_token_runs
from open_sft.errors import UserError


CONVERSATIONS = {
    "single": [{"role": "user", "content": "What is 2 plus 3?"}, {"role": "assistant", "content": "The sum is 5."}],
    "multi": [{"role": "user", "content": "Reverse cat."}, {"role": "assistant", "content": "tac"},
              {"role": "user", "content": "Uppercase it."}, {"role": "assistant", "content": "TAC"}],
    "system": [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "3 km in m?"},
               {"role": "assistant", "content": "3000"}],
    "tool": [{"role": "user", "content": "Weather in Oslo?"}, {"role": "assistant", "content": "Calling the tool."},
             {"role": "tool", "content": "{\"temp\": 4}"}, {"role": "assistant", "content": "It is 4 degrees."}],
}


_OLMO_STYLE = ("olmo", "olmo_old", "olmo_thinker", "olmo_thinker_no_think_7b", "olmo_thinker_remove_intermediate_thinking",
               "olmo_thinker_no_think_sft_tokenization")


END_OF_TURN = {
    **dict.fromkeys(("tulu", "tulu_thinker", "tulu_thinker_r1_style", "zephyr"), ("eos", "eos")),
    **dict.fromkeys(("simple_chat", "simple_concat_with_space", "simple_concat_with_new_line"), ("", "eos")),
    **dict.fromkeys(_OLMO_STYLE, ("<|im_end|>", "eos")),
    **dict.fromkeys(("assistant_message_only", "olmo_thinker_rlzero", "olmo_thinker_code_rlzero", "r1_simple_chat",
                     "r1_simple_chat_postpend_think", "r1_simple_chat_postpend_think_orz_style",
                     "r1_simple_chat_postpend_think_tool_vllm"), ("", "")),
    **dict.fromkeys(("chatml", "qwen_instruct_user_boxed_math"), ("<|im_end|>", "<|im_end|>")),
    "llama3": ("<|eot_id|>", "<|eot_id|>"),
}


NOT_WRITTEN = {**dict.fromkeys(("tulu", "tulu_thinker", "tulu_thinker_r1_style", "zephyr", *_OLMO_STYLE), {"tool"}),
               "qwen_instruct_user_boxed_math": {"tool", "system"}}  # roles the template rejects


def expected_trained(template: str, messages: list, eos: str) -> list[str]:
    """The trained text of each assistant turn: its content and its end of turn; turns written back to
    back (assistant_message_only) are one run."""
    runs, previous = [], None
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        closing = END_OF_TURN[template][i == len(messages) - 1].replace("eos", eos)
        if previous is not None and template == "assistant_message_only":  # it writes only these turns
            runs[-1] += message["content"] + closing
        else:
            runs.append(message["content"] + closing)
        previous = i
    return runs


@pytest.fixture()
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def trained_runs(tokenizer, input_ids, labels) -> list[str]:
    return [tokenizer.decode(run) for run in trained_token_runs(input_ids, labels)]


@pytest.fixture(scope="module")
def sentencepiece_dirs(tmp_path_factory) -> dict[str, str]:
    """Llama-2-style and Metaspace tokenizers trained on the bundled sample, saved once per module."""
    from conftest import SAMPLE
    from open_sft.embedded.factory import iter_message_texts, load_rows
    from tokenizer_kinds import sentencepiece_like

    texts = list(iter_message_texts(load_rows(SAMPLE)))
    dirs = {}
    for scheme in ("llama2", "metaspace"):
        dirs[scheme] = str(tmp_path_factory.mktemp(scheme))
        sentencepiece_like(texts, scheme).save_pretrained(dirs[scheme])
    return dirs


@pytest.mark.parametrize("kind", ["byte_level", "llama2", "metaspace"])
@pytest.mark.parametrize("template", sorted(BUILTIN_TEMPLATES))
@pytest.mark.parametrize("case", sorted(CONVERSATIONS))
def test_builtin_templates_train_exactly_assistant_turns(tokenizer, sentencepiece_dirs, tmp_path, kind, template,
                                                         case) -> None:
    """Every built-in template × conversation shape × tokenizer family (byte-level BPE; SentencePiece-style
    with "▁" spaces and byte fallback, with Llama 2's normalizer or the Metaspace pre-tokenizer): the
    trained tokens decode to exactly the assistant contents, each followed by its end of turn."""
    if kind != "byte_level":
        tokenizer = AutoTokenizer.from_pretrained(sentencepiece_dirs[kind])
    apply_chat_template_choice(tokenizer, template, None)
    messages = CONVERSATIONS[case]
    data = write_jsonl(tmp_path / "d.jsonl", [{"messages": messages}])
    rejected = sorted({m["role"] for m in messages} & NOT_WRITTEN.get(template, set()))
    if rejected:
        hint = "; this template \\(OLMo's" if template.startswith("olmo") else "\\)"  # environment turns: said
        with pytest.raises(UserError, match=f"d.jsonl line 1: the chat template rejects this conversation \\(the "
                                            f"{template} chat template has no turn for role {rejected[0]}{hint}"):
            build_examples(DataArguments(dataset_mixer_list=[data, "1.0"]), tokenizer, 0)
        return
    expected = expected_trained(template, messages, tokenizer.eos_token)
    if template == "assistant_message_only" and len(tokenizer(expected[0], add_special_tokens=False)["input_ids"]) == 1:
        # the row is one token: nothing precedes it to predict it from, so it trains nothing and is dropped
        with pytest.raises(UserError, match="no training examples are left"):
            build_examples(DataArguments(dataset_mixer_list=[data, "1.0"]), tokenizer, 0)
        return
    examples, _ = build_examples(DataArguments(dataset_mixer_list=[data, "1.0"]), tokenizer, 0)
    runs = trained_runs(tokenizer, examples[0].input_ids, examples[0].labels)
    assert [r.strip() for r in runs] == expected
    for token in BUILTIN_TEMPLATES[template].special_tokens:  # added as single special tokens
        assert len(tokenizer(token, add_special_tokens=False)["input_ids"]) == 1


def test_unknown_template_name_lists_choices(tokenizer) -> None:
    with pytest.raises(UserError, match="'vicuna' is not a built-in template; choose one of simple_concat_with_space, .*, tulu, .*, chatml, llama3, "
                                         "or pass a Jinja file"):
        apply_chat_template_choice(tokenizer, "vicuna", None)


def test_template_file(tokenizer, tmp_path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + eos_token }}{% endfor %}"
                    "{% if add_generation_prompt %}assistant: {% endif %}")
    apply_chat_template_choice(tokenizer, "chatml", str(path))  # the file wins over the name
    assert tokenizer.chat_template == path.read_text()


def test_formats_detected_and_converted(tokenizer, tmp_path) -> None:
    alpaca = write_jsonl(tmp_path / "a.jsonl", [{"instruction": "Add 2 and 2.", "input": "", "output": "4"}])
    sharegpt = write_jsonl(tmp_path / "s.jsonl", [{"conversations": [{"from": "human", "value": "Hi"},
                                                                     {"from": "gpt", "value": "Hello"}]}])
    examples, reports = build_examples(DataArguments(dataset_mixer_list=[alpaca, "1.0", sharegpt, "1.0"]), tokenizer, 0)
    assert [r.format for r in reports] == ["alpaca", "sharegpt"]
    eos = tokenizer.eos_token
    assert [r.strip() for r in trained_runs(tokenizer, examples[0].input_ids, examples[0].labels)] == ["4" + eos]
    assert [r.strip() for r in trained_runs(tokenizer, examples[1].input_ids, examples[1].labels)] == ["Hello" + eos]


def test_sharegpt_turns_under_a_messages_column_are_read_as_sharegpt(tokenizer, tmp_path) -> None:
    """ShareGPT's from/value turns under a `messages` column (a common shape) were read as role/content messages:
    'message 1 has role None', and --dataset_format sharegpt looked for 'conversations' only. Detected from the first
    turn, under 'messages' or --sft_messages_key's column, and read the same with --dataset_format sharegpt."""
    turns = [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
             {"from": "gpt", "value": "Hello"}]
    under_messages = write_jsonl(tmp_path / "m.jsonl", [{"messages": turns}])
    under_dialog = write_jsonl(tmp_path / "d.jsonl", [{"dialog": turns}])
    plain = write_jsonl(tmp_path / "s.jsonl", [{"conversations": turns}])
    expected, _ = build_examples(DataArguments(dataset_mixer_list=[plain, "1.0"]), tokenizer, 0)
    for flags, formats in (({"dataset_mixer_list": [under_messages, "1.0"]}, ["sharegpt:messages"]),
                           ({"dataset_mixer_list": [under_messages, "1.0"], "dataset_format": "sharegpt"},
                            ["sharegpt:messages"]),
                           ({"dataset_mixer_list": [under_dialog, "1.0"], "sft_messages_key": "dialog"},
                            ["sharegpt:dialog"])):
        examples, reports = build_examples(DataArguments(**flags), tokenizer, 0)
        assert [r.format for r in reports] == formats
        assert examples[0].input_ids == expected[0].input_ids and examples[0].labels == expected[0].labels
    role_content = write_jsonl(tmp_path / "r.jsonl", [{"conversations": [{"role": "user", "content": "Hi"},
                                                                         {"role": "assistant", "content": "Yo"}]}])
    assert [r.format for r in build_examples(DataArguments(dataset_mixer_list=[role_content, "1.0"]),
                                             tokenizer, 0)[1]] == ["messages:conversations"]


def test_trls_prompt_completion_rows_train_the_completion(tokenizer, tmp_path) -> None:
    """TRL's prompt-completion rows, as strings (raw text, as TRL trains them) and as conversational lists (through
    the chat template), in a file each: detected, and what trains is the completion (streaming and in-memory builds
    alike)."""
    plain = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "Add 2 and 2.", "completion": "4"}])
    chat = write_jsonl(tmp_path / "pcc.jsonl", [{
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}],
        "completion": [{"role": "assistant", "content": "Hi"}]}])
    args = DataArguments(dataset_mixer_list=[plain, "1.0", chat, "1.0"])
    examples, reports = build_examples(args, tokenizer, 0)
    assert [r.format for r in reports] == ["prompt_completion", "prompt_completion"]
    eos = tokenizer.eos_token
    assert [r.strip() for r in trained_runs(tokenizer, examples[0].input_ids, examples[0].labels)] == ["4" + eos]
    assert [r.strip() for r in trained_runs(tokenizer, examples[1].input_ids, examples[1].labels)] == ["Hi" + eos]
    assert "Be brief." in tokenizer.decode(examples[1].input_ids)
    assert tokenizer.decode(examples[0].input_ids) == "Add 2 and 2.4" + eos  # no chat template around it
    streamed = prepare_data(DataArguments(dataset_mixer_list=[plain, "1.0", chat, "1.0"], dataset_skip_cache=True),
                            tokenizer, 0)
    assert sorted(len(x) for x in streamed.dataset["input_ids"]) == sorted(len(e.input_ids) for e in examples)
    # a few-shot prompt: its assistant turn is context, the completion trains (TRL's completion-only loss),
    # under last_assistant too; --train_on all trains the whole text
    shots = write_jsonl(tmp_path / "shots.jsonl", [{
        "prompt": [{"role": "user", "content": "Say one."}, {"role": "assistant", "content": "One"},
                   {"role": "user", "content": "Say two."}],
        "completion": [{"role": "assistant", "content": "Two"}]}])
    for train_on in ("all_assistant", "last_assistant"):
        few, _ = build_examples(DataArguments(dataset_mixer_list=[shots, "1.0"], train_on=train_on), tokenizer, 0)
        assert [r.strip() for r in trained_runs(tokenizer, few[0].input_ids, few[0].labels)] == ["Two" + eos]
        assert "One" in tokenizer.decode(few[0].input_ids)
    every, _ = build_examples(DataArguments(dataset_mixer_list=[shots, "1.0"], train_on="all"), tokenizer, 0)
    assert every[0].labels == every[0].input_ids
    as_messages = write_jsonl(tmp_path / "msgs.jsonl", [{"messages": [
        {"role": "user", "content": "Say one."}, {"role": "assistant", "content": "One"},
        {"role": "user", "content": "Say two."}, {"role": "assistant", "content": "Two"}]}])
    both, _ = build_examples(DataArguments(dataset_mixer_list=[as_messages, "1.0"]), tokenizer, 0)
    assert len(trained_runs(tokenizer, both[0].input_ids, both[0].labels)) == 2  # a messages row trains both
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": [{"role": "user", "content": "q"}],
                                                "completion": [{"role": "user", "content": "not an answer"}]}])
    with pytest.raises(UserError, match="bad.jsonl line 1: 'completion' must hold assistant messages"):
        build_examples(DataArguments(dataset_mixer_list=[bad, "1.0"]), tokenizer, 0)


def test_text_format_blocks(tokenizer, tmp_path) -> None:
    docs = [{"text": "alpha beta gamma " * 20}, {"text": "delta epsilon " * 30}]
    data = write_jsonl(tmp_path / "t.jsonl", docs)
    examples, reports = build_examples(DataArguments(dataset_mixer_list=[data, "1.0"], max_seq_length=32), tokenizer, 0)
    stream = []
    for doc in docs:
        stream += tokenizer(doc["text"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    spliced = [t for e in examples for t in e.input_ids]
    # A final block of one token has nothing to predict and is not kept.
    assert spliced == stream[: len(spliced)] and len(stream) - len(spliced) in (0, 1)
    assert all(len(e.input_ids) == 32 for e in examples[:-1])
    assert all(e.labels == e.input_ids for e in examples)  # every token trained
    assert reports[0].format == "text"


def test_dataset_text_field_reads_the_documents_of_another_column(tokenizer, tmp_path) -> None:
    """--dataset_text_field NAME (TRL's): a source with that column is text and its documents are read from it, in
    the streamed (JSON Lines) and the read-whole (JSON list) build alike, as the same documents under 'text' are; a
    .txt file's rows (or any row without the column) still read 'text'. The field enters the cache key; without it
    such a source names the flag."""
    from open_sft.data.cache import cache_key
    from open_sft.data.cache_inputs import key_inputs

    docs = ["alpha beta gamma " * 5, "delta epsilon " * 7]
    as_text = write_jsonl(tmp_path / "t.jsonl", [{"text": d} for d in docs])
    expected = [t for e in build_examples(DataArguments(dataset_mixer_list=[as_text, "1.0"]), tokenizer, 0)[0]
                for t in e.input_ids]
    lines = write_jsonl(tmp_path / "c.jsonl", [{"content": d, "id": i} for i, d in enumerate(docs)])
    listed = tmp_path / "c.json"
    listed.write_text(json.dumps([{"content": d, "id": i} for i, d in enumerate(docs)]))
    for source in (lines, str(listed), as_text):
        args = DataArguments(dataset_mixer_list=[source, "1.0"], dataset_text_field="content")
        examples, reports = build_examples(args, tokenizer, 0)
        assert [t for e in examples for t in e.input_ids] == expected and reports[0].format == "text", source
    plain = DataArguments(dataset_mixer_list=[lines, "1.0"])
    named = DataArguments(dataset_mixer_list=[lines, "1.0"], dataset_text_field="content", dataset_skip_cache=True)
    assert cache_key(key_inputs(plain, tokenizer, 0)) != cache_key(key_inputs(named, tokenizer, 0))
    with pytest.raises(UserError, match="a text column of another name: --dataset_text_field NAME"):
        build_examples(plain, tokenizer, 0)
    with pytest.raises(UserError, match="text row needs a string 'body' \\(--dataset_text_field; columns"):
        build_examples(DataArguments(dataset_mixer_list=[lines, "1.0"], dataset_format="text",
                                     dataset_text_field="body"), tokenizer, 0)


def test_text_documents_open_with_bos_where_the_tokenizer_begins_a_text_with_it(tokenizer, tmp_path) -> None:
    """Continual pretraining: a tokenizer whose encoding begins a text with bos (Llama-3, Gemma) has each document
    as bos + document + eos (it had no bos: the model never saw the token it always sees first at inference), in
    the in-memory and the streamed build alike; one that does not keeps document + eos, unless --add_bos."""
    from tokenizers.processors import TemplateProcessing

    docs = [{"text": "alpha beta gamma " * 5}, {"text": "delta epsilon " * 7}]
    data = write_jsonl(tmp_path / "t.jsonl", docs)
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    plain = [tokenizer(d["text"], add_special_tokens=False)["input_ids"] for d in docs]

    def streams(tok, **flags):
        args = DataArguments(dataset_mixer_list=[data, "1.0"], max_seq_length=4096, **flags)
        in_memory = [t for e in build_examples(args, tok, 0)[0] for t in e.input_ids]
        streamed = prepare_data(DataArguments(dataset_mixer_list=[data, "1.0"], max_seq_length=4096,
                                              dataset_skip_cache=True, **flags), tok, 0)
        assert [t for row in streamed.dataset["input_ids"] for t in row] == in_memory
        return in_memory

    assert streams(tokenizer) == plain[0] + [eos] + plain[1] + [eos]  # the embedded tokenizer adds nothing
    assert streams(tokenizer, add_bos=True) == [bos] + plain[0] + [eos, bos] + plain[1] + [eos]
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{tokenizer.bos_token} $A", special_tokens=[(tokenizer.bos_token, bos)])
    assert tokenizer("x")["input_ids"][0] == bos  # now a Llama-3-like tokenizer
    assert streams(tokenizer) == [bos] + plain[0] + [eos, bos] + plain[1] + [eos]


def test_add_bos_where_bos_is_eos_puts_one_eos_between_documents(tiny_model_dir, tmp_path) -> None:
    """--add_bos with a tokenizer whose bos is its eos (GPT-NeoX, OLMo: open-instruct's add_bos prepends eos
    there) opened each document with eos after the last one's closing eos: `eos eos` between documents, the model
    taught that eos follows eos. The opening eos is the separator: eos + document, one eos between documents."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.bos_token = tokenizer.eos_token
    eos = tokenizer.eos_token_id
    docs = ["alpha beta gamma " * 5, "delta epsilon " * 7]
    data = write_jsonl(tmp_path / "t.jsonl", [{"text": d} for d in docs])
    plain = [tokenizer(d, add_special_tokens=False)["input_ids"] for d in docs]
    args = DataArguments(dataset_mixer_list=[data, "1.0"], max_seq_length=4096, add_bos=True)
    one_eos_between = [eos] + plain[0] + [eos] + plain[1]
    assert [t for e in build_examples(args, tokenizer, 0)[0] for t in e.input_ids] == one_eos_between
    streamed = prepare_data(DataArguments(dataset_mixer_list=[data, "1.0"], max_seq_length=4096, add_bos=True,
                                          dataset_skip_cache=True), tokenizer, 0)
    assert [t for row in streamed.dataset["input_ids"] for t in row] == one_eos_between


def test_on_bad_row_drop_counts_reasons(tokenizer, tmp_path) -> None:
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join([
        json.dumps(good), "{broken", json.dumps({"messages": [{"role": "gpt", "content": "x"}]}),
        json.dumps({"messages": [{"role": "user", "content": "q"}]}),
        json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": " "}]}),
        json.dumps({"messages": [{"role": "tool", "content": "3"}, {"role": "assistant", "content": "3"}]}),
        json.dumps(good)]) + "\n")  # the tiny model's template raises on a tool turn
    args = DataArguments(dataset_mixer_list=[str(path), "1.0"], on_bad_row="drop")
    examples, reports = build_examples(args, tokenizer, 0)
    assert len(examples) == 2
    assert dict(reports[0].dropped) == {"invalid_json": 1, "unknown_role": 1, "no_final_assistant": 1,
                                        "empty_assistant": 1, "template_error": 1}
    assert reports[0].rows_in == 7 and reports[0].rows_kept == 2


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
@pytest.mark.parametrize("amount, unit", [("1.0", "rows"), ("3", "rows"), ("0.5", "tokens")])
def test_a_source_whose_rows_are_all_dropped_says_why(tokenizer, tmp_path, suffix, amount, unit) -> None:
    """Under --on_bad_row drop a source whose every row is bad said "1.0 of x.jsonl (0 rows) selects no rows; raise
    the amount" (a count: "has no usable rows to take 3 from"), naming neither its rows nor why they went; the error
    now counts them by reason, streamed (JSON Lines) or read whole (a JSON list)."""
    rows = [{"messages": [{"role": "user", "content": "q"}]}, {"messages": [{"role": "gpt", "content": "x"}]},
            {"messages": [{"role": "user", "content": "r"}]}]
    bad = tmp_path / f"bad{suffix}"
    bad.write_text("".join(json.dumps(row) + "\n" for row in rows) if suffix == ".jsonl" else json.dumps(rows))
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "hello"}]}) + "\n")
    args = DataArguments(dataset_mixer_list=[str(good), "1.0", str(bad), amount], on_bad_row="drop",
                         dataset_mixer_unit=unit)
    with pytest.raises(UserError) as info:
        build_examples(args, tokenizer, 0)
    assert str(info.value) == (
        f"--dataset_mixer_list: {bad} has no usable row to take its amount from: its 3 row(s) were all dropped under "
        "--on_bad_row drop (no_final_assistant 2, unknown_role 1); fix its rows (run without --on_bad_row drop to "
        "have the first bad one named), or leave the source out of the mixture")


@pytest.mark.parametrize("amount, n_rows, taken", [
    (0.5, 7, 3), (1.5, 3, 4), (0.5, 10, 5), (0.29, 100, 29), (2.25, 8, 18), (0.7, 10, 7), (1.0, 9, 9), (0.999, 1000, 999),
    (0.15, 10, 1), (2.5, 5, 12)])
def test_a_fraction_takes_the_rows_open_instruct_takes(amount, n_rows, taken) -> None:
    """open-instruct takes int(f × n) rows of a fraction f of n rows; round() took one more wherever the rest was a half
    or above (0.5 of 7: 4 rows, 1.5 of 3: 5, 0.15 of 10: 2), so the same command line trained other rows. Counted on
    the decimal as written: 0.29 of 100 is 29 (float's 0.29 × 100 is 28.999..., which int() takes to 28)."""
    indices = select_indices(SourceSpec("a.jsonl", amount, True, "train"), n_rows, seed=1)
    assert len(indices) == taken
    copies = Counter(indices)
    assert set(copies) <= set(range(n_rows)) and max(copies.values()) - min(copies.values()) <= 1


def test_mixer_amounts() -> None:
    specs = parse_mixer_list(["a.jsonl", "0.5", "b.jsonl", "3", "c.jsonl", "2.25"], ["train"])
    assert [(s.amount, s.is_fraction) for s in specs] == [(0.5, True), (3, False), (2.25, True)]
    half = select_indices(specs[0], 10, seed=1)
    assert len(half) == 5 and len(set(half)) == 5
    assert select_indices(specs[0], 10, seed=1) == half  # deterministic
    assert select_indices(specs[0], 10, seed=2) != half
    assert len(set(select_indices(specs[1], 10, seed=1))) == 3
    upsampled = Counter(select_indices(specs[2], 8, seed=1))
    assert sum(upsampled.values()) == 18 and set(upsampled.values()) == {2, 3}  # 2 copies + 2 of 8 extra
    # A count above the source's rows upsamples, as in open-instruct: 3 of 2 rows = both rows + one again.
    assert sorted(Counter(select_indices(specs[1], 2, seed=1)).values()) == [1, 2]
    seven = Counter(select_indices(SourceSpec("b.jsonl", 7, False, "train"), 3, seed=1))
    assert sorted(seven.values()) == [2, 2, 3]
    for bad, message in (("x", "is not a number"), ("0", "must be a finite number above 0"),
                         ("-3", "must be a finite number above 0"), ("-0.5", "must be a finite number above 0")):
        with pytest.raises(UserError, match=f"amount '?{bad}'? for a.jsonl {message}"):
            parse_mixer_list(["a.jsonl", bad], ["train"])


def test_mixer_array_selection_is_the_list_selection() -> None:
    """The streaming build's array form of the selection (no Python list of the rows) picks what select_rows
    picks: fractions below and above 1, counts below and above the rows, a subset of valid rows, a holdout."""
    from open_sft.data.mixer import select_row_array, select_rows

    specs = [SourceSpec("a.jsonl", amount, fraction, "train") for amount, fraction in
             ((1.0, True), (0.37, True), (2.25, True), (7, False), (250, False))]
    specs.append(SourceSpec("a.jsonl", 0.5, True, "train", holdout=("train", 0.1)))
    for spec in specs:
        for valid in (range(100), [i for i in range(100) if i % 7]):
            expected = select_rows(spec, "rows", valid, None, seed=3)
            picked = select_row_array(spec, "rows", valid if isinstance(valid, range) else np.array(valid), None, 3)
            assert picked.dtype == np.int64 and picked.tolist() == expected, (spec, valid)
    with pytest.raises(UserError, match="selects no rows"):
        select_row_array(SourceSpec("a.jsonl", 0.001, True, "train"), "rows", range(100), None, 3)


def test_mixer_token_unit() -> None:
    lengths = [10, 20, 30, 40, 100]  # 200 tokens
    half = select_by_tokens(SourceSpec("a.jsonl", 0.5, True, "train"), lengths, seed=0)
    taken = sum(lengths[i] for i in half)
    assert 100 <= taken < 100 + max(lengths)
    count = select_by_tokens(SourceSpec("a.jsonl", 60, False, "train"), lengths, seed=0)
    assert 60 <= sum(lengths[i] for i in count) < 160
    double = select_by_tokens(SourceSpec("a.jsonl", 2.0, True, "train"), lengths, seed=0)
    assert sum(lengths[i] for i in double) == 400
    above = select_by_tokens(SourceSpec("a.jsonl", 500, False, "train"), lengths, seed=0)  # 2 copies + 100 tokens
    assert 500 <= sum(lengths[i] for i in above) < 500 + max(lengths)
    assert all(count >= 2 for count in Counter(above).values())


def test_mixer_token_unit_keeps_copies_a_pass_apart() -> None:
    """Upsampling by tokens orders its picks as by rows: whole passes, then the sampled rest in row order. A text
    source's documents are spliced into blocks in that order, so no document sits right after its own copy."""
    lengths = [7, 3, 12, 5, 9, 4, 11, 6] * 5  # 40 documents, 228 tokens
    for amount, fraction in ((2.0, True), (2.6, True), (3, True), (500, False)):
        picked = select_by_tokens(SourceSpec("c4.jsonl", amount, fraction, "train"), lengths, seed=0)
        whole = int(amount) if fraction else int(amount) // sum(lengths)
        assert picked[: whole * len(lengths)] == list(range(len(lengths))) * whole, amount
        rest = picked[whole * len(lengths):]
        assert rest == sorted(set(rest)), amount
        assert all(a != b for a, b in zip(picked, picked[1:])), amount
        assert sum(lengths[i] for i in picked) >= (amount if not fraction else amount * sum(lengths)), amount


def test_token_unit_balances_tokens_not_rows(tokenizer, tmp_path) -> None:
    short = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}] * 40
    long = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "word " * 60}]}] * 40
    a, b = write_jsonl(tmp_path / "short.jsonl", short), write_jsonl(tmp_path / "long.jsonl", long)
    args = DataArguments(dataset_mixer_list=[a, "0.5", b, "0.5"], dataset_mixer_unit="tokens")
    _, reports = build_examples(args, tokenizer, 0)
    for report in reports:
        assert report.rows_selected == 20  # equal-length rows: half the tokens is half the rows
    # Counts are tokens too: 300 tokens of the long source is a few rows, of the short one many.
    by_count = DataArguments(dataset_mixer_list=[a, "300", b, "300"], dataset_mixer_unit="tokens")
    _, reports = build_examples(by_count, tokenizer, 0)
    assert reports[0].rows_selected > 4 * reports[1].rows_selected
    assert all(300 <= r.tokens for r in reports)


@pytest.mark.parametrize("truncation", ["truncate", "drop"])
def test_token_unit_counts_the_tokens_the_rows_keep(tokenizer, tmp_path, truncation) -> None:
    """By tokens, a row counts what it keeps after --max_seq_length: cut rows their cut length, dropped rows
    nothing. Counted before the fit, a source of long rows delivered a fraction of the tokens asked for."""
    rows = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "word " * n}]}
            for n in [2, 80] * 60]
    data = write_jsonl(tmp_path / "mixed.jsonl", rows)
    args = DataArguments(dataset_mixer_list=[data, "600"], dataset_mixer_unit="tokens", max_seq_length=32,
                         truncation=truncation)
    examples, (report,) = build_examples(args, tokenizer, 0)
    assert 600 <= report.tokens < 600 + 32  # the last row drawn tips it over by less than a row
    assert report.tokens == sum(len(e.input_ids) for e in examples)
    if truncation == "drop":
        assert report.dropped["too_long"] > 0 and report.truncated == 0
    else:
        assert report.truncated > 0


def test_parallel_workers_give_identical_data(tokenizer, caplog, monkeypatch) -> None:
    """One process, two, and the default (one per usable core) give the same data."""
    from conftest import SAMPLE
    from open_sft.data import workers

    def build(**kwargs):
        return prepare_data(DataArguments(dataset_mixer_list=[str(SAMPLE), "1.0"], dataset_skip_cache=True,
                                          **kwargs), tokenizer, 0)

    caplog.set_level("INFO", logger="open_sft.data.workers")
    one = build(preprocessing_num_workers=1)
    assert "2000 rows in 1 process(es)" in caplog.text
    two = build(preprocessing_num_workers=2)
    assert "2000 rows in 2 process(es)" in caplog.text  # the worker processes really ran
    for cores in (1, 2, 3):  # (2000 rows: two workers' worth at most)
        monkeypatch.setattr(workers, "usable_cpus", lambda: cores)
        caplog.clear()
        default = build()
        assert f"2000 rows in {min(cores, 2)} process(es)" in caplog.text
        assert one.dataset["input_ids"] == default.dataset["input_ids"] and one.dataset["labels"] == default.dataset["labels"]
    assert one.dataset["input_ids"] == two.dataset["input_ids"] and one.dataset["labels"] == two.dataset["labels"]
    assert one.cache_key == two.cache_key == default.cache_key  # workers change speed, not output


@pytest.mark.parametrize("amount, unit", [("1.0", "rows"), ("0.37", "rows"), ("1.6", "rows"), ("1500", "rows"),
                                          ("0.5", "tokens")])
@pytest.mark.parametrize("dirty", [False, True])
def test_jsonl_read_in_the_workers_equals_the_serial_read(tokenizer, tmp_path, monkeypatch, amount, unit,
                                                          dirty) -> None:
    """JSON Lines chat rows are parsed and converted in the render workers; the serial read (which every
    other source takes) must give the same examples and reports, in one process and in two, for
    fractions, upsampling, counts and token shares; also with bad lines and rows dropped (so the rows
    are numbered and drawn from the valid ones) and rows whose prompt fills the window. One process and
    two give the same too (in one, the rows are encoded 300 at a time, overlapped with the labelling)."""
    from conftest import SAMPLE
    from open_sft.data import in_memory
    from open_sft.data import workers as worker_pool

    monkeypatch.setattr(worker_pool, "_IN_PROCESS_CHUNK", 300)

    lines = SAMPLE.read_text().splitlines()
    if dirty:
        user_only = json.dumps({"messages": [{"role": "user", "content": "no answer"}]})
        for k, bad in enumerate(["{oops", "[1, 2]", json.dumps({"messages": [{"role": "gpt", "content": "x"}]}),
                                 user_only, "{oops", "", "   "]):
            lines[7 + 211 * k] = bad
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(lines) + "\n")
    read_by_workers, by_workers = in_memory._jsonl_chat_rows, {}
    for workers in (1, 2):
        built = []
        for path in (read_by_workers, lambda *args: None):
            monkeypatch.setattr(in_memory, "_jsonl_chat_rows", path)
            args = DataArguments(dataset_mixer_list=[str(data), amount], dataset_mixer_unit=unit, max_seq_length=24,
                                 preprocessing_num_workers=workers, on_bad_row="drop" if dirty else "error")
            token_rows, reports = in_memory.build_rows(args, tokenizer, 3)
            built.append((token_rows.ids.tolist(), token_rows.labels.tolist(), token_rows.bounds.tolist(),
                          reports[0].to_dict()))
        assert built[0] == built[1]
        by_workers[workers] = built[0]
        assert built[0][3]["truncated"] > 0 and built[0][3]["rows_kept"] > 0
        assert set(built[0][3]["rows_dropped"]) >= ({"invalid_json", "unknown_role", "no_final_assistant"} if dirty
                                                   else set())
    assert by_workers[1] == by_workers[2]


@pytest.mark.parametrize("count", ["1997", "4001"])
def test_counts_above_the_valid_rows_upsample_alike_in_workers_and_serially(tokenizer, tmp_path, monkeypatch,
                                                                            count) -> None:
    """More rows asked for than the valid rows (1996 of 1999 lines) upsample, as open-instruct does: whole
    copies plus a seeded sample of the rest, the same rows whether the workers or the parent read the file,
    and the data report shows the factor."""
    from conftest import SAMPLE
    from open_sft.data import in_memory
    from open_sft.data.summary import format_data_report

    lines = SAMPLE.read_text().splitlines()[:1999]
    lines[5], lines[50], lines[500] = "{oops", "[1]", json.dumps({"messages": [{"role": "user", "content": "q"}]})
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(lines) + "\n")
    args = DataArguments(dataset_mixer_list=[str(data), count], on_bad_row="drop")
    built = []
    for path in (in_memory._jsonl_chat_rows, lambda *args: None):
        monkeypatch.setattr(in_memory, "_jsonl_chat_rows", path)
        rows, reports = in_memory.build_rows(args, tokenizer, 0)
        built.append((rows.bounds.tolist(), rows.ids.tolist(), reports[0].to_dict()))
    assert built[0] == built[1]
    report = built[0][2]
    assert report["rows_selected"] == int(count) and len(built[0][0]) - 1 == report["examples"]
    assert report["upsample_factor"] == round(int(count) / 1996, 4) > 1.0  # of the 1996 valid rows
    assert f"upsampled ×{int(count) / 1996:.2f} (rows repeated" in format_data_report(
        {"sources": [report], "examples": report["examples"], "tokens": report["tokens"],
         "trained_tokens": report["trained_tokens"]})
    assert report["examples"] == int(count)


def test_the_parent_reads_only_the_first_line_of_a_jsonl_source(tokenizer, monkeypatch) -> None:
    """With two workers the parent splits the file into lines and parses only the first (for the cache key, whether
    the source is documents, and for the format): every other row is parsed in the worker processes (whose calls the
    parent does not see)."""
    from conftest import SAMPLE
    from open_sft.data import chunks, in_memory, local_files, stream

    calls = []
    original = local_files.parse_json_line
    for module in (chunks, in_memory, local_files, stream):
        monkeypatch.setattr(module, "parse_json_line", lambda line: calls.append(line) or original(line))
    built = prepare_data(DataArguments(dataset_mixer_list=[str(SAMPLE), "1.0"], dataset_skip_cache=True,
                                       preprocessing_num_workers=2), tokenizer, 0)
    assert len(built) == 2000 and calls == [SAMPLE.read_text().splitlines()[0]] * 2


@pytest.mark.parametrize("template", sorted(BUILTIN_TEMPLATES))
def test_direct_renderer_equals_apply_chat_template(tokenizer, template) -> None:
    """The fast path renders with the compiled template; it must agree with the public API."""
    from conftest import SAMPLE
    from open_sft.data.labels import render

    apply_chat_template_choice(tokenizer, template, None)
    rows = [json.loads(line)["messages"] for line in SAMPLE.read_text().splitlines()[:100]]
    for messages in rows + list(CONVERSATIONS.values()):
        if {m["role"] for m in messages} & NOT_WRITTEN.get(template, set()):
            continue
        for k in range(1, len(messages) + 1):
            assert render(tokenizer, messages[:k], True) == tokenizer.apply_chat_template(
                messages[:k], tokenize=False, add_generation_prompt=True)
            assert render(tokenizer, messages[:k]) == tokenizer.apply_chat_template(messages[:k], tokenize=False)


def test_bad_row_reason_survives_a_worker_process() -> None:
    """Render workers send RowErrors back pickled; the reason counted in the data report must survive."""
    import pickle

    from open_sft.data.formats import RowError

    restored = pickle.loads(pickle.dumps(RowError("message 2 (assistant) is empty", "empty_assistant")))
    assert (str(restored), restored.reason) == ("message 2 (assistant) is empty", "empty_assistant")


@pytest.mark.parametrize("content", [
    '{"a": 1}\n{"a": 2}\n', '{"a": 1}\n{"a": 2}', '{"a": 1}\r\n\r\n{"a": 2}\r\n', '\n\n{"a": 1}\n  \t\n{"a": 2}\n\n',
    '{"a": 1}\r{"a": 2}\n\u3000\n{"a": "x\x0cy\u2028z"}\n', '', '\n', '{"a": 1}\n\n'])
def test_read_lines_gives_the_files_non_blank_lines_and_their_numbers(tmp_path, content) -> None:
    """As iterating the file (universal newlines) and skipping whitespace-only lines would, whatever the
    line endings, blank lines, a missing final newline, or characters str.splitlines would split at."""
    from open_sft.data.local_files import read_lines

    path = tmp_path / "rows.jsonl"
    path.write_bytes(content.encode())
    with path.open(encoding="utf-8") as handle:
        expected = [(number, line.rstrip("\n")) for number, line in enumerate(handle, start=1) if not line.isspace()]
    lines, numbers = read_lines(path)
    assert list(zip(numbers, lines)) == expected


def test_a_tokenizers_own_template_that_is_not_valid_jinja_is_refused_before_any_row(tokenizer) -> None:
    from open_sft.errors import UserError

    tokenizer.chat_template = "{% if messages %}{{ messages[0].content }}"
    with pytest.raises(UserError, match=r"the tokenizer's chat template .* is not valid Jinja: line 1: .*endif"):
        apply_chat_template_choice(tokenizer, None, None)


def test_a_mixture_left_with_no_example_says_why_per_source(tokenizer, tmp_path) -> None:
    """Every row too long for --max_seq_length 8 under --truncation drop, or cut to no trained token under truncate:
    the error lists each source's drops by reason with the fix (it used to point at a data report it never
    printed), from the streaming build and the in-memory one alike."""
    long = write_jsonl(tmp_path / "long.jsonl", [{"messages": [
        {"role": "user", "content": "a question of many words " * 4},
        {"role": "assistant", "content": "an answer"}]}] * 3)
    for truncation, reason, fix in (("drop", "too_long 3", "raise --max_seq_length, or keep long rows cut"),
                                    ("truncate", "no_trained_tokens_after_truncation 3",
                                     "truncation cut every trained token")):
        args = DataArguments(dataset_mixer_list=[long, "1.0"], max_seq_length=8, truncation=truncation,
                             dataset_skip_cache=True)
        for build in (lambda: build_examples(args, tokenizer, 0), lambda: prepare_data(args, tokenizer, 0)):
            with pytest.raises(UserError) as refused:
                build()
            message = str(refused.value)
            assert "no training examples are left" in message and "(--max_seq_length 8)" in message
            assert f"long.jsonl (messages): 3 rows, 3 selected, 0 kept; dropped: {reason}" in message, message
            assert fix in message


def test_rows_of_json_lists_are_named_by_line_and_parquet_rows_from_1(tokenizer, tmp_path) -> None:
    """A JSON list's bad row is named by the line its object begins on, as a .jsonl file's is (a pretty-printed
    list's row 150,000 said "row 150000", leaving the user to find it); a parquet file's second row is "row 2"."""
    import json as json_module

    import pyarrow as pa
    import pyarrow.parquet as pq

    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    bad = {"messages": [{"role": "gpt", "content": "x"}, {"role": "assistant", "content": "y"}]}
    listed = tmp_path / "rows.json"
    listed.write_text(json_module.dumps([good, good, bad, good], indent=2))  # rows of 12 lines: the bad one on 26
    assert listed.read_text().splitlines()[25] == "  {"
    table = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist([good, bad, good]), table)
    for path, where in ((listed, "line 26"), (table, "row 2")):
        args = DataArguments(dataset_mixer_list=[str(path), "1.0"], dataset_skip_cache=True)
        for build in (lambda: build_examples(args, tokenizer, 0), lambda: prepare_data(args, tokenizer, 0)):
            with pytest.raises(UserError, match=f"{path.name} {where}: message 1 has role 'gpt'"):
                build()
    (tmp_path / "items.json").write_text('{"train": [\n' + json_module.dumps(good) + ',\n\n  "not an object"]}')
    with pytest.raises(UserError, match="items.json line 4: expected a JSON object, got str"):
        build_examples(DataArguments(dataset_mixer_list=[str(tmp_path / "items.json"), "1.0"]), tokenizer, 0)
