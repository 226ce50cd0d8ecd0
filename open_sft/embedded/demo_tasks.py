"""The demo's tasks: small rules the embedded model learns in a minute, scored on combinations it never saw.

Four kinds of task, each answered by a rule over a small closed vocabulary::

    translate  "Translate to French: green duck"                        -> "canard vert"
    where      "Carla lives in Dublin. Where does Carla live?"          -> "Dublin"
    who        "Carla lives in Dublin. Who lives in Dublin?"            -> "Carla"
    pet        "Lena has a wolf. Which animal does Lena have?"          -> "wolf"

`translate` is a word-for-word dictionary lookup with the French order (noun, then adjective); the other three
read a fact from the prompt and answer with the right part of it (a city, a name or an animal).

Held out honestly: each relation (color-animal, name-city, name-animal) has a set of pairs that only the
held-out rows use. No training row contains a held-out pair, so a held-out prompt (and its fact) was never
seen in training; every single word was, in other combinations. The model has to apply the rule to a new
combination, and exact-match scoring (:func:`open_sft.export.compare.exact_match`) leaves no partial credit.

The demo's files are bundled (``data/demo_train.jsonl``, ``data/demo_held_out.jsonl``); the demo's model is
built from them::

    python -m open_sft.embedded.demo_tasks data [DIR]    # regenerate the files (default: the bundled ones)
    python -m open_sft.embedded.demo_tasks base OUT_DIR  # the model before fine-tuning (DEMO_MODEL)
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence
from pathlib import Path

from open_sft.config.whole_flags import WholeFlagParser
from open_sft.embedded.sample_data import write_jsonl

DATA_DIR = Path(__file__).resolve().parent / "data"
TRAIN_FILE, HELD_OUT_FILE = "demo_train.jsonl", "demo_held_out.jsonl"
DEMO_TRAIN, DEMO_HELD_OUT = DATA_DIR / TRAIN_FILE, DATA_DIR / HELD_OUT_FILE
TRAIN_ROWS, HELD_OUT_ROWS, SEED = 2400, 40, 0
HELD_OUT_SHARE = 0.15  # of each relation's pairs, reserved for the held-out rows
# The demo's model (build_demo_base): 1.1 M parameters, fine-tuned by configs/examples/demo.yaml.
DEMO_MODEL: dict[str, int] = {"vocab_size": 512, "hidden_size": 128, "num_layers": 4, "num_heads": 4,
                              "num_kv_heads": 2, "max_position_embeddings": 256}

# English -> French; masculine nouns and the masculine adjective, so the rule has no exceptions.
COLORS: dict[str, str] = {
    "red": "rouge", "blue": "bleu", "green": "vert", "black": "noir", "white": "blanc",
    "yellow": "jaune", "gray": "gris", "pink": "rose", "brown": "brun", "purple": "violet",
}
ANIMALS: dict[str, str] = {
    "cat": "chat", "dog": "chien", "horse": "cheval", "rabbit": "lapin", "bird": "oiseau", "fish": "poisson",
    "wolf": "loup", "lion": "lion", "bear": "ours", "duck": "canard", "pig": "cochon", "sheep": "mouton",
}
NAMES: tuple[str, ...] = ("Anna", "Ben", "Carla", "David", "Emma", "Felix", "Grace", "Hugo", "Iris", "Jack",
                          "Lena", "Marco", "Nina", "Oscar", "Paula", "Rosa", "Sam", "Tom", "Vera", "Zoe")
CITIES: tuple[str, ...] = ("Paris", "Rome", "Berlin", "Madrid", "Lisbon", "Vienna", "Prague", "Oslo",
                           "Dublin", "Athens", "Warsaw", "Zurich", "Tokyo", "Cairo", "Lima", "Boston")

Pair = tuple[str, str]


def _translate(color: str, animal: str) -> tuple[str, str]:
    return f"Translate to French: {color} {animal}", f"{ANIMALS[animal]} {COLORS[color]}"


def _where(name: str, city: str) -> tuple[str, str]:
    return f"{name} lives in {city}. Where does {name} live?", city


def _who(name: str, city: str) -> tuple[str, str]:
    return f"{name} lives in {city}. Who lives in {city}?", name


def _pet(name: str, animal: str) -> tuple[str, str]:
    return f"{name} has a {animal}. Which animal does {name} have?", animal


# kind -> (relation, the prompt and answer of one pair of that relation)
TASKS: dict[str, tuple[str, Callable[[str, str], tuple[str, str]]]] = {
    "translate": ("color-animal", _translate),
    "where": ("name-city", _where),
    "who": ("name-city", _who),
    "pet": ("name-animal", _pet),
}
RELATIONS: dict[str, tuple[Sequence[str], Sequence[str]]] = {
    "color-animal": (tuple(COLORS), tuple(ANIMALS)),
    "name-city": (NAMES, CITIES),
    "name-animal": (NAMES, tuple(ANIMALS)),
}


def split_pairs(seed: int = SEED) -> dict[str, tuple[list[Pair], list[Pair]]]:
    """Per relation, its (training pairs, held-out pairs): every pair in exactly one, the held-out share
    HELD_OUT_SHARE, drawn from `seed`."""
    rng = random.Random(seed)
    split = {}
    for relation, (left, right) in RELATIONS.items():
        pairs = list(itertools.product(left, right))
        rng.shuffle(pairs)
        cut = round(len(pairs) * HELD_OUT_SHARE)
        split[relation] = (sorted(pairs[cut:]), sorted(pairs[:cut]))
    return split


def _row(row_id: str, kind: str, pair: Pair) -> dict:
    prompt, answer = TASKS[kind][1](*pair)
    return {"id": row_id, "task": kind,
            "messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}],
            "answer": answer}


def _rows(n: int, pairs_of: Callable[[str], list[Pair]], rng: random.Random, prefix: str,
          distinct: bool) -> list[dict]:
    """`n` rows, the kinds in equal shares (in turn), each on a pair drawn from `pairs_of(relation)`; with
    `distinct`, no pair is drawn twice for a kind (the held-out rows: no prompt counted twice)."""
    pools = {kind: rng.sample(pairs_of(relation), len(pairs_of(relation)))
             for kind, (relation, _) in TASKS.items()} if distinct else {}
    rows = []
    for i in range(n):
        kind = list(TASKS)[i % len(TASKS)]
        pair = pools[kind].pop() if distinct else rng.choice(pairs_of(TASKS[kind][0]))
        rows.append(_row(f"{prefix}-{i:05d}", kind, pair))
    return rows


def demo_splits(n_train: int = TRAIN_ROWS, n_held_out: int = HELD_OUT_ROWS,
                seed: int = SEED) -> tuple[list[dict], list[dict]]:
    """The demo's (training rows, held-out rows), deterministic in `seed`, in sample_data's row format
    (`messages` ending with the assistant's answer, `answer`, `task`, `id`). Training rows repeat pairs of the
    training split; held-out rows use distinct pairs of the held-out split only."""
    for name, value in (("n_train", n_train), ("n_held_out", n_held_out)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    split = split_pairs(seed)
    room = min(len(split[relation][1]) for relation, _ in TASKS.values())
    if n_held_out > room * len(TASKS):
        raise ValueError(f"n_held_out={n_held_out}: at most {room * len(TASKS)} distinct held-out tasks exist")
    rng = random.Random(seed + 1)
    train = _rows(n_train, lambda relation: split[relation][0], rng, "demo-train", distinct=False)
    held_out = _rows(n_held_out, lambda relation: split[relation][1], rng, "demo-held-out", distinct=True)
    return train, held_out


def write_demo_data(out_dir: str | Path = DATA_DIR) -> tuple[Path, Path]:
    """Write TRAIN_FILE and HELD_OUT_FILE (the default sizes and seed) into `out_dir`; returns their paths."""
    train, held_out = demo_splits()
    out = Path(out_dir)
    return write_jsonl(train, out / TRAIN_FILE), write_jsonl(held_out, out / HELD_OUT_FILE)


def build_demo_base(out_dir: str | Path) -> Path:
    """The demo's model before fine-tuning: the embedded default of DEMO_MODEL's shape, its tokenizer trained on
    the demo's training tasks (every word of the held-out tasks is in them)."""
    from open_sft.embedded.factory import build_embedded_default

    return build_embedded_default(out_dir, data_path=DEMO_TRAIN, **DEMO_MODEL)


def main(argv: Sequence[str] | None = None) -> int:
    parser = WholeFlagParser(prog="python -m open_sft.embedded.demo_tasks",
                             description="The demo's tasks and model (scripts/demo.sh).")
    commands = parser.add_subparsers(dest="command", required=True)
    data = commands.add_parser("data", help="write the demo's training and held-out tasks")
    data.add_argument("out_dir", nargs="?", default=str(DATA_DIR), help="where (default: the bundled files)")
    base = commands.add_parser("base", help="build the demo's model before fine-tuning")
    base.add_argument("out_dir", help="the directory to write the model and tokenizer into")
    args = parser.parse_args(argv)
    paths = write_demo_data(args.out_dir) if args.command == "data" else (build_demo_base(args.out_dir),)
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
