"""The refusal of a LoRA run that adds tokens on a model whose LM head has a bias, under a peft before 0.22
(open_sft.model.lora.peft_drops_head_bias), said before the data are tokenized: apply_lora says it when the weights
have loaded, after the tokenization a large mixture takes its time over. Everything it needs is known once the
tokenizer has its chat template: the tokens the run adds (the template's, --add_tokens', any past the model's
vocabulary), and the head's bias, from config.json, the model built on the meta device (no weights, no memory)."""

from __future__ import annotations

import logging

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from open_sft.config.args import FinetuneConfig
from open_sft.model.anatomy import text_config
from open_sft.model.load import load_model_config
from open_sft.model.lora import check_head_bias_kept, trainable_token_rows, uses_lora

logger = logging.getLogger(__name__)


def refuse_dropped_head_bias(config: FinetuneConfig, tokenizer: PreTrainedTokenizerBase) -> None:
    """Raise apply_lora's UserError now where it would raise it at model load; quiet where this peft keeps the bias,
    where no LoRA or no token is added, under --cache_dataset_only (no model), and where the model cannot be built on
    the meta device (remote code that needs its weights' device: the load's own check stays)."""
    import peft
    from packaging.version import Version

    args = config.model
    if not uses_lora(config.lora) or config.data.cache_dataset_only or Version(peft.__version__) >= Version("0.22"):
        return
    model_config = load_model_config(args)
    vocab = getattr(text_config(model_config), "vocab_size", None) or len(tokenizer)
    added = set(getattr(tokenizer, "open_sft_new_ids", [])) | set(getattr(tokenizer, "open_sft_added_ids", []))
    new_ids = sorted(added | set(range(vocab, len(tokenizer))))  # load.fit_embeddings_to_tokenizer's rows too
    if not new_ids:
        return
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(model_config, trust_remote_code=args.trust_remote_code)
    except Exception as exc:  # any failure leaves the check to the load, which has the weights
        logger.debug("the LM head's bias is checked at model load: the model could not be built on meta (%s)", exc)
        return
    check_head_bias_kept(model, trainable_token_rows(model, new_ids), new_ids)
