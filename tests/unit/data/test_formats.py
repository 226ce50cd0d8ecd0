"""Row formats to conversations: LLaMA-Factory's alpaca `history` turns come before the row's own."""

from __future__ import annotations

import pytest

from open_sft.data.formats import RowError, to_messages


def messages_of(row: dict) -> list[dict]:
    return list(to_messages(row, "alpaca"))


def test_alpaca_history_turns_precede_the_rows_own() -> None:
    row = {"instruction": "And 3+3?", "input": "", "output": "6", "system": "You are a calculator.",
           "history": [["What is 2+2?", "4"], ["And 2+3?", "5"]]}
    assert messages_of(row) == [
        {"role": "system", "content": "You are a calculator."},
        {"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 2+3?"}, {"role": "assistant", "content": "5"},
        {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "6"}]
    for empty in (None, []):  # a column read with Arrow gives rows without history an empty or null one
        assert len(messages_of({**row, "history": empty})) == 3


@pytest.mark.parametrize("history, message", [
    ("What is 2+2?", "alpaca 'history' must be a list of [instruction, response] pairs, got str"),
    ([["What is 2+2?"]], "alpaca 'history' item 1 must be an [instruction, response] pair of strings"),
    ([["a", "b"], ["c", None]], "alpaca 'history' item 2 must be an [instruction, response] pair of strings")])
def test_a_malformed_history_is_the_rows_error(history, message) -> None:
    with pytest.raises(RowError, match=message.replace("[", r"\[").replace("]", r"\]")):
        to_messages({"instruction": "q", "output": "a", "history": history}, "alpaca")


def test_an_assistants_thinking_parts_are_its_trace() -> None:
    """Mistral's and Anthropic's form of a trace, a content part {"type": "thinking", "thinking": ...} beside the
    text: the assistant message's reasoning_content (a row was refused: only text parts could be trained on). A trace
    the message gives as a field stays; a user's thinking part is still the row's error."""
    def assistant(content: list, **extra) -> dict:
        row = {"messages": [{"role": "user", "content": "6 x 7?"}, {"role": "assistant", "content": content, **extra}]}
        return list(to_messages(row, "messages"))[1]

    parts = [{"type": "thinking", "thinking": "Six sevens."}, {"type": "text", "text": "42."}]
    assert assistant(parts) == {"role": "assistant", "content": "42.", "reasoning_content": "Six sevens."}
    assert assistant(parts, reasoning_content="Mine.") == {"role": "assistant", "content": "42.",
                                                           "reasoning_content": "Mine."}
    # Arrow gives every message every key: an empty reasoning_content beside the parts dropped their trace
    assert assistant(parts, reasoning_content="") == {"role": "assistant", "content": "42.",
                                                      "reasoning_content": "Six sevens."}
    assert assistant(parts, reasoning_content=None, thinking="  ") == {
        "role": "assistant", "content": "42.", "thinking": "  ", "reasoning_content": "Six sevens."}
    # vLLM's and OpenRouter's `reasoning` field is a trace the message gives (the parts' one was added beside it)
    assert assistant(parts, reasoning="Mine.") == {"role": "assistant", "content": "42.", "reasoning": "Mine."}
    with pytest.raises(RowError, match=r"message 1 \(user\) content part 1 is 'thinking'; only text parts"):
        to_messages({"messages": [{"role": "user", "content": parts}]}, "messages")
