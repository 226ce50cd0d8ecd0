"""The models and data of a GPU check: the small model every run trains, the Llama-3.2-1B-shaped one the speed
part times (random init, the given tokenizer), and the rows as `messages` JSON Lines."""

from __future__ import annotations

import json
from pathlib import Path

from tests.gpu_check.context import BIG, HUGE, SMALL_CPU, SMALL_GPU, Context


def _real_tokenizer(path: str):
    """A tokenizers JSON file as a transformers tokenizer with tulu's chat template (open-instruct's default)."""
    from transformers import PreTrainedTokenizerFast

    from open_sft.data.chat.templates import apply_chat_template_choice

    vocab = json.loads(Path(path).read_text())
    names = {t["content"] for t in vocab.get("added_tokens", [])} | set(vocab["model"].get("vocab", {}))
    eos = next(t for t in ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>") if t in names)
    pad = next((t for t in ("<|padding|>", "<pad>") if t in names), eos)
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=path, bos_token=eos, eos_token=eos, pad_token=pad)
    apply_chat_template_choice(tokenizer, "tulu", None)
    return tokenizer


def _save(model, tokenizer, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def prepare(ctx: Context, need_big: bool, need_huge: bool = False) -> None:
    from open_sft.embedded.factory import build_embedded_default, build_model

    if ctx.tokenizer_file:
        tokenizer = _real_tokenizer(ctx.tokenizer_file)
        ctx.small_model = _save(build_model(tokenizer, **SMALL_GPU), tokenizer, ctx.work / "small_model")
    else:
        shape = SMALL_GPU if ctx.gpu else SMALL_CPU
        ctx.small_model = build_embedded_default(ctx.work / "small_model", vocab_size=1024, **shape)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(ctx.small_model)
    ctx.speed_data = str(_messages_file(ctx.data, ctx.work / "speed_data.jsonl"))
    if need_big:
        import torch

        model = build_model(tokenizer, **BIG).to(torch.bfloat16)  # bf16 on disk: half the bytes to load
        ctx.big_model = _save(model, tokenizer, ctx.work / "big_model")
    if need_huge:  # 8B: initialised on the GPU (a minute less than on the host), saved in bf16 (16 GB)
        import torch

        with torch.device("cuda"):
            model = build_model(tokenizer, **HUGE).to(torch.bfloat16)
        ctx.huge_model = _save(model, tokenizer, ctx.work / "huge_model")
        del model
        torch.cuda.empty_cache()


def _messages_file(data: str, out: Path) -> Path:
    """The rows as `messages` JSON Lines, the format both open_sft and TRL's SFTTrainer read."""
    from open_sft.data.format_detect import detect_format
    from open_sft.data.formats import to_messages

    path = Path(data)
    rows = json.loads(path.read_text()) if path.suffix == ".json" else [
        json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    fmt = detect_format(rows[0], str(path))
    with out.open("w") as handle:
        for row in rows:
            handle.write(json.dumps({"messages": list(to_messages(row, fmt))}) + "\n")
    return out

