"""Where an assistant message's content lies in a row's one rendering: by the renderings of the messages
before and through it (prefix_place), or by the row rendered with a marker in the content's place (marked_place),
and how much of the text after a content is its end of turn (end_of_turn_length)."""

from __future__ import annotations

import os
from typing import Optional

from open_sft.data.chat.render import Renderer, TemplateState
from open_sft.data.chat.turns import last_marker_end, middle_closing, prefix_renders
from open_sft.data.formats import Messages

MAX_SUFFIXES = 1 << 16  # distinct end-of-turn suffixes remembered per tokenizer


def end_of_turn_length(state: TemplateState, suffix: str, markers: tuple[str, ...]) -> int:
    """Characters of `suffix` (text after an assistant's content) that belong to its end of turn:
    everything up to and including the last special-token marker, nothing after it. Remembered per
    template state (keyed by the suffix alone while the markers are the same object: hashing Llama 3's
    256 markers for every row would cost more than the lookup saves); a few suffixes recur in every row."""
    if state.markers is not markers:
        state.markers, state.end_of_turn = markers, {}
    end = state.end_of_turn.get(suffix)
    if end is None:
        end = last_marker_end(suffix, markers)
        if len(state.end_of_turn) < MAX_SUFFIXES:
            state.end_of_turn[suffix] = end
    return end


MARK = "\x00assistant content\x00"  # a string no template writes by itself


def marked_place(state: TemplateState, messages: Messages, tools: Optional[list], text: str, i: int,
                  markers: tuple[str, ...]) -> Optional[tuple[int, int, int]]:
    """Where what the template writes of assistant message i's content, stripped, starts and ends in
    `text`, and where the text its turn closes with ends; for rows the prefix renderings cannot place (a
    template that is not prefix-stable, one writing the system prompt into the last user turn, say; a
    content that also occurs in the text the template writes before it). Its place: the row rendered
    with that content replaced by a marker must be `text` with, in the marker's place, the content (as
    is, or stripped) or only its end (templates that keep only the answer after a `</think>`). Its
    closing: what the template writes after the content when it is the last message, as far as `text`
    has the same there (Phi-3 closes only the final turn with eos after <|end|>), or else when another
    message follows (OLMo's template: <|im_end|> there, eos at the end). None when the template reads
    the content otherwise."""
    marked = [dict(m, content=MARK) if k == i else m for k, m in enumerate(messages)]
    before, *after = state.draw(marked, False, tools).split(MARK)
    if len(after) != 1 or not (text.startswith(before) and text.endswith(after[0])) \
            or len(before) + len(after[0]) > len(text):
        return None
    inserted_end = len(text) - len(after[0])
    inserted = text[len(before): inserted_end]
    content = messages[i]["content"]
    if not (inserted in (content, content.strip())
            or (inserted.strip() and content.strip().endswith(inserted.strip()))):
        return None
    _, *closing = state.draw(marked[: i + 1], False, tools).split(MARK)
    if len(closing) != 1:
        return None
    closed = os.path.commonprefix([closing[0], text[inserted_end : inserted_end + len(closing[0])]])
    if not last_marker_end(closed, markers):  # a turn the template closes differently when another follows
        middle = middle_closing(state, markers)
        if middle and text.startswith(middle, inserted_end):
            closed = middle
    start = len(before) + len(inserted) - len(inserted.lstrip())
    return start, start + len(inserted.strip()), inserted_end + len(closed)


def prefix_place(draw: Renderer, messages: Messages, tools: Optional[list], text: str, i: int
                  ) -> Optional[tuple[int, int, int, int]]:
    """Where assistant message i's generation prompt ends, where its content, stripped, starts and ends in
    `text`, and where its turn ends: from the renderings of the messages before it (with the generation
    prompt) and through it, which must be prefixes of `text`, when the content occurs just once between
    their ends. None otherwise (a first message has no prefix to render: apply_chat_template refuses an
    empty conversation)."""
    prompt, through = prefix_renders(draw, messages, tools, text, i)
    if prompt is None or not (text.startswith(prompt) and text.startswith(through)):
        return None
    content = messages[i]["content"].strip()
    start = text.find(content, len(prompt), len(through))
    if start < 0 or text.find(content, start + 1, len(through)) >= 0:
        return None
    return len(prompt), start, start + len(content), len(through)
