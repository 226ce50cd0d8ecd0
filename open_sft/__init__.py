"""open_sft: supervised fine-tuning of causal language models with Accelerate and DeepSpeed."""

__version__ = "0.1.0"

import os as _os

# transformers 5.25 swaps layers for kernels it fetches from the Hub at load time, by default (`kernels`, now its
# requirement): `from_pretrained` kernelizes and every `model.train()` kernelizes again. Those kernels are not what
# open_sft's numbers are proven on, a run would download code at start (offline clusters: a warning and the torch
# layers), and kernelizing a pipeline stage fails on its meta-device layers. Off unless the user asks for them
# (USE_HUB_KERNELS=YES); Liger (--use_liger_kernel) is open_sft's kernel choice.
_os.environ.setdefault("USE_HUB_KERNELS", "NO")

# bitsandbytes' CPU backend (imported by peft, so by every LoRA run and the side commands that load an adapter)
# asks `kernels` at import for a 4-bit kernel from the Hub and warns when it cannot have it; quiet here, the one
# place every entry point passes before peft (open_sft.monitor.quiet says why)
from open_sft.monitor.quiet import quiet_kernel_fetch as _quiet_kernel_fetch  # noqa: E402

_quiet_kernel_fetch()
