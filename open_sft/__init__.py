"""open_sft: supervised fine-tuning of causal language models with Accelerate and DeepSpeed."""

__version__ = "0.1.0"

import os as _os

# transformers 5.25 swaps layers for kernels it fetches from the Hub at load time, by default (`kernels`, now its
# requirement): `from_pretrained` kernelizes and every `model.train()` kernelizes again. Those kernels are not what
# open_sft's numbers are proven on, a run would download code at start (offline clusters: a warning and the torch
# layers), and kernelizing a pipeline stage fails on its meta-device layers. Off unless the user asks for them
# (USE_HUB_KERNELS=YES); Liger (--use_liger_kernel) is open_sft's kernel choice.
_os.environ.setdefault("USE_HUB_KERNELS", "NO")

# bitsandbytes' CPU backend (imported by peft, so by every LoRA run and the side commands that load an adapter), on
# a CPU with AVX512-BF16, fetches a 4-bit kernel from the Hub when it is imported, through `kernels` (get_kernel of
# BNB_CPU_KERNEL): code downloaded and run by a run that asked for none, for a one-token inference op (gemv_4bit)
# training never calls. `kernels` loads a kernel that LOCAL_KERNELS names (`repo=path` entries split on `:`) from the
# path given there instead of the Hub; given none (os.devnull), the load fails before any Hub request and
# bitsandbytes keeps its own kernel. Our entry is added to a user's LOCAL_KERNELS (their kernels stay theirs) unless
# it names this kernel itself; not where the user asks for the Hub's kernels (USE_HUB_KERNELS=YES). Set in the
# environment at import, against "no environment variables set at import" (STYLE.md), because nothing later works:
# it must be in place before peft imports bitsandbytes, and this is the one place every entry point passes before
# that; the environment is all `kernels` reads (no call sets it), and the processes a run starts (launchers' ranks,
# data workers) inherit it, on purpose. The warnings about it are quieted here too (open_sft.monitor.quiet).
BNB_CPU_KERNEL = "kernels-community/quantization-bitsandbytes"
if _os.environ["USE_HUB_KERNELS"].upper() not in ("1", "ON", "YES", "TRUE"):
    _local = _os.environ.get("LOCAL_KERNELS") or ""
    if BNB_CPU_KERNEL not in (entry.split("=", 1)[0] for entry in _local.split(":")):
        _os.environ["LOCAL_KERNELS"] = ":".join(filter(None, (_local, f"{BNB_CPU_KERNEL}={_os.devnull}")))

from open_sft.monitor.quiet import quiet_kernel_fetch as _quiet_kernel_fetch  # noqa: E402

_quiet_kernel_fetch()
