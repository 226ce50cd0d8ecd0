"""Generate from a saved model with its chat template, and score it on the embedded sample tasks.

    python -m open_sft generate OUTPUT_DIR --prompt "What is 7 plus 5?"
    python -m open_sft generate OUTPUT_DIR --score_sample 50     # exact-answer accuracy on sample rows
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

HELD_OUT_SEED = 20261122  # the bundled sample is generated with seed 0


def generate(model, tokenizer, messages: list[dict], max_new_tokens: int = 32) -> str:
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)
    with torch.no_grad():
        out = model.generate(**encoded, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, encoded["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def score_sample(model, tokenizer, rows: list[dict]) -> float:
    """Share of rows whose generated final answer equals the expected one (the last turn is held out)."""
    from open_sft.embedded.sample_data import score_answer

    hits = sum(score_answer(row["answer"], generate(model, tokenizer, row["messages"][:-1])) for row in rows)
    return hits / max(len(rows), 1)


def main(argv: list[str] | None = None, prog: str = "open_sft generate") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir")
    parser.add_argument("--prompt", action="append", default=[], help="a user message (repeatable)")
    parser.add_argument("--system", default=None, help="optional system message")
    parser.add_argument("--max_new_tokens", type=int, default=32)
    parser.add_argument("--score_sample", type=int, default=0,
                        help="score exact answers on this many freshly generated sample tasks (held out: "
                             "a seed the bundled training sample does not use)")
    args = parser.parse_args(argv)
    if not (Path(args.model_dir) / "config.json").exists():
        print(f"error: {args.model_dir} has no config.json; pass a directory written by finetune.py", file=sys.stderr)
        return 2
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir).eval()
    for prompt in args.prompt:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": prompt})
        print(json.dumps({"prompt": prompt, "generation": generate(model, tokenizer, messages, args.max_new_tokens)}))
    if args.score_sample:
        from open_sft.embedded.sample_data import generate_examples

        rows = generate_examples(args.score_sample, seed=HELD_OUT_SEED)
        print(json.dumps({"held_out_tasks": len(rows), "exact_answer_accuracy": score_sample(model, tokenizer, rows)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
