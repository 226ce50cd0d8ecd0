"""The tokens where a generation prompt that opens a think block ends (DeepSeek-R1 distills' `<｜Assistant｜><think>\\n`):
the prompt and what the model writes after it are tokenized apart, as at inference (data/cuts.py).

The tokenizer here is a byte-level BPE whose only merge is `ĊĊ` ("\\n\\n"), with `<think>`/`</think>` as added tokens:
as GPT-NeoX's, OLMo's and Qwen2's do, it encodes `<think>\\n\\n</think>` (a row without a trace) with one `ĊĊ` token.
Encoded as one text the row trained `ĊĊ` right after `<think>`; at inference the prompt ends with `Ċ` and the model
has to write `Ċ`, `</think>`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from open_sft.config.args import DataArguments
from open_sft.data.build import build_examples
from open_sft.data.byte_level import byte_table
from open_sft.data.chat.examples import row_examples
from open_sft.data.cuts import splits_as_written
from open_sft.data.labels import IGNORE_INDEX, label_batch, special_markers

R1 = Path(__file__).parents[2] / "data" / "chat_templates" / "deepseek_r1_distill.jinja"
END = "<｜end▁of▁sentence｜>"
QUESTION = {"role": "user", "content": "What is 6 times 7?"}
NO_TRACE = {"role": "assistant", "content": "42."}


def merging_tokenizer(clean_up: bool = False) -> PreTrainedTokenizerFast:
    """Byte-level BPE, one merge (Ċ Ċ), R1's special tokens; `clean_up` (transformers' decode cleanup) leaves it
    without a byte table, so its rows take labels.py's offset path."""
    vocab = {char: i for i, char in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["ĊĊ"] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[("Ċ", "Ċ")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<｜begin▁of▁sentence｜>", eos_token=END,
                                        additional_special_tokens=["<｜User｜>", "<｜Assistant｜>"],
                                        clean_up_tokenization_spaces=clean_up)
    tokenizer.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in ("<think>", "</think>")])
    tokenizer.chat_template = R1.read_text()
    return tokenizer


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def prompt_and_label(tokenizer) -> tuple[list[int], list[int]]:
    """The no-trace row's generation prompt's tokens and, tokenized alone, what the model writes after it."""
    prompt = tokenizer.apply_chat_template([QUESTION], add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<｜Assistant｜><think>\n")
    prompt_ids, label_ids = ids(tokenizer, prompt), ids(tokenizer, "\n</think>\n\n42." + END)
    assert ids(tokenizer, prompt + "\n</think>\n\n42." + END) != prompt_ids + label_ids  # the whole text merges
    return prompt_ids, label_ids


@pytest.mark.parametrize("clean_up", [False, True], ids=["byte_level_path", "offset_path"])
def test_a_no_trace_row_has_the_prompts_tokens_then_the_models(tmp_path, clean_up) -> None:
    """Through the data pipeline (build_examples: workers, label check, cache): the row's tokens are the prompt's,
    untrained, then those of `\\n</think>\\n\\n42.` and the end of turn, each encoded alone: `<think>`, `Ċ` | `Ċ`,
    `</think>`; whole, `<think>`, `ĊĊ`, `</think>` (trained from `ĊĊ` on)."""
    tokenizer = merging_tokenizer(clean_up)
    assert (byte_table(tokenizer) is None) == clean_up
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"messages": [QUESTION, NO_TRACE]}) + "\n")
    (example,), (report,) = build_examples(DataArguments(dataset_mixer_list=[str(data), "1.0"], max_seq_length=4096),
                                           tokenizer, 0)
    prompt_ids, label_ids = prompt_and_label(tokenizer)
    assert example.input_ids == prompt_ids + label_ids
    assert example.labels == [IGNORE_INDEX] * len(prompt_ids) + label_ids
    assert tokenizer.convert_ids_to_tokens(example.input_ids[len(prompt_ids) - 2: len(prompt_ids) + 2]) == [
        "<think>", "Ċ", "Ċ", "</think>"]
    assert report.reasoning_opened_by_prompt == 1


def test_label_batch_cuts_where_the_rendering_says(tmp_path) -> None:
    """label_batch given the examples' cuts and no encoding made beforehand (a worker process's call): the same
    tokens; without the cuts, the whole text's (the rows every other template makes)."""
    tokenizer = merging_tokenizer()
    rendered = row_examples(tokenizer, [QUESTION, NO_TRACE], "all_assistant", special_markers(tokenizer))
    prompt_ids, label_ids = prompt_and_label(tokenizer)
    (text, spans), = rendered.examples
    assert rendered.cuts == ((spans[0][0],),)
    cut = label_batch(tokenizer, rendered.examples, cuts=rendered.cuts)
    assert cut.right.tolist() == [True]
    assert cut.rows.examples()[0].input_ids == prompt_ids + label_ids
    whole = label_batch(tokenizer, rendered.examples)
    assert whole.rows.examples()[0].input_ids == ids(tokenizer, text)


def test_tokenizers_that_spell_pieces_otherwise_keep_the_whole_text() -> None:
    """A SentencePiece-style tokenizer prepends "▁" to every text it encodes (Llama 2's normalizer) or to the first
    piece of each (Metaspace): a piece encoded apart would gain a space, so its rows stay whole."""
    from tokenizer_kinds import sentencepiece_like

    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, answer: 42 and 7!"] * 20
    assert splits_as_written(merging_tokenizer())
    for scheme in ("llama2", "metaspace"):
        tokenizer = sentencepiece_like(corpus, scheme, vocab_size=300)
        assert not splits_as_written(tokenizer), scheme
        rows = [("hello\nworld", [(6, 11)])]
        assert label_batch(tokenizer, rows, cuts=[(6,)]).rows.ids.tolist() == ids(tokenizer, "hello\nworld")
