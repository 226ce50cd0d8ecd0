"""``python -m open_sft embedded OUT_DIR [...]``: same as ``python -m open_sft.embedded.factory``."""

from __future__ import annotations

from open_sft.embedded.factory import main

if __name__ == "__main__":
    raise SystemExit(main())
