"""`python -m open_sft.report ...`, the path before the one command: runs `open_sft report ...`."""

if __name__ == "__main__":
    from open_sft.__main__ import forward

    forward("report")
