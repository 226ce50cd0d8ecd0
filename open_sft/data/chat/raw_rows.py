"""TRL's prompt-completion rows of two strings (formats.py marks them `raw_text`): no chat template, the text as
TRL's SFTTrainer tokenizes it."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from open_sft.data.documents import document_markers


def raw_completion(tokenizer: PreTrainedTokenizerBase, prompt: str, completion: str, train_on: str
                   ) -> tuple[str, list[tuple[int, int]]]:
    """TRL's prompt-completion row of two strings as TRL's SFTTrainer trains it: the text prompt + completion, eos
    after it (unless the completion ends with it); the completion's characters train (all of them under
    --train_on all, as TRL's completion_only_loss=False). No chat template. The bos the tokenizer's own encoding
    opens a text with (Llama's, Mistral's, Gemma's: TRL tokenizes with the special tokens) is not written here:
    it is put before the text's tokens (workers.py, `raw_opening`), as the tokenizer adds it. Written as text,
    a sentencepiece tokenizer (Metaspace, prepend_scheme "first": Mistral's, Llama 2's) took the prompt for a
    section after a special token and lost its first word's "▁"."""
    eos = tokenizer.eos_token or ""
    text = prompt + completion + ("" if completion.endswith(eos) else eos)
    return text, [(0 if train_on == "all" else len(prompt), len(text))]


def raw_opening(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The tokens before a raw prompt + completion's text (raw_completion): the bos where the tokenizer's own
    encoding opens a text with it, else none."""
    return document_markers(tokenizer, False)[0]
