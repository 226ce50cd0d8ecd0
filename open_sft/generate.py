"""`python -m open_sft.generate ...`, the path before the one command: runs `open_sft generate ...`."""

if __name__ == "__main__":
    from open_sft.__main__ import forward

    forward("generate")
