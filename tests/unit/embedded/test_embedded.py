"""Tests for the embedded default: sample data generator, tokenizer, template and tiny model."""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from pathlib import Path

import pytest

from open_sft.embedded import sample_data
from open_sft.embedded.sample_data import TASK_KINDS, generate_examples, score_answer, write_jsonl

BUNDLED = Path(sample_data.__file__).resolve().parent / "data" / "sample.jsonl"
SMALL_MODEL = dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
SMALL_VOCAB = 512


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --------------------------------------------------------------------------- sample data


@pytest.fixture(scope="module")
def bundled_rows() -> list[dict]:
    return sample_data.read_jsonl(BUNDLED)


def test_generator_is_deterministic() -> None:
    assert generate_examples(300, seed=3) == generate_examples(300, seed=3)
    assert generate_examples(300, seed=3) != generate_examples(300, seed=4)
    assert generate_examples(0) == []


@pytest.mark.parametrize("bad", [-1, 1.5, "10", True])
def test_generator_rejects_bad_n(bad: object) -> None:
    with pytest.raises(ValueError):
        generate_examples(bad)  # type: ignore[arg-type]


def test_task_variety(bundled_rows: list[dict]) -> None:
    counts = Counter(row["task"] for row in bundled_rows)
    assert set(counts) == set(TASK_KINDS)
    assert max(counts.values()) - min(counts.values()) <= 1
    small = Counter(row["task"] for row in generate_examples(10, seed=7))
    assert set(small) == set(TASK_KINDS)
    # Varied prompts, not a handful of templates.
    assert len({row["messages"][-2]["content"] for row in bundled_rows}) > 1000


