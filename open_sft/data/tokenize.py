"""Chat template rendering and exact assistant-only labels.

The trained character spans are found by rendering prefixes of the conversation: for assistant
message i, `render(messages[:i], add_generation_prompt=True)` ends where its content starts, and
`render(messages[:i+1])` ends after its end-of-turn marker. The rendered text is then tokenized
once with offsets, and a token is trained when its characters overlap a trained span. Working in
characters (not token counts of prefixes) keeps the labels exact when BPE merges across a turn
boundary.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable, Optional

from transformers import PreTrainedTokenizerBase

from open_sft.data.formats import Messages, RowError

IGNORE_INDEX = -100


@dataclass(frozen=True)
class Example:
    """One tokenized training example; labels are IGNORE_INDEX where no loss is taken."""

    input_ids: list[int]
    labels: list[int]


_PROBE = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"},
          {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3 + 3?"},
          {"role": "assistant", "content": " 6 \n"}]
_RENDERERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _direct_renderer(tokenizer: PreTrainedTokenizerBase) -> Optional[Callable[[Messages, bool], str]]:
    """Render with the compiled Jinja template directly, skipping apply_chat_template's per-call
    argument handling (about 60 % of the data build's time). Used only if it reproduces
    apply_chat_template exactly on a probe conversation; otherwise None (use the public API)."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        compiled = _compile_jinja_template(tokenizer.chat_template)
        variables = dict(tokenizer.special_tokens_map)

        def direct(messages: Messages, add_generation_prompt: bool) -> str:
            return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=None,
                                   documents=None, **variables)

        for k in range(1, len(_PROBE) + 1):
            for generation_prompt in (False, True):
                expected = tokenizer.apply_chat_template(_PROBE[:k], tokenize=False,
                                                         add_generation_prompt=generation_prompt)
                if direct(_PROBE[:k], generation_prompt) != expected:
                    return None
        return direct
    except Exception:  # any template or transformers change: fall back to the public API
        return None


def render(tokenizer: PreTrainedTokenizerBase, messages: Messages, add_generation_prompt: bool = False,
           tools: Optional[list] = None) -> str:
    """The chat template's text; rows with tools go through apply_chat_template (the direct renderer was
    only checked against it without tools)."""
    cached = _RENDERERS.get(tokenizer)
    if cached is None or cached[0] != tokenizer.chat_template:
        cached = (tokenizer.chat_template, _direct_renderer(tokenizer))
        _RENDERERS[tokenizer] = cached
    if cached[1] is not None and tools is None:
        return cached[1](messages, add_generation_prompt)
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         tools=tools)


def _end_of_turn_length(suffix: str, markers: tuple[str, ...]) -> int:
    """Characters of `suffix` (text after an assistant's content) that belong to its end of turn:
    everything up to and including the last special-token marker, nothing after it."""
    end = 0
    for marker in markers:
        position = suffix.rfind(marker)
        if position >= 0:
            end = max(end, position + len(marker))
    return end


def special_markers(tokenizer: PreTrainedTokenizerBase) -> tuple[str, ...]:
    """Strings that can close an assistant turn: the tokenizer's special tokens, including added
    tokens flagged special (Llama 3's `<|eot_id|>`, chatml's `<|im_end|>`), longest first."""
    tokens = set(tokenizer.all_special_tokens)
    tokens |= {token.content for token in tokenizer.added_tokens_decoder.values() if token.special}
    return tuple(sorted(tokens, key=len, reverse=True))


def trained_spans(
    tokenizer: PreTrainedTokenizerBase, messages: Messages, train_on: str, markers: tuple[str, ...]
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the [start, end) character spans that carry a loss. The row's tools
    (if any) are rendered in every prefix too, so the prefixes stay prefixes of the full text."""
    tools = getattr(messages, "tools", None)
    text = render(tokenizer, messages, tools=tools)
    if train_on == "all":
        return text, [(0, len(text))]
    assistant_indices = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if train_on == "last_assistant":
        assistant_indices = assistant_indices[-1:]
    spans = []
    for i in assistant_indices:
        prompt = render(tokenizer, messages[:i], add_generation_prompt=True, tools=tools)
        through = render(tokenizer, messages[: i + 1], tools=tools)
        content = messages[i]["content"]
        if text.startswith(prompt) and text.startswith(through):
            start = text.find(content.strip(), len(prompt))
            if start < 0 or start >= len(through):
                raise RowError(f"message {i + 1} (assistant): its content does not appear in the rendered template")
            content_end = start + len(content.strip())
            end = content_end + _end_of_turn_length(text[content_end : len(through)], markers)
        else:
            raise RowError(
                "the chat template is not prefix-stable for this conversation (rendering the first "
                f"{i} messages is not a prefix of the full rendering); choose another template"
            )
        spans.append((start, end))
    return text, spans


def label_tokens(
    input_ids: list[int], offsets: list[tuple[int, int]], spans: list[tuple[int, int]]
) -> list[int]:
    """Copy each token id whose characters overlap a trained span; IGNORE_INDEX elsewhere."""
    labels = [IGNORE_INDEX] * len(input_ids)
    span_index = 0
    for t, (start, end) in enumerate(offsets):
        while span_index < len(spans) and spans[span_index][1] <= start:
            span_index += 1
        if span_index == len(spans):
            break
        span_start, span_end = spans[span_index]
        if end > span_start and start < span_end:
            labels[t] = input_ids[t]
    return labels


def trained_token_runs(input_ids: list[int], labels: list[int]) -> list[list[int]]:
    """The maximal runs of consecutive trained tokens (label != IGNORE_INDEX), in order."""
    runs: list[list[int]] = []
    previous_trained = False
    for token, label in zip(input_ids, labels):
        trained = label != IGNORE_INDEX
        if trained:
            if not previous_trained:
                runs.append([])
            runs[-1].append(token)
        previous_trained = trained
    return runs


def truncate_example(example: Example, max_seq_length: int, truncation: str) -> tuple[Optional[Example], str]:
    """Apply --max_seq_length; returns (example or None, drop/keep reason)."""
    if len(example.input_ids) <= max_seq_length:
        return example, "kept"
    if truncation == "drop":
        return None, "too_long"
    cut = Example(example.input_ids[:max_seq_length], example.labels[:max_seq_length])
    if all(label == IGNORE_INDEX for label in cut.labels[1:]):
        return None, "no_trained_tokens_after_truncation"
    return cut, "truncated"


def tokenize_conversations(
    tokenizer: PreTrainedTokenizerBase, texts_and_spans: list[tuple[str, list[tuple[int, int]]]]
) -> list[Example]:
    """Tokenize rendered conversations in one batch (fast tokenizers parallelise it) and label them."""
    texts = [text for text, _ in texts_and_spans]
    encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    return [
        Example(ids, label_tokens(ids, offsets, spans))
        for ids, offsets, (_, spans) in zip(encoded["input_ids"], encoded["offset_mapping"], texts_and_spans)
    ]
