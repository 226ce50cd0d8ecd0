#!/usr/bin/env python
"""Fine-tune a causal LM: `accelerate launch finetune.py [run.yaml] --flag value ...` (or `python finetune.py ...`)."""

if __name__ == "__main__":
    from open_sft.distributed import lifeline

    lifeline.install()  # first, torch-free: a launcher killed while this rank imports torch is noticed (below)
    from open_sft.errors import exit_rank, record_exit_code, stop_while_starting

    restore = stop_while_starting()  # a SIGTERM in the imports below exits 75 with a line
    from open_sft.run import main

    code = main()  # its own handlers from its first lines
    restore()
    exit_rank(record_exit_code(code))