def test_row_structure(bundled_rows: list[dict]) -> None:
    assert len(bundled_rows) == 2000
    assert len({row["id"] for row in bundled_rows}) == len(bundled_rows)
    for row in bundled_rows:
        assert set(row) == {"id", "task", "messages", "answer"}
        messages = row["messages"]
        roles = [m["role"] for m in messages]
        body = roles[1:] if roles[0] == "system" else roles
        assert body == ["user", "assistant"] * (len(body) // 2), row
        assert messages[-1]["role"] == "assistant"
        assert messages[-1]["content"] == row["answer"]
        assert all(m["content"] and m["content"] == m["content"].strip() for m in messages)
        if row["task"] == "multi_turn":
            assert roles.count("user") == 2
        if row["task"] == "system_prompt":
            assert roles[0] == "system"


_ARITH = {
    r"What is (\d+) plus (\d+)\?": lambda a, b: a + b,
    r"What is (\d+) minus (\d+)\?": lambda a, b: a - b,
    r"What is (\d+) times (\d+)\?": lambda a, b: a * b,
}


def test_answers_are_checkable(bundled_rows: list[dict]) -> None:
    checked = 0
    for row in bundled_rows:
        msgs = row["messages"]
        in_words = msgs[0]["content"] == "You write numbers as English words."
        for i in range(len(msgs) - 1):
            if msgs[i]["role"] != "user":
                continue
            for pattern, fn in _ARITH.items():
                match = re.fullmatch(pattern, msgs[i]["content"])
                if match:
                    value = fn(*map(int, match.groups()))
                    want = sample_data.NUMBER_WORDS[value] if in_words else str(value)
                    assert msgs[i + 1]["content"] == want, row
                    checked += 1
        if row["task"] == "multi_turn" and msgs[2]["content"] == "Now double it.":
            first = int(re.findall(r"-?\d+", msgs[1]["content"])[-1])
            assert row["answer"] == str(2 * first)
            checked += 1
        if row["task"] == "string" and msgs[0]["content"].startswith("Reverse the word "):
            word = msgs[0]["content"].removeprefix("Reverse the word ").rstrip(".")
            assert row["answer"] == word[::-1]
            checked += 1
    assert checked > 200


def test_bundled_file_equals_regeneration(tmp_path: Path) -> None:
    out = write_jsonl(generate_examples(2000, seed=0), tmp_path / "regen.jsonl")
    assert _sha256(out) == _sha256(BUNDLED)
    assert BUNDLED.stat().st_size < 500_000


@pytest.mark.parametrize(
    ("expected", "generated", "ok"),
    [
        ("42", "42", True),
        ("42", " 42.\n", True),
        ("The sum is 12.", "the sum  is 12", True),
        ("TAC", "tac", True),
        ("7000 meters", "7000   Meters.", True),
        ("42", "43", False),
        ("42", "The answer is 42.", False),
        ("yes", "", False),
    ],
)
def test_score_answer(expected: str, generated: str, ok: bool) -> None:
    assert score_answer(expected, generated) is ok


def test_sample_data_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli.jsonl"
    assert sample_data.main([str(out), "--n", "25", "--seed", "2"]) == 0
    assert sample_data.read_jsonl(out) == generate_examples(25, seed=2)
    assert str(out) in capsys.readouterr().out


# --------------------------------------------------------------------------- tokenizer


@pytest.fixture(scope="module")
def factory():
    return pytest.importorskip("open_sft.embedded.factory")


@pytest.fixture(scope="module")
def texts(factory, bundled_rows: list[dict]) -> list[str]:
    return list(factory.iter_message_texts(bundled_rows))


@pytest.fixture(scope="module")
def tokenizer(factory, texts: list[str]):
    return factory.build_tokenizer(texts, vocab_size=SMALL_VOCAB)


def test_tokenizer_is_deterministic(factory, texts: list[str], tokenizer, tmp_path: Path) -> None:
    again = factory.build_tokenizer(texts, vocab_size=SMALL_VOCAB)
    tokenizer.save_pretrained(tmp_path / "a")
    again.save_pretrained(tmp_path / "b")
    assert _sha256(tmp_path / "a" / "tokenizer.json") == _sha256(tmp_path / "b" / "tokenizer.json")
    assert len(tokenizer) <= SMALL_VOCAB


def test_special_tokens(factory, tokenizer) -> None:
    ids = [tokenizer.convert_tokens_to_ids(t) for t in factory.SPECIAL_TOKENS]
    assert ids == list(range(len(factory.SPECIAL_TOKENS)))
    for token, token_id in zip(factory.SPECIAL_TOKENS, ids):
        assert tokenizer.encode(token, add_special_tokens=False) == [token_id]
        assert tokenizer.encode(f"x{token}y", add_special_tokens=False).count(token_id) == 1
    assert tokenizer.bos_token == "<|bos|>"
    assert tokenizer.eos_token == "<|endoftext|>"
    assert tokenizer.pad_token == "<|pad|>"
    assert tokenizer.model_max_length == 2048
    # No automatic BOS/EOS: the chat template is responsible for BOS.
    assert tokenizer("What is 2 plus 2?")["input_ids"] == tokenizer.encode(
        "What is 2 plus 2?", add_special_tokens=False
    )
    assert tokenizer.decode(tokenizer.encode("Héllo wörld 123")) == "Héllo wörld 123"


def test_build_tokenizer_rejects_bad_input(factory) -> None:
    with pytest.raises(ValueError):
        factory.build_tokenizer([], vocab_size=SMALL_VOCAB)
    with pytest.raises(ValueError):
        factory.build_tokenizer(["abc"], vocab_size=10)
    with pytest.raises(TypeError):
        factory.build_tokenizer(["abc", 3], vocab_size=SMALL_VOCAB)  # type: ignore[list-item]


def test_chat_template_renders_as_intended(tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Reply in uppercase."},
        {"role": "user", "content": "Reverse the word cat."},
        {"role": "assistant", "content": "TAC"},
    ]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == (
        "<|bos|><|system|>\nReply in uppercase.\n<|user|>\nReverse the word cat.\n"
        "<|assistant|>\nTAC<|endoftext|>\n"
    )
    assert tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True) == (
        "<|bos|><|system|>\nReply in uppercase.\n<|user|>\nReverse the word cat.\n<|assistant|>\n"
    )
    with pytest.raises(Exception, match="Unknown role"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_template_is_prefix_stable(tokenizer, bundled_rows: list[dict]) -> None:
    for row in bundled_rows[:200]:
        messages = row["messages"]
        full = tokenizer.apply_chat_template(messages, tokenize=False)
        full_ids = tokenizer.encode(full, add_special_tokens=False)
        for k in range(1, len(messages) + 1):  # transformers 5 rejects an empty conversation
            part = tokenizer.apply_chat_template(messages[:k], tokenize=False)
            assert full.startswith(part), (row["id"], k)
            if k < len(messages) and messages[k]["role"] == "assistant":
                prompt = tokenizer.apply_chat_template(
                    messages[:k], tokenize=False, add_generation_prompt=True
                )
                assert full.startswith(prompt), (row["id"], k)
                # Token level too: the prompt's ids are a prefix of the full ids.
                prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
                assert full_ids[: len(prompt_ids)] == prompt_ids, (row["id"], k)


# --------------------------------------------------------------------------- model


def _state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_model_is_deterministic(factory, tokenizer) -> None:
    import torch

    before = torch.random.get_rng_state()
    a = _state(factory.build_model(tokenizer, seed=0, **SMALL_MODEL))
    b = _state(factory.build_model(tokenizer, seed=0, **SMALL_MODEL))
    c = _state(factory.build_model(tokenizer, seed=1, **SMALL_MODEL))
    assert torch.equal(before, torch.random.get_rng_state())  # caller's RNG untouched
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)
    assert all(v.dtype == torch.float32 for v in a.values())


def test_model_config(factory, tokenizer) -> None:
    model = factory.build_model(tokenizer, **SMALL_MODEL)
    cfg = model.config
    assert cfg.vocab_size % 64 == 0 and len(tokenizer) <= cfg.vocab_size < len(tokenizer) + 64
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (
        tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id,
    )
    assert cfg.tie_word_embeddings is False
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    gen = model.generation_config
    assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == (
        tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id,
    )


