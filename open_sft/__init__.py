"""open_sft: supervised fine-tuning of causal language models with Accelerate and DeepSpeed."""

__version__ = "0.1.0"

import os as _os

# transformers 5.25 swaps layers for kernels it fetches from the Hub at load time, by default (`kernels`, now its
# requirement): `from_pretrained` kernelizes and every `model.train()` kernelizes again. Those kernels are not what
# open_sft's numbers are proven on, a run would download code at start (offline clusters: a warning and the torch
# layers), and kernelizing a pipeline stage fails on its meta-device layers. Off unless the user asks for them
# (USE_HUB_KERNELS=YES); Liger (--use_liger_kernel) is open_sft's kernel choice.
_os.environ.setdefault("USE_HUB_KERNELS", "NO")
