"""Deterministic generator of small, checkable instruction data in messages format.

Every row is a dict::

    {"id": "s0-000000", "task": "arithmetic",
     "messages": [{"role": "user", "content": "What is 3 plus 4?"},
                  {"role": "assistant", "content": "7"}],
     "answer": "7"}

Convention: the last message of every row is an assistant message whose content is
exactly ``answer``. Every assistant turn (including earlier turns of multi-turn rows)
is computable from the preceding user turn, so model outputs can be scored with
:func:`score_answer`.

Task kinds (equal shares, order shuffled by the seed): ``arithmetic``, ``string``,
``unit_conversion``, ``multi_turn`` and ``system_prompt``.

Command line::

    python -m open_sft sample-data OUT.jsonl --n 2000 --seed 0
"""

from __future__ import annotations

import json
import logging
import random
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from open_sft.config.whole_flags import WholeFlagParser
from open_sft.file_modes import output_file_problem

logger = logging.getLogger(__name__)

TASK_KINDS: tuple[str, ...] = (
    "arithmetic",
    "string",
    "unit_conversion",
    "multi_turn",
    "system_prompt",
)

WORDS: tuple[str, ...] = (
    "apple", "banana", "cherry", "garden", "river", "mountain", "pencil", "window",
    "rocket", "planet", "silver", "orange", "tiger", "rabbit", "castle", "bridge",
    "candle", "forest", "island", "jacket", "kitten", "lemon", "market", "number",
    "ocean", "puzzle", "quartz", "rainbow", "summer", "winter", "turtle", "violin",
    "wizard", "yellow", "zebra", "coffee", "dragon", "engine", "flower", "guitar",
    "hammer", "letter", "mirror", "needle", "pepper", "rhythm", "shadow", "ticket",
    "butter", "cookie", "little", "school", "balloon", "committee", "mississippi",
    "bookkeeper", "cat", "dog", "sun", "moon",
)

PHRASES: tuple[str, ...] = (
    "good morning", "see you soon", "hello world", "thank you", "open the door",
    "the sky is blue", "time to go", "well done", "happy birthday", "keep going",
)

NUMBER_WORDS: tuple[str, ...] = (
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
    "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen",
    "seventeen", "eighteen", "nineteen", "twenty",
)

Turn = tuple[str, str]  # (user content, assistant content)


