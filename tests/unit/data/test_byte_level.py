"""The byte-level path (open_sft/data/byte_level.py) labels and checks rows exactly as the offset path
and the definition (`label_tokens`) do, and is used only where its table and the row allow."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from open_sft.data.byte_level import byte_table, label_byte_level
from open_sft.data.chat.examples import trained_spans
from open_sft.data.chat.render import special_markers
from open_sft.data.labels import _label_by_offsets, encode_batch, label_batch, label_tokens


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    """The embedded tokenizer: ByteLevel BPE, no normalizer, untrimmed offsets."""
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _olmo_like(tiny_model_dir):
    """The embedded vocabulary dressed as GPT-NeoX/OLMo: NFC normalizer, offsets trimmed by a ByteLevel
    post-processor, and added tokens made of whitespace (which trimming cuts whole)."""
    from tokenizers import AddedToken, Tokenizer, normalizers, processors

    base = AutoTokenizer.from_pretrained(tiny_model_dir)
    backend = Tokenizer.from_str(base._tokenizer.to_str())
    backend.normalizer = normalizers.NFC()
    backend.post_processor = processors.ByteLevel(trim_offsets=True)
    backend.add_tokens([AddedToken(" " * 4, normalized=True), AddedToken("\n\n", normalized=True),
                        AddedToken("\u3000", normalized=True)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=base.eos_token,
                                   chat_template=base.chat_template)


@pytest.fixture(scope="module")
def olmo_like(tiny_model_dir):
    return _olmo_like(tiny_model_dir)


def _ids(tokenizer, rows) -> list[list[int]]:
    return encode_batch(tokenizer, [text for text, _ in rows]).id_rows


def _random_rows(seed: int, count: int) -> list[tuple[str, list[tuple[int, int]]]]:
    """Texts of accents (also decomposed, which NFC changes), emoji split into byte tokens, runs of
    spaces and of whitespace added tokens, special tokens; random ordered spans that start and end
    anywhere (inside tokens, on whitespace, empty, at the very end)."""
    rng = random.Random(seed)
    words = ["the", "Quick", "héllo", "wörld", "😀", "naïve", "42", "!", "\n", "\n\n", "  ", " " * 9,
             "\u3000", "café", "<|assistant|>", "<|endoftext|>", "\t"]
    rows = []
    for _ in range(count):
        text = "".join(rng.choice(words) + rng.choice(["", " ", "  "]) for _ in range(rng.randint(1, 25)))
        if rng.random() < 0.15:
            text += " decomposed: e\u0301"
        cuts = sorted(rng.choices(range(len(text) + 1), k=2 * rng.randint(1, 3)))
        rows.append((text, list(zip(cuts[::2], cuts[1::2]))))
    return rows


@pytest.mark.parametrize("kind", ["plain", "olmo_like"])
def test_byte_level_labels_equal_the_definition_on_random_spans(kind, plain, olmo_like) -> None:
    tokenizer = plain if kind == "plain" else olmo_like
    rows = _random_rows(seed=11, count=600)
    table = byte_table(tokenizer)
    assert table is not None
    taken = label_byte_level(table, _ids(tokenizer, rows), rows, check=False).taken
    # Many rows take this path; not those whose text NFC changes, nor spans where trimming decides.
    assert 100 < taken.sum() < len(rows)
    batch = label_batch(tokenizer, rows, check=False)
    encoded = tokenizer([text for text, _ in rows], add_special_tokens=False, return_offsets_mapping=True)
    for r, ((text, spans), ids, offsets) in enumerate(zip(rows, encoded["input_ids"], encoded["offset_mapping"])):
        assert batch.rows.row(r) == (ids, label_tokens(ids, offsets, spans)), (text, spans, bool(taken[r]))


def _template_rows(tokenizer, template_name: str) -> list[tuple[str, list[tuple[int, int]]]]:
    from conftest import SAMPLE
    from open_sft.data.formats import to_messages
    from open_sft.data.chat.templates import apply_chat_template_choice

    apply_chat_template_choice(tokenizer, template_name, None)
    markers = special_markers(tokenizer)
    conversations = [to_messages(json.loads(line), "messages") for line in SAMPLE.read_text().splitlines()[:150]]
    conversations.append([{"role": "user", "content": "Say  it\twith spaces."},
                          {"role": "assistant", "content": "  Spaced   out  answer: café 😀  "}])
    return [trained_spans(tokenizer, messages, "all_assistant", markers) for messages in conversations]


@pytest.mark.parametrize("template_name", ["tulu", "chatml", "llama3", "zephyr", "olmo", "simple_chat"])
def test_byte_level_path_gives_the_offset_paths_labels_and_verdicts(tiny_model_dir, template_name) -> None:
    """Real template renderings, plus each row again with its first span cut inside a token and moved
    one character: the same tokens, labels and check verdicts as the offset path, row for row."""
    tokenizer = _olmo_like(tiny_model_dir)
    rows = _template_rows(tokenizer, template_name)
    broken = []
    for text, spans in rows:
        start, end = spans[0]
        broken.append((text, [(start + 2, end), *spans[1:]]))
        broken.append((text, [(start - 1, end - 1), *spans[1:]]))
    everything = rows + broken
    fast = label_byte_level(byte_table(tokenizer), _ids(tokenizer, everything), everything, check=True)
    assert fast.taken[: len(rows)].all()
    assert fast.right[: len(rows)].all()
    mixed, by_offsets = label_batch(tokenizer, everything), _label_by_offsets(tokenizer, everything, check=True)
    for name in ("ids", "labels", "bounds"):
        assert np.array_equal(getattr(mixed.rows, name), getattr(by_offsets.rows, name))
    assert np.array_equal(mixed.right, by_offsets.right)
    assert not by_offsets.right[len(rows):].all()  # the broken spans are caught


def test_table_agrees_with_the_tokenizers_decode(olmo_like) -> None:
    table = byte_table(olmo_like)
    backend = olmo_like._tokenizer
    size = backend.get_vocab_size(with_added_tokens=True)
    decoded = backend.decode_batch([[i] for i in range(size)], skip_special_tokens=False)
    for i, text in enumerate(decoded):
        assert table.pieces[i].decode("utf-8", "replace") == text
        assert table.lengths[i] == len(table.pieces[i])
    spaces = backend.token_to_id(" " * 4)
    assert (table.lengths[spaces], table.lead[spaces], table.trail[spaces]) == (4, 4, 4)


def test_tokenizers_the_table_cannot_serve_get_none(plain, tiny_model_dir) -> None:
    """Not ByteLevel-decoded (WordPiece, Llama-2-style), or changing every text (a prefix space,
    lowercasing), or decoding with transformers' space clean-up: the offset path labels them."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers
    from unit.data.test_labels import _wordpiece_tokenizer
    from tokenizer_kinds import sentencepiece_like

    assert byte_table(_wordpiece_tokenizer()) is None
    for scheme in ("llama2", "metaspace"):
        assert byte_table(sentencepiece_like(["the quick brown fox", "naïve café 42"] * 10, scheme, 300)) is None
    for change in ("prefix_space", "lowercase", "clean_up"):
        backend = Tokenizer.from_str(plain._tokenizer.to_str())
        if change == "prefix_space":
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
        elif change == "lowercase":
            backend.normalizer = normalizers.Lowercase()
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=change == "clean_up")
        assert byte_table(tokenizer) is None, change
        rows = _random_rows(seed=5, count=50)
        encoded = tokenizer([text for text, _ in rows], add_special_tokens=False, return_offsets_mapping=True)
        batch = label_batch(tokenizer, rows, check=False)
        assert all(batch.rows.row(r) == (ids, label_tokens(ids, offsets, spans))
                   for r, ((_, spans), ids, offsets) in enumerate(zip(rows, encoded["input_ids"], encoded["offset_mapping"])))
    assert byte_table(plain) is not None
