#!/usr/bin/env python
"""Fine-tune a causal LM: `accelerate launch finetune.py [run.yaml] --flag value ...` (or `python finetune.py ...`)."""

from open_sft.errors import exit_rank, record_exit_code
from open_sft.run import main

if __name__ == "__main__":
    exit_rank(record_exit_code(main()))
