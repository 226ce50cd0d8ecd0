#!/usr/bin/env python
"""Fine-tune a causal LM: `accelerate launch finetune.py [run.yaml] --flag value ...` (or `python finetune.py ...`)."""

import sys

from open_sft.errors import record_exit_code
from open_sft.run import main

if __name__ == "__main__":
    sys.exit(record_exit_code(main()))
