"""--add_tokens and --add_special_tokens: a file's tokens added to the tokenizer, and a warning for the ones that
will split words. A tokenizer matches an added token (special or not) anywhere in the text before it splits the
text into words, so an added `def` makes `default` `def` + `ault` and `self` makes `selfish` `self` + `ish`,
silently, in every row of the data."""

from __future__ import annotations

import logging
import re
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from open_sft.data.chat.templates import remember_new_tokens

logger = logging.getLogger(__name__)
WORD_MARKS = ("Ġ", "▁", "##")  # how byte-level BPE, SentencePiece and WordPiece vocabularies mark word starts
SHOWN = 3  # words named per token in the warning


def read_token_file(path: str) -> list[str]:
    """Tokens of an --add_tokens file: one per line, blank lines and repeats skipped."""
    tokens: list[str] = []
    for line in Path(path).expanduser().read_text(encoding="utf-8").splitlines():
        token = line.strip()
        if token and token not in tokens:
            tokens.append(token)
    return tokens


def add_tokens(tokenizer: PreTrainedTokenizerBase, path: str, special: bool, flag: str = "--add_tokens") -> list[int]:
    """Add a file's tokens that the tokenizer lacks; returns their ids (remembered for the embedding init). The
    file's tokens (but the tokenizer's own named ones: eos, bos, pad, its additional special tokens) are the user's
    (`open_sft_user_tokens`): written in the data on purpose, their text there is not warned about as a special
    token's (open_sft.data.chat.render.special_text_in), whether this run adds them or a fast tokenizer has them from
    an earlier run's (a slow one saves added special tokens among its named ones: warned about then)."""
    known, listed = tokenizer.get_vocab(), read_token_file(path)
    named = set(tokenizer.all_special_tokens)
    tokenizer.open_sft_user_tokens = tuple(sorted(set(getattr(tokenizer, "open_sft_user_tokens", ())) | {
        token for token in listed if token not in named}))
    new = [t for t in listed if t not in known]
    splitting = words_split_by(new, known)
    if splitting:
        shown = "; ".join(f"{token!r} inside {', '.join(words)}" for token, words in list(splitting.items())[:5])
        logger.warning("%s %s: %d added token(s) occur inside words of the tokenizer's vocabulary (%s%s): a tokenizer "
                       "matches an added token anywhere in the text, special or not, so those words will be split "
                       "around it in the data and at generation. To keep words whole, add tokens that cannot occur "
                       "inside a word (e.g. '<def>' rather than 'def')", flag, path, len(splitting), shown,
                       "; ..." if len(splitting) > 5 else "")
    tokenizer.add_tokens(new, special_tokens=special)
    ids = tokenizer.convert_tokens_to_ids(new)
    remember_new_tokens(tokenizer, ids)
    logger.info("added %d %stokens from %s (%d were already known)", len(new), "special " if special else "",
                path, len(listed) - len(new))
    return ids


def words_split_by(tokens: list[str], vocab: dict[str, int]) -> dict[str, list[str]]:
    """Each token made of word characters that occurs inside longer words of the vocabulary, with up to SHOWN of
    them, the most frequent first (a BPE vocabulary's ids follow its merges, so lower ids are commoner)."""
    words: dict[str, int] = {}
    for piece, index in vocab.items():
        for mark in WORD_MARKS:
            piece = piece.removeprefix(mark)
        if piece.isalpha() and index < words.get(piece, index + 1):
            words[piece] = index
    ranked = sorted(words, key=words.get)
    found = {}
    for token in tokens:
        if not re.fullmatch(r"\w+", token):  # '<tool>', '<|x|>': nothing inside a word looks like it
            continue
        inside = [word for word in ranked if token in word and word != token][:SHOWN]
        if inside:
            found[token] = inside
    return found
