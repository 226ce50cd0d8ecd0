"""`python -m open_sft.model_card ...`, the path before the one command: runs `open_sft model-card ...`."""

if __name__ == "__main__":
    from open_sft.__main__ import forward

    forward("model-card")
