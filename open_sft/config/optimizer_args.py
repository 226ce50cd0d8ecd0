"""The optimizer's and the learning-rate schedule's flags: AdamW's hyperparameters (TrainingArguments' names, as
TRL/transformers users write them) and the schedule's. Part of TrainingArguments (open_sft.config.args), read as
`config.train.<name>`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from open_sft.config.fields import help_field as _help


@dataclass
class OptimizerArguments:
    learning_rate: float = _help("Peak learning rate.", default=2e-5)
    lr_scheduler_type: Literal["linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup", "wsd"] = _help(
        "Learning-rate schedule: linear, cosine, cosine_with_restarts (one cycle: = cosine, as in open-instruct), "
        "polynomial (power 1 to 1e-7, as transformers'), constant, constant_with_warmup, wsd (warmup-stable-decay).",
        default="linear")
    final_lr_ratio: Optional[float] = _help(
        "linear: decay to this fraction of the peak learning rate at the last step instead of to ~0.", default=None)
    warmup_ratio: float = _help("Fraction of the optimizer steps spent warming up linearly.", default=0.03)
    warmup_steps: Optional[int] = _help("Warmup steps; overrides --warmup_ratio.", default=None)
    wsd_decay_ratio: float = _help("wsd: fraction of the steps, at the end, over which the LR decays linearly "
                                   "(toward 0: its last step at peak / (decay steps + 1)).", default=0.1)
    weight_decay: float = _help("AdamW weight decay (not applied to biases and norm weights).", default=0.0)
    adam_beta1: float = _help("AdamW beta1: the decay rate of the first moment (the gradient's running mean).",
                              default=0.9)
    adam_beta2: float = _help(
        "AdamW beta2: the decay rate of the second moment (the squared gradient's running mean). Default 0.999 "
        "(torch's, transformers', open-instruct finetune.py's); an OLMo-core SFT command line trains with 0.95 "
        "unless given (olmo_core_finetune.py's).", default=0.999)
    adam_epsilon: float = _help("AdamW epsilon, added to the second moment's square root.", default=1e-8)
    use_8bit_optimizer: bool = _help("bitsandbytes 8-bit AdamW (runs on CPU too); not with DeepSpeed.", default=False)
    fused_optimizer: bool = _help("Use the fused AdamW kernel where this torch build has it (else foreach).",
                                  default=True)
