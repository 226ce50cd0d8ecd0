"""`python -m open_sft.lora merge ...`, the path before the one command: runs `open_sft merge-lora ...`."""

if __name__ == "__main__":
    from open_sft.__main__ import forward

    forward("merge-lora", drop="merge")
