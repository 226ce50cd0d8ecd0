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
