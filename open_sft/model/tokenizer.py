"""Loading the tokenizer for training: the special tokens a bare tokenizer.json lacks, tokens the run adds, and
--add_bos, with clear errors for bad paths."""

from __future__ import annotations

import logging

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from open_sft.config.args import ModelArguments
from open_sft.errors import UserError
from open_sft.model.added_tokens import add_tokens
from open_sft.model.load import hub_kwargs
from open_sft.model.source import tokenizer_problem, unreachable_problem
from open_sft.monitor.quiet import SAID_ALIKE_BY_EVERY_RANK

logger = logging.getLogger(__name__)

# What a bare tokenizer.json (no tokenizer_config.json naming its special tokens) most likely means by them
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>")
# Padding tokens families reserve, never trained: GPT-NeoX's, Gemma's and Mistral's (Tekken), BERT's, OLMo-2's,
# Cohere's, Llama-3.1's and Llama-4's, DeepSeek-V3's. Not Qwen's <|endoftext|> (its tokenizer_config.json names it):
# elsewhere it is the eos or a token templates write (Phi-3's last), trained.
PAD_CANDIDATES = ("<|padding|>", "<pad>", "[PAD]", "<|pad|>", "<PAD>", "<|finetune_right_pad_id|>",
                  "<|finetune_right_pad|>", "<｜▁pad▁｜>")


def _fill_special_tokens(tokenizer: PreTrainedTokenizerBase, where: str) -> None:
    """A pad token (padding never gets a loss), and an eos token where the tokenizer names none: a directory holding
    only a tokenizer.json (GPT-NeoX/OLMo's, say) loads with neither, and chat templates end turns with eos."""
    vocab = tokenizer.get_vocab()
    if tokenizer.eos_token_id is None:
        found = next((t for t in EOS_CANDIDATES if t in vocab), None)
        if found is None:
            raise UserError(f"{where}: the tokenizer names no eos token and has none of {', '.join(EOS_CANDIDATES)}; "
                            "give a tokenizer directory whose tokenizer_config.json names eos_token (and pad_token)")
        logger.warning("tokenizer names no eos token; using %r, which it has (name eos_token in its "
                       "tokenizer_config.json to choose another)", found, **SAID_ALIKE_BY_EVERY_RANK)
        tokenizer.eos_token = found
        tokenizer.open_sft_eos_from_vocab = where  # the tokenizer names no special tokens: add_bos_to_template asks
    if tokenizer.pad_token_id is None:
        pad = next((t for t in PAD_CANDIDATES if t in vocab and t != tokenizer.eos_token), None)
        # eos pads the batches only: the export names no pad token (open_sft.export.save.save_tokenizer)
        tokenizer.open_sft_pad_from_eos = pad is None
        logger.warning("tokenizer has no pad token; using %r for padding (padding never gets a loss%s)",
                       pad or tokenizer.eos_token,
                       "; the export names no pad, as the tokenizer had none" if pad is None else "",
                       **SAID_ALIKE_BY_EVERY_RANK)
        tokenizer.pad_token = pad or tokenizer.eos_token


def load_tokenizer(args: ModelArguments) -> PreTrainedTokenizerBase:
    name = args.tokenizer_name_or_path or args.model_name_or_path
    flag = "--tokenizer_name_or_path" if args.tokenizer_name_or_path else "--model_name_or_path"
    try:
        revision = args.tokenizer_revision or args.model_revision
        tokenizer = AutoTokenizer.from_pretrained(name, **{**hub_kwargs(args), "revision": revision})
    except (OSError, ValueError) as exc:  # transformers' reason misleads for a missing path, a file, no tokenizer
        problem = unreachable_problem(flag, name, revision) or tokenizer_problem(flag, name)
        raise UserError(problem or f"{flag} {name}: could not load a tokenizer ({exc}); check the path or Hub "
                        "id") from exc
    _fill_special_tokens(tokenizer, f"{flag} {name}")
    if args.add_tokens:
        add_tokens(tokenizer, args.add_tokens, special=False)
    if args.add_special_tokens:
        add_tokens(tokenizer, args.add_special_tokens, special=True, flag="--add_special_tokens")
    return tokenizer


def add_bos_to_template(tokenizer: PreTrainedTokenizerBase) -> None:
    """--add_bos: the chat template writes the bos token first, as open-instruct's does; a GPT-NeoX tokenizer (OLMo's
    first models) without a bos token uses its eos token, as open-instruct does. Any other tokenizer without one
    (Qwen's) gets nothing: open-instruct's `{{ bos_token }}` renders empty there, and an eos token before every
    example would be a token the model never sees opening a prompt. A tokenizer that names no special tokens at all
    (a bare tokenizer.json: no class, its eos taken from its vocabulary) could be either: refused, naming the fix."""
    from transformers import GPTNeoXTokenizer

    if tokenizer.bos_token is None and getattr(tokenizer, "open_sft_eos_from_vocab", None):
        raise UserError(
            f"--add_bos: the tokenizer of {tokenizer.open_sft_eos_from_vocab} names no bos token, nor eos (its "
            f"{tokenizer.eos_token!r} was taken from its vocabulary: a tokenizer.json without a tokenizer_config.json "
            "naming its special tokens), so the token that opens an example cannot be told: GPT-NeoX's and OLMo's "
            "open with their eos (open-instruct stands it in for a GPTNeoXTokenizer), Qwen's with none. Name it in "
            "a tokenizer_config.json beside the tokenizer.json, e.g. {\"bos_token\": \"<|endoftext|>\"} for "
            "GPT-NeoX/OLMo's, or drop --add_bos")
    if tokenizer.bos_token is None:
        if not isinstance(tokenizer, GPTNeoXTokenizer):
            logger.warning("--add_bos: the tokenizer has no bos token; nothing to add (open-instruct stands its eos "
                           "token in only for GPT-NeoX tokenizers)")
            return
        logger.info("--add_bos: the tokenizer has no bos token; using its eos token %r", tokenizer.eos_token)
        tokenizer.bos_token = tokenizer.eos_token
    template = tokenizer.chat_template
    if not template:  # raw text documents: no template to begin with bos
        logger.info("--add_bos: the tokenizer has no chat template; nothing to add")
        return
    if _renders_bos_first(tokenizer):
        logger.info("--add_bos: the chat template already writes the bos token %r first; nothing to add",
                    tokenizer.bos_token)
        return
    tokenizer.chat_template = "{{ bos_token }}" + template


# Conversations the template is asked to render to see whether it writes bos itself: with a system message first,
# then without (templates that reject a system role: Gemma's), then a user turn alone (strictly alternating ones)
_BOS_PROBES = ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}],
               [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
               [{"role": "user", "content": "Hi"}])


def _renders_bos_first(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the chat template's rendering of a small conversation already opens with the bos text, however the
    template writes it (`{{- bos_token }}` after a set block: Llama-3.1's, Mistral v0.3's; `bos_token + ...` per
    turn: Llama-2's; the literal text). A template that renders none of the probes is judged by its text."""
    for probe in _BOS_PROBES:
        try:
            text = tokenizer.apply_chat_template(probe, tokenize=False)
        except Exception:  # the template rejects this shape (raise_exception): the next probe
            continue
        return isinstance(text, str) and text.lstrip().startswith(tokenizer.bos_token)
    template = tokenizer.chat_template
    return template.lstrip().startswith(("{{ bos_token }}", "{{- bos_token }}")) or template.startswith(
        tokenizer.bos_token)
