"""The final model in Hugging Face layout, and run.json.

Files are written to a hidden staging directory inside --output_dir and moved into place when all
of them exist, so a crash during export never leaves a config.json without its weights.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import shutil
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from open_sft.data.labels import special_markers

logger = logging.getLogger(__name__)

LIBRARIES = ("open_sft", "torch", "transformers", "accelerate", "deepspeed", "datasets", "peft", "tokenizers",
             "safetensors", "huggingface-hub")


def end_of_turn_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Token ids that end an assistant turn in the chat template: eos plus template markers it renders."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    try:
        rendered = tokenizer.apply_chat_template(probe, tokenize=False)
    except Exception:  # a template that cannot render the probe still exports; eos alone ends turns
        return ids
    tail = rendered[rendered.rfind("y") + 1 :]
    for token in special_markers(tokenizer):
        if token in tail:
            token_id = tokenizer.convert_tokens_to_ids(token)
            if token_id not in ids:
                ids.append(token_id)
    return ids


def save_model(model: PreTrainedModel, state_dict: dict[str, torch.Tensor], tokenizer: PreTrainedTokenizerBase,
               output_dir: Path, max_shard_size: str | int = "5GB") -> None:
    """Write weights (safetensors, sharded with an index past max_shard_size), config, tokenizer (with chat
    template) and generation config. LoRA runs export through open_sft.model.lora.save_lora instead; the model
    card (open_sft.export.model_card) and the Hub upload (open_sft.export.hub) follow either export."""
    staging = output_dir / ".export.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    generation = model.generation_config
    eot = end_of_turn_ids(tokenizer)
    generation.eos_token_id = eot[0] if len(eot) == 1 else eot
    generation.pad_token_id = tokenizer.pad_token_id
    if tokenizer.bos_token_id is not None:
        generation.bos_token_id = tokenizer.bos_token_id
    model.config.use_cache = True
    model.save_pretrained(staging, state_dict=state_dict, safe_serialization=True, max_shard_size=max_shard_size)
    tokenizer.save_pretrained(staging)
    move_into_place(staging, output_dir)
    logger.info("saved model to %s", output_dir)


def move_into_place(staging: Path, output_dir: Path) -> None:
    """Replace the export in output_dir with staging's files; weight files of an earlier export that the
    new one does not have (another sharding) are removed so loaders never mix the two."""
    fresh = {item.name for item in staging.iterdir()}
    for old in output_dir.glob("model*.safetensors*"):
        if old.name not in fresh:
            old.unlink()
    for item in staging.iterdir():
        os.replace(item, output_dir / item.name)
    staging.rmdir()


def git_revision() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def library_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def write_json(path: Path, payload: dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)
