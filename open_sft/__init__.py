"""open_sft: supervised fine-tuning of causal language models with Accelerate and DeepSpeed."""

__version__ = "0.1.0"
