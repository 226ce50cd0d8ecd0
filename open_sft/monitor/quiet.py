"""Third-party output that does not apply to a run, silenced at its source (issue: a user reads the log).

- Progress bars (transformers' "Loading weights", "Writing model shards", datasets', huggingface_hub's) are
  drawn only on a terminal: in a redirected log they are carriage-return noise between the log lines.
- bitsandbytes warns at import that its optional `kernels` package is missing for a 4-bit CPU kernel; peft
  imports bitsandbytes on every LoRA run, so the warning is kept for --use_qlora runs only, where it applies.
- transformers' FutureWarning about `is_gradient_checkpointing` is raised by peft's own call, not by anything a
  user wrote or can change; peft's warning that it saves the embedding layers of a resized vocabulary says what
  open_sft meant it to do (added tokens' rows are trained and saved; the log says which tokens).
"""

from __future__ import annotations

import logging
import sys
import warnings


def quiet_third_parties(qlora: bool, terminal: bool | None = None) -> None:
    """Silence what does not apply to this run; `terminal` defaults to whether stderr is one."""
    if not (sys.stderr.isatty() if terminal is None else terminal):
        import datasets
        import huggingface_hub.utils
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        datasets.disable_progress_bars()
        huggingface_hub.utils.disable_progress_bars()
    if not qlora:
        logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r"Setting `save_embedding_layers` to `True`", category=UserWarning)