def _msg(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


# --------------------------------------------------------------------------- arithmetic


def _arith_operands(rng: random.Random, op: str) -> tuple[int, int, int]:
    if op == "add":
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        return a, b, a + b
    if op == "subtract":
        a = rng.randint(0, 99)
        b = rng.randint(0, a)
        return a, b, a - b
    if op == "multiply":
        a, b = rng.randint(0, 12), rng.randint(0, 12)
        return a, b, a * b
    raise ValueError(f"unknown arithmetic op: {op!r}")


# The last phrasing of each op ("the sum of ...") is answered with a sentence; the
# others with the bare number, so the expected reply is a function of the prompt.
_ARITH_PHRASES: dict[str, tuple[str, ...]] = {
    "add": ("What is {a} plus {b}?", "Add {a} and {b}.", "Compute {a} + {b}.",
            "What is the sum of {a} and {b}?"),
    "subtract": ("What is {a} minus {b}?", "Subtract {b} from {a}.", "Compute {a} - {b}.",
                 "What is the difference between {a} and {b}?"),
    "multiply": ("What is {a} times {b}?", "Multiply {a} by {b}.", "Compute {a} * {b}.",
                 "What is the product of {a} and {b}?"),
}

_ARITH_SENTENCES: dict[str, str] = {
    "add": "The sum is {r}.",
    "subtract": "The difference is {r}.",
    "multiply": "The product is {r}.",
}


def _arith_question(rng: random.Random) -> tuple[str, str, int, bool]:
    """Return (question, op, result, wants_sentence) for a small integer arithmetic question."""
    op = rng.choice(("add", "subtract", "multiply"))
    a, b, result = _arith_operands(rng, op)
    phrases = _ARITH_PHRASES[op]
    idx = rng.randrange(len(phrases))
    return phrases[idx].format(a=a, b=b), op, result, idx == len(phrases) - 1


def make_arithmetic(rng: random.Random) -> list[dict[str, str]]:
    question, op, result, wants_sentence = _arith_question(rng)
    reply = _ARITH_SENTENCES[op].format(r=result) if wants_sentence else str(result)
    return [_msg("user", question), _msg("assistant", reply)]


# --------------------------------------------------------------------------- strings


def _string_turn(rng: random.Random) -> Turn:
    word = rng.choice(WORDS)
    kind = rng.choice(("reverse", "upper", "count", "char", "length"))
    if kind == "reverse":
        q = rng.choice(("Reverse the word {w}.", "Spell {w} backwards.",
                        "Write the word {w} in reverse order."))
        return q.format(w=word), word[::-1]
    if kind == "upper":
        q = rng.choice(("Write {w} in uppercase.", "Convert {w} to capital letters."))
        return q.format(w=word), word.upper()
    if kind == "count":
        letter = rng.choice(sorted(set(word)) + ["z", "e"])
        q = rng.choice(('How many times does the letter "{c}" appear in {w}?',
                        'Count the letter "{c}" in the word {w}.'))
        return q.format(c=letter, w=word), str(word.count(letter))
    if kind == "char":
        pos = rng.randint(1, len(word))
        q = "What is letter number {p} of the word {w}?"
        return q.format(p=pos, w=word), word[pos - 1]
    if kind == "length":
        q = rng.choice(("How many letters are in the word {w}?", "How long is the word {w}?"))
        return q.format(w=word), str(len(word))
    raise ValueError(f"unknown string task: {kind!r}")


def make_string(rng: random.Random) -> list[dict[str, str]]:
    question, reply = _string_turn(rng)
    return [_msg("user", question), _msg("assistant", reply)]


# --------------------------------------------------------------------------- units

# (from unit, to unit, factor, max input)
_CONVERSIONS: tuple[tuple[str, str, int, int], ...] = (
    ("kilometers", "meters", 1000, 50),
    ("meters", "centimeters", 100, 99),
    ("centimeters", "millimeters", 10, 99),
    ("kilograms", "grams", 1000, 50),
    ("hours", "minutes", 60, 24),
    ("minutes", "seconds", 60, 60),
    ("days", "hours", 24, 30),
    ("weeks", "days", 7, 52),
    ("liters", "milliliters", 1000, 20),
)


def _conversion_question(rng: random.Random) -> tuple[str, str, int, bool]:
    """Return (question, target unit, result, wants_unit); both directions, integer results.

    "Convert ..." questions are answered with the unit ("7000 meters"), the others with
    the bare number, so the expected reply is a function of the prompt.
    """
    src, dst, factor, max_in = rng.choice(_CONVERSIONS)
    value = rng.randint(1, max_in)
    if rng.random() < 0.3:  # reverse direction: pick an exact multiple
        src, dst, value, result = dst, src, value * factor, value
    else:
        result = value * factor
    phrases = ("How many {d} are in {v} {s}?", "{v} {s} is how many {d}?", "Convert {v} {s} to {d}.")
    idx = rng.randrange(len(phrases))
    return phrases[idx].format(v=value, s=src, d=dst), dst, result, idx == len(phrases) - 1


def make_unit_conversion(rng: random.Random) -> list[dict[str, str]]:
    question, unit, result, wants_unit = _conversion_question(rng)
    reply = f"{result} {unit}" if wants_unit else str(result)
    return [_msg("user", question), _msg("assistant", reply)]


# --------------------------------------------------------------------------- multi-turn


def _number_followup(rng: random.Random, value: int) -> Turn:
    kind = rng.choice(("double", "add", "subtract", "triple"))
    if kind == "double":
        return rng.choice(("Now double it.", "What is twice that?")), str(2 * value)
    if kind == "triple":
        return "Now multiply it by 3.", str(3 * value)
    k = rng.randint(1, 10)
    if kind == "add":
        return rng.choice(("Add {k} to that.", "Now add {k}.")).format(k=k), str(value + k)
    return "Subtract {k} from that.".format(k=k), str(value - k)


def make_multi_turn(rng: random.Random) -> list[dict[str, str]]:
    if rng.random() < 0.75:
        # First turn follows the single-turn reply rules; follow-ups are bare numbers.
        if rng.random() < 0.6:
            q1, op, value, wants_sentence = _arith_question(rng)
            a1 = _ARITH_SENTENCES[op].format(r=value) if wants_sentence else str(value)
        else:
            q1, unit, value, wants_unit = _conversion_question(rng)
            a1 = f"{value} {unit}" if wants_unit else str(value)
        q2, a2 = _number_followup(rng, value)
    else:
        word = rng.choice(WORDS)
        q1, a1 = f"Reverse the word {word}.", word[::-1]
        q2, a2 = rng.choice((("Now write it in uppercase.", a1.upper()),
                             ("How many letters does it have?", str(len(a1)))))
    return [_msg("user", q1), _msg("assistant", a1), _msg("user", q2), _msg("assistant", a2)]


# --------------------------------------------------------------------------- system prompt


def _sys_number(rng: random.Random) -> tuple[str, Turn]:
    system = rng.choice(("You answer with a single number.",
                         "Reply with only the number, nothing else."))
    if rng.random() < 0.6:
        question, _op, value, _ = _arith_question(rng)
    else:
        question, _unit, value, _ = _conversion_question(rng)
    return system, (question, str(value))


def _sys_upper(rng: random.Random) -> tuple[str, Turn]:
    system = rng.choice(("Reply in uppercase.", "Always answer in capital letters."))
    if rng.random() < 0.5:
        phrase = rng.choice(PHRASES)
        return system, (f"Repeat after me: {phrase}", phrase.upper())
    word = rng.choice(WORDS)
    return system, (f"Reverse the word {word}.", word[::-1].upper())


def _sys_words(rng: random.Random) -> tuple[str, Turn]:
    system = "You write numbers as English words."
    a = rng.randint(0, 10)
    b = rng.randint(0, 10)
    return system, (f"What is {a} plus {b}?", NUMBER_WORDS[a + b])


def _sys_yes_no(rng: random.Random) -> tuple[str, Turn]:
    system = "Answer only yes or no."
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    if rng.random() < 0.5:
        return system, (f"Is {a} greater than {b}?", "yes" if a > b else "no")
    return system, (f"Is {a} an even number?", "yes" if a % 2 == 0 else "no")


def make_system_prompt(rng: random.Random) -> list[dict[str, str]]:
    builder = rng.choice((_sys_number, _sys_upper, _sys_words, _sys_yes_no))
    system, (question, reply) = builder(rng)
    return [_msg("system", system), _msg("user", question), _msg("assistant", reply)]


_MAKERS: dict[str, Callable[[random.Random], list[dict[str, str]]]] = {
    "arithmetic": make_arithmetic,
    "string": make_string,
    "unit_conversion": make_unit_conversion,
    "multi_turn": make_multi_turn,
    "system_prompt": make_system_prompt,
}


# --------------------------------------------------------------------------- public API


def generate_examples(n: int, seed: int = 0) -> list[dict]:
    """Generate ``n`` rows deterministically from ``seed`` (equal task shares, shuffled)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    rng = random.Random(seed)
    kinds = [TASK_KINDS[i % len(TASK_KINDS)] for i in range(n)]
    rng.shuffle(kinds)
    rows: list[dict] = []
    for i, kind in enumerate(kinds):
        messages = _MAKERS[kind](rng)
        rows.append({
            "id": f"s{seed}-{i:06d}",
            "task": kind,
            "messages": messages,
            "answer": messages[-1]["content"],
        })
    return rows


_WS = re.compile(r"\s+")


def normalize_answer(text: str) -> str:
    """Lower-case, collapse whitespace, strip surrounding space and trailing periods."""
    if not isinstance(text, str):
        raise TypeError(f"expected str, got {type(text).__name__}")
    return _WS.sub(" ", text).strip().rstrip(".").strip().lower()


def score_answer(expected: str, generated: str) -> bool:
    """True when ``generated`` equals ``expected`` up to whitespace, case and a trailing period."""
    return normalize_answer(expected) == normalize_answer(generated)


def dumps_row(row: dict) -> str:
    """Serialise one row as a single JSON line (no trailing newline), stable byte output."""
    return json.dumps(row, ensure_ascii=False, separators=(", ", ": "))


def write_jsonl(rows: Iterable[dict], path: str | Path) -> Path:
    """Write rows as UTF-8 JSON lines (``\\n`` endings); returns the path written."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with out.open("w", encoding="utf-8", newline="\n") as fh:
        for row in rows:
            fh.write(dumps_row(row) + "\n")
            count += 1
    logger.info("wrote %d rows to %s", count, out)
    return out


def read_jsonl(path: str | Path) -> list[dict]:
    """Read a JSON-lines file written by :func:`write_jsonl`."""
    with Path(path).open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def main(argv: Sequence[str] | None = None, prog: str = "open_sft sample-data") -> int:
    parser = WholeFlagParser(
        prog=prog,
        description="Write deterministic, checkable instruction data as JSON lines.",
    )
    parser.add_argument("out", help="output .jsonl path")
    parser.add_argument("--n", type=int, default=2000, help="number of rows (default 2000)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    args = parser.parse_args(argv)
    if args.n < 0:
        parser.error("--n must be >= 0")
    why = output_file_problem(Path(args.out))
    if why:
        print(f"error: {args.out}: {why} (the .jsonl to write)", file=sys.stderr)
        return 2
    path = write_jsonl(generate_examples(args.n, args.seed), args.out)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
