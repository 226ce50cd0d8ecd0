"""Build the "embedded default": a tiny tokenizer + Llama model made offline from bundled data.

Nothing is downloaded. The tokenizer is a byte-level BPE trained with the ``tokenizers``
library on the bundled sample conversations; the model is a small randomly initialised
``LlamaForCausalLM``. Both are deterministic functions of their arguments, so building
twice with the same arguments gives byte-identical ``tokenizer.json`` and
``model.safetensors``.

Command line::

    open_sft embedded OUT_DIR [--hidden_size 64] [--num_layers 2] ...
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from open_sft.config.whole_flags import WholeFlagParser
from open_sft.data.chat.templates import EMBEDDED
from open_sft.distributed.env import setup_cpu_environment
from open_sft.errors import UserError
from open_sft.file_modes import share_as_umask, writable_dir_problem
from open_sft.monitor.quiet import quiet_third_parties

logger = logging.getLogger(__name__)

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
ROLE_TOKENS: tuple[str, ...] = ("<|system|>", "<|user|>", "<|assistant|>")
# Order fixes the ids: eos=0, bos=1, pad=2, system=3, user=4, assistant=5.
SPECIAL_TOKENS: tuple[str, ...] = (EOS_TOKEN, BOS_TOKEN, PAD_TOKEN, *ROLE_TOKENS)

MODEL_MAX_LENGTH = 2048
VOCAB_MULTIPLE = 64
DEFAULT_DATA_PATH = Path(__file__).resolve().parent / "data" / "sample.jsonl"

# Tulu-style and prefix-stable: rendering messages[:k] (without a generation prompt) is a string
# prefix of rendering all messages.
CHAT_TEMPLATE = EMBEDDED


def _round_up(value: int, multiple: int) -> int:
    return ((value + multiple - 1) // multiple) * multiple


def _require_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_vocab_size(vocab_size: int) -> None:
    _require_positive("vocab_size", vocab_size)
    min_size = len(SPECIAL_TOKENS) + len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < min_size:
        raise ValueError(f"vocab_size must be >= {min_size} (bytes + special tokens), got {vocab_size}")


def build_tokenizer(texts: Iterable[str], vocab_size: int = 2048) -> PreTrainedTokenizerFast:
    """Train a deterministic byte-level BPE on ``texts`` and wrap it for transformers.

    The result has eos/bos/pad plus the role markers as atomic special tokens, the
    project chat template, and no automatic BOS insertion (the template adds BOS).
    ``vocab_size`` is an upper bound: training stops early when no merges remain.
    """
    _check_vocab_size(vocab_size)
    corpus = [t for t in texts]
    for text in corpus:
        if not isinstance(text, str):
            raise TypeError(f"texts must be strings, got {type(text).__name__}")
    if not corpus:
        raise ValueError("texts is empty: nothing to train the tokenizer on")

    backend = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer=trainer, length=len(corpus))

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        extra_special_tokens=list(ROLE_TOKENS),
        model_max_length=MODEL_MAX_LENGTH,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    _check_tokenizer(tokenizer)
    logger.info("trained byte-level BPE: %d tokens (requested <= %d)", len(tokenizer), vocab_size)
    return tokenizer


def _check_tokenizer(tokenizer: PreTrainedTokenizerFast) -> None:
    """Raise if a special token is not a single id or if encode inserts extra tokens."""
    for token in SPECIAL_TOKENS:
        ids = tokenizer.encode(token, add_special_tokens=True)
        if len(ids) != 1:
            raise RuntimeError(f"special token {token!r} does not encode to one id: {ids}")
    if tokenizer.encode("a", add_special_tokens=True) != tokenizer.encode("a", add_special_tokens=False):
        raise RuntimeError("tokenizer inserts special tokens on encode; expected none")


def _check_shape(hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int, intermediate_size: int,
                 max_position_embeddings: int) -> None:
    for name, value in (("hidden_size", hidden_size), ("num_layers", num_layers), ("num_heads", num_heads),
                        ("num_kv_heads", num_kv_heads), ("intermediate_size", intermediate_size),
                        ("max_position_embeddings", max_position_embeddings)):
        _require_positive(name, value)
    if hidden_size % num_heads != 0:
        raise ValueError(f"hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads})")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads})")
    if (hidden_size // num_heads) % 2 != 0:
        raise ValueError(f"head dim {hidden_size // num_heads} must be even for rotary embeddings")


def build_model(
    tokenizer: PreTrainedTokenizerFast,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = MODEL_MAX_LENGTH,
    seed: int = 0,
) -> LlamaForCausalLM:
    """Create a small fp32 ``LlamaForCausalLM`` sized for ``tokenizer``, initialised from ``seed``.

    ``intermediate_size`` defaults to ``4 * hidden_size``. The vocabulary is
    ``len(tokenizer)`` rounded up to a multiple of 64. The global torch RNG state of the
    caller is left untouched.
    """
    if intermediate_size is None:
        intermediate_size = 4 * hidden_size
    _check_shape(hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, max_position_embeddings)
    ids = {name: getattr(tokenizer, f"{name}_token_id") for name in ("bos", "eos", "pad")}
    missing = [name for name, value in ids.items() if value is None]
    if missing:
        raise ValueError(f"tokenizer lacks special tokens: {missing}")

    config = LlamaConfig(
        vocab_size=_round_up(len(tokenizer), VOCAB_MULTIPLE),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["pad"],
        tie_word_embeddings=False,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model = model.to(torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["pad"],
    )
    model.eval()
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("built LlamaForCausalLM: %d params, vocab %d", n_params, config.vocab_size)
    return model


def iter_message_texts(rows: Iterable[dict]) -> Iterator[str]:
    """Yield every message content of every row (the tokenizer training corpus)."""
    for number, row in enumerate(rows, start=1):
        messages = row.get("messages") if isinstance(row, dict) else None
        if not isinstance(messages, list):
            columns = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise ValueError(f"row {number} has no 'messages' list (it has {columns})")
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if not isinstance(content, str):
                raise ValueError(f"row {number}: a message has no string 'content'")
            yield content


def load_rows(path: str | Path) -> list[dict]:
    """Read JSON-lines rows (the format written by ``sample_data.write_jsonl``)."""
    source = Path(path)
    if not source.is_file():
        raise FileNotFoundError(f"data file not found: {source}")
    with source.open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def training_texts(path: str | Path) -> list[str]:
    """What the tokenizer is trained on from a data file open_sft trains on (.jsonl, .json, .parquet, .txt): every
    message's content of chat rows (any row format; the bundled sample gives `iter_message_texts`' texts), every
    document of text rows. A file or row that cannot give them is a UserError naming it and the fix."""
    from open_sft.data.documents import to_text
    from open_sft.data.format_detect import detect_format
    from open_sft.data.formats import RowError, to_messages
    from open_sft.data.sources import PLAIN_SUFFIXES, parse_mixer_list, read_source

    if not Path(path).expanduser().is_file():
        raise UserError(f"--data_path {path}: no such file; give a {'/'.join(PLAIN_SUFFIXES)} file of chat or text "
                        "rows (the tokenizer is trained on their text)")
    spec, = parse_mixer_list([str(path), "1.0"], ["train"], flag="--data_path")
    source = read_source(spec)
    try:
        fmt = detect_format(source.rows[0], source.where(0))
    except UserError:  # its fix names finetune.py's column flags, which `embedded` has not
        raise UserError(f"{source.where(0)}: cannot tell the data format from the columns {sorted(source.rows[0])}; "
                        f"--data_path {EMBEDDED_COLUMNS}") from None
    texts = []
    for index, row in enumerate(source.rows):
        try:
            texts += [to_text(row)] if fmt == "text" else [m["content"] for m in to_messages(row, fmt)]
        except RowError as exc:
            why = (f"text row needs a string 'text' (columns: {sorted(row)}); --data_path {EMBEDDED_COLUMNS}"
                   if exc.reason == "missing_text" else f"{exc} (--data_path: every row gives the tokenizer its "
                   "text; fix or remove the row)")
            raise UserError(f"{source.where(index)}: {why}") from None
    return texts


# what `embedded --data_path` reads: the standard columns only (it has no --sft_messages_key, --dataset_text_field)
EMBEDDED_COLUMNS = ("reads the standard columns only: 'messages' (role/content), alpaca's instruction/input/output, "
                    "sharegpt's 'conversations', 'prompt'/'completion', or a 'text' column; `open_sft embedded` has "
                    "no --sft_messages_key or --dataset_text_field: rename the columns")


def build_embedded_default(
    out_dir: str | Path, *, data_path: str | Path | None = None, vocab_size: int = 2048, **model_shape: Any
) -> Path:
    """Train the tokenizer on ``data_path``'s text (chat or text rows, `training_texts`; default: the bundled
    sample), build the model (``model_shape``: the
    keyword arguments of :func:`build_model`, its defaults otherwise), save both.

    Writes ``config.json``, ``generation_config.json``, ``model.safetensors`` and the
    tokenizer files into ``out_dir`` and returns it as a ``Path``.
    """
    tokenizer = build_tokenizer(training_texts(DEFAULT_DATA_PATH if data_path is None else data_path),
                                vocab_size=vocab_size)
    model = build_model(tokenizer, **model_shape)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    share_as_umask(out)  # safetensors writes 0600 whatever the umask
    logger.info("saved embedded default to %s", out)
    return out


def main(argv: Sequence[str] | None = None, prog: str = "open_sft embedded") -> int:
    parser = WholeFlagParser(
        prog=prog,
        description="Build the offline embedded default tokenizer + tiny Llama model.",
    )
    parser.add_argument("out_dir", help="directory to write the model and tokenizer into")
    parser.add_argument("--data_path", default=None,
                        help="the rows the tokenizer is trained on: a .jsonl/.json/.parquet file of chat rows (their "
                             "messages' text) or text rows, or a .txt file (its documents); default: the bundled "
                             "sample")
    parser.add_argument("--vocab_size", type=int, default=2048)
    parser.add_argument("--hidden_size", type=int, default=64)
    parser.add_argument("--num_layers", type=int, default=2)
    parser.add_argument("--num_heads", type=int, default=4)
    parser.add_argument("--num_kv_heads", type=int, default=2)
    parser.add_argument("--intermediate_size", type=int, default=None)
    parser.add_argument("--max_position_embeddings", type=int, default=MODEL_MAX_LENGTH)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        _check_flags(args)
        setup_cpu_environment()  # (DeepSpeed, which transformers imports to save, says nothing of its accelerator)
        quiet_third_parties()
        path = _build(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


SHAPE_FLAGS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
               "max_position_embeddings")


def _check_flags(args: argparse.Namespace) -> None:
    """The size flags checked before anything is built or written, as one error naming the flags to change
    (build_tokenizer and build_model check the same for callers in Python, as ValueErrors), and the directory."""
    why = writable_dir_problem(Path(args.out_dir))
    if why:
        raise UserError(f"{args.out_dir}: {why}; give a directory for the model and tokenizer (created if missing)")
    try:
        _check_vocab_size(args.vocab_size)
        _check_shape(args.hidden_size, args.num_layers, args.num_heads, args.num_kv_heads,
                     1 if args.intermediate_size is None else args.intermediate_size, args.max_position_embeddings)
    except ValueError as exc:
        message = str(exc)
        named = [f"--{name}" for name in SHAPE_FLAGS if name in message] or ["--hidden_size", "--num_heads"]
        raise UserError(f"{message}: change {' / '.join(named)}") from None


def _build(args: argparse.Namespace) -> Path:
    return build_embedded_default(
        args.out_dir,
        data_path=args.data_path,
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        intermediate_size=args.intermediate_size,
        max_position_embeddings=args.max_position_embeddings,
        seed=args.seed,
    )


if __name__ == "__main__":
    raise SystemExit(main())
