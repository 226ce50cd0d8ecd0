"""Text rows (continual pretraining): a row's document, and the tokens that open and close each document."""

from __future__ import annotations

from collections import Counter
from typing import Any

from open_sft.data.formats import RowError


def to_text(row: dict[str, Any], field: str = "text") -> str:
    """A text row's document: its `field` column (--dataset_text_field), else its 'text' (a .txt file's rows)."""
    name = field if field in row or "text" not in row else "text"
    text = row.get(name)
    if not isinstance(text, str):
        hint = ("--dataset_text_field; " if field != "text"
                else "a text column of another name: --dataset_text_field NAME; ")
        raise RowError(f"text row needs a string {field!r} ({hint}columns: {sorted(row)})", "missing_text")
    if not text.strip():
        raise RowError(f"{name!r} is empty", "empty_text")
    return text


def document_markers(tokenizer: Any, add_bos: bool) -> tuple[list[int], list[int]]:
    """The tokens before and after each document of a text source: bos first where the tokenizer's own encoding
    begins a text with it (Llama-3, Gemma: what the model sees first at inference; documents had none) or
    --add_bos asks for it, and eos after it (the document separator of continual pretraining). Where bos is eos
    (GPT-NeoX, OLMo) a document that opens with it has none after: the next one's opening closes it, one eos between
    documents, not `eos eos`."""
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    backend = getattr(tokenizer, "backend_tokenizer", None)  # its post-processor is what adds special tokens

    def first(special: bool) -> list[int]:
        ids = backend.encode("a", add_special_tokens=special).ids if backend is not None else tokenizer.encode(
            "a", add_special_tokens=special)
        return list(ids[:1])

    opens = bos is not None and (add_bos or (first(True) == [bos] and first(False) != [bos]))
    return ([bos] if opens else []), ([eos] if eos is not None and not (opens and bos == eos) else [])


def with_special_text(tokenizer: Any, texts: list[str]) -> dict[int, tuple[str, ...]]:
    """The positions of the documents that hold the literal text of one of the tokenizer's special tokens, which
    it encodes as that token (an `<|endoftext|>` inside a web page is a fake document end), with those tokens (but
    the ones the user added: render.special_text_in): counted and warned about (SourceReport.special_tokens_in_text),
    not changed."""
    from open_sft.data.chat.render import special_markers, special_text_finder

    tokens_in = special_text_finder(tokenizer, special_markers(tokenizer))
    found = {k: tokens_in(text) for k, text in enumerate(texts)}
    return {k: tokens for k, tokens in found.items() if tokens}


def special_text_notes(found: dict[int, tuple[str, ...]]) -> Counter:
    """The data report's notes of with_special_text's documents: how many, and how many hold each token."""
    from open_sft.data.chat.render import FOUND_NOTE

    notes = Counter(FOUND_NOTE + token for tokens in found.values() for token in tokens)
    return notes + Counter(special_tokens_in_text=len(found))
