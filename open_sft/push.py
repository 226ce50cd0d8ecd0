"""`python -m open_sft.push ...`, the path before the one command: runs `open_sft push ...`."""

if __name__ == "__main__":
    from open_sft.__main__ import forward

    forward("push")
