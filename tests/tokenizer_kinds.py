"""Tokenizers of the other families users bring, trained here in a second (nothing is downloaded):
the embedded tokenizer is byte-level BPE (GPT-2, GPT-NeoX/OLMo, Llama 3, Qwen); these are
SentencePiece-style BPE with "▁" for spaces and byte fallback, as Llama 2 and Mistral ship them."""

from __future__ import annotations

from typing import Iterable

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPM_SPECIALS = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]


def sentencepiece_like(corpus: Iterable[str], scheme: str, vocab_size: int = 600) -> PreTrainedTokenizerFast:
    """`scheme` "llama2": a normalizer prepends "▁" and turns spaces into "▁", no pre-tokenizer (so every
    piece between added tokens gets its own "▁"), a decoder that strips the first space. "metaspace":
    the Metaspace pre-tokenizer and decoder, "▁" prepended to the first piece only. Merges are learned
    within words, as SentencePiece learns them."""
    backend = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    if scheme == "llama2":
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        backend.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")  # for training only
        backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                             decoders.Strip(" ", 1, 0)])
    elif scheme == "metaspace":
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(replacement="▁",
                                                                                         prepend_scheme="first")])
    else:
        raise ValueError(f"unknown scheme {scheme!r}")
    backend.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPM_SPECIALS))
    if scheme == "llama2":
        backend.pre_tokenizer = None
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   clean_up_tokenization_spaces=False)
