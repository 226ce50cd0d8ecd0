"""Which row format a source is in (--dataset_format auto): read from the columns of its first row, the
conversation column named by --sft_messages_key (role/content messages, or ShareGPT's from/value turns under any
name), as the format names open_sft.data.formats.to_messages converts ("messages:KEY", "sharegpt:KEY")."""

from __future__ import annotations

from typing import Any

from open_sft.data.dataset_shapes import SHAPES, decoded_list, shape_of, unread_columns
from open_sft.errors import UserError


def detect_format(row: dict[str, Any], where: str, messages_key: str = "messages", text_field: str = "text") -> str:
    """The format of a source, from the columns of its first row (a --dataset_text_field column named: text)."""
    if text_field != "text" and text_field in row:
        return "text"
    for key in dict.fromkeys((messages_key, "conversations")):  # either holds role/content or from/value turns
        if key in row:
            return _turns_format(key, row[key])
    if isinstance(decoded_list(row.get("conversation")), list):  # LMSYS-Chat-1M's and WildChat's turns
        return _turns_format("conversation", row["conversation"])
    if "instruction" in row and "output" in row:
        return "alpaca"
    if "prompt" in row and "completion" in row:
        return "prompt_completion"
    if "text" in row:  # before the shapes: a text column beside question/answer (or problem/solution) is documents
        return "text"
    shape = shape_of(row)  # a popular dataset's own columns (open_sft.data.dataset_shapes)
    if shape:
        return _all_read(row, shape, where)
    turns = [column for column, value in row.items() if _holds_turns(decoded_list(value))]
    hint = f" (the column {turns[0]!r} holds turns: --sft_messages_key {turns[0]})" if turns else ""
    raise UserError(
        f"{where}: cannot tell the data format from the columns {sorted(row)}{hint}; accepted: messages "
        "(a 'messages' list of role/content), alpaca (instruction/input/output), sharegpt ('conversations' "
        "of from/value), prompt_completion (TRL's 'prompt' and 'completion'), text (a 'text' column of raw "
        "documents), and the columns of xLAM, Llama-Nemotron, OpenMathReasoning, s1K, OpenThoughts' metadata, "
        "problem/solution, question/answer and glaive (README \"Data formats\"). Rename the columns or convert the "
        "file (a messages column of another name: --sft_messages_key; a text column of another name: "
        "--dataset_text_field NAME)"
    )


def _holds_turns(value: Any) -> bool:
    """Whether a column holds a conversation: a list of role/content messages or from/value turns."""
    return isinstance(value, list) and bool(value) and all(
        isinstance(turn, dict) and ("role" in turn or "from" in turn) for turn in value)


def _all_read(row: dict[str, Any], shape: str, where: str) -> str:
    """`shape`, unless reading the row as it would drop columns its answer may depend on (a RAG context, choices)."""
    dropped = unread_columns(row, shape)
    if dropped:
        own = " and ".join(repr(column) for column in sorted(SHAPES[shape][0][0]))
        raise UserError(
            f"{where}: the columns {own} would be read as a user turn and its answer ({shape}), dropping the "
            f"columns {dropped}, which the answer may depend on (a passage, the choices) and the model would never "
            "see. Convert the rows to messages (the user turn written with what they hold) or prompt_completion "
            "('prompt' and 'completion'); where those columns are only metadata, drop them from the file")
    return shape


def _turns_format(key: str, turns: Any) -> str:
    """The format of a source whose conversation is in column `key`: sharegpt or messages, as its first turn says."""
    return sharegpt_format(key) if _sharegpt_turns(decoded_list(turns)) else messages_format(key)


def _sharegpt_turns(turns: Any) -> bool:
    """Whether a conversation column holds ShareGPT's from/value turns (its first turn says), not role/content."""
    first = turns[0] if isinstance(turns, list) and turns else None
    return isinstance(first, dict) and "from" in first and "role" not in first


def sharegpt_format(key: str) -> str:
    """The format name of sharegpt rows whose from/value turns are in column `key` ('conversations', its own)."""
    return "sharegpt" if key == "conversations" else f"sharegpt:{key}"


def messages_format(key: str) -> str:
    """The format name of messages rows whose conversation is in column `key` (--sft_messages_key)."""
    return "messages" if key == "messages" else f"messages:{key}"


def source_format(args: Any, first_row: dict, where: str) -> str:
    """--dataset_format (of `args`, the DataArguments), or the format detected from a source's first row; messages
    rows read their conversation from --sft_messages_key."""
    fmt = args.dataset_format if args.dataset_format != "auto" else detect_format(
        first_row, where, args.sft_messages_key, args.dataset_text_field)
    if fmt == "sharegpt" and "conversations" not in first_row and args.sft_messages_key in first_row:
        return sharegpt_format(args.sft_messages_key)  # from/value turns under --sft_messages_key (or 'messages')
    return messages_format(args.sft_messages_key) if fmt == "messages" else fmt