@pytest.mark.parametrize(
    "kwargs",
    [dict(hidden_size=30, num_heads=4), dict(num_heads=4, num_kv_heads=3), dict(num_layers=0)],
)
def test_build_model_rejects_bad_shapes(factory, tokenizer, kwargs: dict) -> None:
    with pytest.raises(ValueError):
        factory.build_model(tokenizer, **kwargs)


@pytest.mark.parametrize("args, named", [
    (["--hidden_size", "65"], "hidden_size (65) must be divisible by num_heads (4): change --hidden_size / --num_heads"),
    (["--vocab_size", "10"], "vocab_size must be >= 262 (bytes + special tokens), got 10: change --vocab_size"),
    (["--num_kv_heads", "3"], "change --num_heads / --num_kv_heads"),
])
def test_the_command_names_the_flags_of_a_shape_it_cannot_build(factory, tmp_path: Path, capsys, args, named) -> None:
    """A shape the model cannot take is one error line naming the flags to change, before anything is written
    (it was a traceback)."""
    assert factory.main([str(tmp_path / "out"), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and named in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_save_reload_round_trip(factory, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cli_args = ["--vocab_size", str(SMALL_VOCAB)]
    for key, value in SMALL_MODEL.items():
        cli_args += [f"--{key}", str(value)]
    assert factory.main([str(tmp_path / "a"), *cli_args]) == 0
    assert str(tmp_path / "a") in capsys.readouterr().out
    out_b = factory.build_embedded_default(tmp_path / "b", vocab_size=SMALL_VOCAB, **SMALL_MODEL)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "generation_config.json"):
        assert _sha256(tmp_path / "a" / name) == _sha256(out_b / name), name

    # Fresh objects built in-process vs. reloaded from disk give identical logits.
    tok = factory.build_tokenizer(
        factory.iter_message_texts(factory.load_rows(factory.DEFAULT_DATA_PATH)), vocab_size=SMALL_VOCAB
    )
    model = factory.build_model(tok, **SMALL_MODEL)
    re_tok = AutoTokenizer.from_pretrained(out_b)
    re_model = AutoModelForCausalLM.from_pretrained(out_b)
    re_model.eval()
    messages = [{"role": "user", "content": "What is 3 plus 4?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert re_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == text
    ids = tok(text, return_tensors="pt")["input_ids"]
    assert torch.equal(ids, re_tok(text, return_tensors="pt")["input_ids"])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, re_model(ids).logits)
        out = re_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert out.shape[0] == 1 and ids.shape[1] < out.shape[1] <= ids.shape[1] + 4
    assert torch.equal(out[0, : ids.shape[1]], ids[0])


def test_data_path_of_text_rows_trains_the_tokenizer_on_their_documents(factory, tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """`open_sft embedded OUT --data_path` takes text rows (a .jsonl of {"text"} or a .txt file) as it takes chat
    rows: the tokenizer learns their words; the bundled sample still gives the message texts it always gave."""
    import json

    from transformers import AutoTokenizer

    documents = [f"zorblax quintessa number {i}\nsecond line of zorblax" for i in range(40)]
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    (tmp_path / "corpus.txt").write_text("\n\n".join(documents) + "\n")
    assert factory.training_texts(tmp_path / "corpus.jsonl") == factory.training_texts(tmp_path / "corpus.txt") \
        == documents
    assert factory.training_texts(factory.DEFAULT_DATA_PATH) == list(
        factory.iter_message_texts(factory.load_rows(factory.DEFAULT_DATA_PATH)))
    cli = ["--vocab_size", str(SMALL_VOCAB), *[f"--{k}={v}" for k, v in SMALL_MODEL.items()]]
    assert factory.main([str(tmp_path / "out"), "--data_path", str(tmp_path / "corpus.txt"), *cli]) == 0
    assert AutoTokenizer.from_pretrained(tmp_path / "out").tokenize(" zorblax") == ["Ġzorblax"]


def test_data_path_without_chat_or_text_rows_says_so_in_one_line(factory, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    import json

    (tmp_path / "body.jsonl").write_text(json.dumps({"body": "A WHOLE DOCUMENT " * 200}) + "\n")
    assert factory.main([str(tmp_path / "out"), "--data_path", str(tmp_path / "body.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / 'body.jsonl'} line 1: cannot tell the data format from the columns "
                          "['body']") and err.count("\n") == 1
    assert "WHOLE DOCUMENT" not in err and "Traceback" not in err
    # the fix names what `embedded` reads, not finetune.py's column flags, which it does not take
    assert "--data_path reads the standard columns only" in err and "has no --sft_messages_key" in err
    assert "--dataset_text_field NAME" not in err
    (tmp_path / "number.jsonl").write_text(json.dumps({"text": 3}) + "\n")
    assert factory.main([str(tmp_path / "out"), "--data_path", str(tmp_path / "number.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "line 1: text row needs a string 'text'" in err and "--dataset_text_field NAME" not in err
    assert factory.main([str(tmp_path / "out"), "--data_path", str(tmp_path / "missing.jsonl")]) == 2
    assert "--data_path" in capsys.readouterr().err and not (tmp_path / "out").exists()
