"""The final model in Hugging Face layout: a full model (`save_model`) or a LoRA adapter with its optional
merge (`save_lora`).

Both write into one staging helper (`staged_export`): a hidden directory inside --output_dir whose files
are moved into place when all of them exist, so a crash during export never leaves a config.json without
its weights, and an earlier export's leftovers (weights of another sharding, a stale merged/) are removed
so loaders never mix two exports. Only an earlier export's: each export records the names it put in place
(EXPORT_FILES), and a file or directory no export wrote (a user's config.json, merged/) is never removed.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import shutil
from pathlib import Path
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from open_sft.data.chat.foreign_fields import message_fields
from open_sft.data.chat.render import renderer_for, special_markers
from open_sft.data.chat.templates import is_builtin_template
from open_sft.data.chat.turn_enders import turn_enders
from open_sft.durable import free_before_cleanup, write_json
from open_sft.file_modes import share_as_umask
from open_sft.model.anatomy import is_peft_model
from open_sft.export.names import MERGED_DIR
from open_sft.model.lora import ADAPTER

# peft (and open_sft.export.lora_merge, which needs it) is imported by the LoRA paths only: every run imports this
# module, and `import peft` imports bitsandbytes, seconds of CPU per rank for a run without LoRA.
if TYPE_CHECKING:
    from peft import PeftModel

logger = logging.getLogger(__name__)

STAGING = ".export.tmp"
# What an earlier export may have left that the new one must not be mixed with: weights of another sharding, a
# full model's config.json beside an adapter (loaders would apply the adapter to it), an adapter beside a full
# model, a stale merge.
LEFTOVERS = ("model*.safetensors*", "config.json", "adapter_config.json", "adapter_model.safetensors", MERGED_DIR)
# what the last export through staged_export put in place: {"written_by": the command, "files": [top-level names]};
# what the next export may remove, and whose export a directory holds
EXPORT_FILES = ".open_sft_export.json"


def end_of_turn_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Token ids generation stops at under the chat template: eos, what the template closes an assistant turn
    with (<|im_end|>, <|eot_id|>, gpt-oss's <|return|> and <|call|>), and, for a template that closes none
    (GLM's), the tag of the turn that follows (<|user|>, <|observation|>), as training taught the model."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if not getattr(tokenizer, "chat_template", None):
        return ids
    history_trains = is_builtin_template(tokenizer.chat_template)  # what group_turns trains (strict=False)
    for token in turn_enders(renderer_for(tokenizer), special_markers(tokenizer), tokenizer.eos_token,
                             history_trains, message_fields(tokenizer.chat_template)).stops:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and token_id not in ids:
            ids.append(token_id)
    return ids


@contextmanager
def staged_export(output_dir: Path, written_by: str = "finetune.py") -> Iterator[Path]:
    """A fresh staging directory inside output_dir; when the block ends without error its files replace the
    export in output_dir. What an earlier export (one through here: EXPORT_FILES names what it wrote) left that
    the new one does not have (LEFTOVERS) is removed first; such files that no export wrote are kept, and named.
    On an error the staging directory is removed and output_dir is left as it was. `written_by` (the command)
    is recorded with the names."""
    staging = output_dir / STAGING
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        yield staging
    except BaseException as exc:
        free_before_cleanup(exc, staging)
        shutil.rmtree(staging, ignore_errors=True)
        raise
    try:
        _put_in_place(staging, output_dir, written_by)
    except BaseException as exc:
        free_before_cleanup(exc, output_dir)
        raise


#: noted on an exception that stopped staged_export once it had begun moving the new files into output_dir
PLACED = "open_sft_export_placed"


def _put_in_place(staging: Path, output_dir: Path, written_by: str) -> None:
    share_as_umask(staging)  # safetensors writes 0600 whatever the umask
    fresh = {item.name for item in staging.iterdir()}
    earlier = set(export_record(output_dir).get("files", ()))
    record = {"written_by": written_by, "files": sorted(earlier | fresh)}
    write_json(output_dir / EXPORT_FILES, record)  # a kill while moving leaves both removable
    stale = sorted({old for pattern in LEFTOVERS for old in output_dir.glob(pattern)} - {output_dir / n for n in fresh})
    kept = [old.name for old in stale if old.name not in earlier]
    for old in (old for old in stale if old.name in earlier):
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    if kept:
        logger.warning("%s: kept %s beside the export: no open_sft export wrote them; a loader may mix them with it, "
                       "remove them if they are not yours", output_dir, ", ".join(kept))
    try:
        for item in staging.iterdir():
            target = output_dir / item.name
            if target.is_dir() and item.is_dir():
                shutil.rmtree(target)
            os.replace(item, target)
        staging.rmdir()
        write_json(output_dir / EXPORT_FILES, {**record, "files": sorted(fresh)})
    except BaseException as exc:  # output_dir holds (some of) the new export's files now
        with contextlib.suppress(AttributeError):
            setattr(exc, PLACED, True)
        raise


def export_record(output_dir: Path) -> dict[str, Any]:
    """What the last export through staged_export wrote in `output_dir` (EXPORT_FILES), {} where none did."""
    try:
        record = json.loads((output_dir / EXPORT_FILES).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(record, dict) or not isinstance(record.get("files"), list):
        return {}
    return {**record, "files": [name for name in record["files"] if isinstance(name, str)]}


def stop_ids(configured: Any, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The eos ids of an export: the model's own (its generation config's `eos_token_id`, those still in the
    tokenizer's vocabulary: Llama-3.1's <|end_of_text|>, <|eom_id|> after a tool call, <|eot_id|>), then the chat
    template's end-of-turn ids it lacks (end_of_turn_ids)."""
    own = configured if isinstance(configured, list) else [] if configured is None else [configured]
    own = [i for i in own if isinstance(i, int) and 0 <= i < len(tokenizer)]
    return list(dict.fromkeys(own + end_of_turn_ids(tokenizer)))


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, directory: Path) -> None:
    """The tokenizer's files, its chat template with them. A pad token the run borrowed from eos (the tokenizer had
    none, nor a reserved one: open_sft.model.tokenizer) is left out, as the tokenizer had it: with eos as the pad,
    collators that mask labels equal to the pad id (transformers' DataCollatorForLanguageModeling) would never
    train the end of a turn on the exported model."""
    if not getattr(tokenizer, "open_sft_pad_from_eos", False):
        tokenizer.save_pretrained(directory)
        return
    pad = tokenizer.pad_token
    tokenizer.pad_token = None
    try:
        tokenizer.save_pretrained(directory)
    finally:
        tokenizer.pad_token = pad


def write_generation_config(generation: GenerationConfig, tokenizer: PreTrainedTokenizerBase,
                            directory: Path) -> None:
    """The model's generation config (a copy) with its eos ids and the template's end-of-turn ids as eos
    (stop_ids), the tokenizer's bos and pad (the model's own where the tokenizer's is borrowed from eos, see
    save_tokenizer, or where it names none: merge-lora's tokenizer, read from such an export)."""
    generation = copy.deepcopy(generation)
    eos = stop_ids(generation.eos_token_id, tokenizer)
    generation.eos_token_id = eos[0] if len(eos) == 1 else eos
    if tokenizer.pad_token_id is not None and not getattr(tokenizer, "open_sft_pad_from_eos", False):
        generation.pad_token_id = tokenizer.pad_token_id
    if tokenizer.bos_token_id is not None:
        generation.bos_token_id = tokenizer.bos_token_id
    generation.save_pretrained(directory)
    _align_config_ids(generation, directory)


def _align_config_ids(generation: GenerationConfig, directory: Path) -> None:
    """config.json (where `directory` has one) names the generation config's pad and bos, the tokenizer's: the
    model's own ids were kept there, which under another vocabulary (a tokenizer not the base's, a pad the run
    chose) named other tokens than the generation config and the tokenizer (a loader reading config.pad_token_id
    padded with the wrong token)."""
    path = directory / "config.json"
    if not path.is_file():
        return
    config = json.loads(path.read_text())
    ids = {key: getattr(generation, key) for key in ("pad_token_id", "bos_token_id")
           if isinstance(getattr(generation, key), int)}
    holders = [config] + [config[key] for key in ("text_config",) if isinstance(config.get(key), dict)]
    changed = False
    for holder in holders:
        for key, value in ids.items():
            if (holder is config or key in holder) and holder.get(key) != value:
                holder[key], changed = value, True
    if changed:
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def save_dtype(flag: str, source_config: Any) -> torch.dtype:
    """--save_dtype: an explicit dtype, or (auto) the one the source checkpoint's config names (`dtype`, or the
    older `torch_dtype`), float32 where it names none: a bf16 checkpoint is exported in bf16, as HF's Trainer
    does for a model loaded in bf16, not at twice its size."""
    from open_sft.model.precision import FLAG_DTYPES, stored_dtype  # --save_dtype takes --torch_dtype's names

    return FLAG_DTYPES[flag] if flag != "auto" else stored_dtype(source_config)


def finite_state_dict(engine: Any, fp32: bool, is_main: bool) -> dict[str, torch.Tensor]:
    """The engine's full state dict (a collective; the main process holds it), refused on every rank when a weight
    is NaN or inf: the loss-and-gradient guard cannot see an update that broke the weights in a run's last steps
    (`--learning_rate inf` exported a model of NaNs and marked the run complete). The main process's count is
    summed over the ranks, so each stops, before anything is exported or the run is marked complete."""
    from open_sft.distributed.collectives import all_reduce_sum
    from open_sft.errors import UserError

    state_dict = engine.full_state_dict(fp32=fp32)
    broken = [name for name, tensor in state_dict.items() if isinstance(tensor, torch.Tensor)
              and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())] if is_main else []
    if int(all_reduce_sum(len(broken))):
        named = f"{len(broken)} of {len(state_dict)} weight tensors ({', '.join(broken[:3])}" \
                f"{', ...' if len(broken) > 3 else ''})" if is_main else "weights"
        raise UserError(f"the trained model's {named} hold NaN or inf: nothing was exported and the run is not "
                        "marked complete. Lower --learning_rate (or --weight_decay) or check the data; the "
                        "checkpoints in OUTPUT_DIR/checkpoints are kept: resume one saved before the weights broke "
                        "with --resume_from_checkpoint, or start over with --overwrite_output_dir")
    return state_dict


def cast_floating(state_dict: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
            for k, v in state_dict.items()}


def save_model(model: PreTrainedModel, state_dict: dict[str, torch.Tensor], tokenizer: PreTrainedTokenizerBase,
               output_dir: Path, max_shard_size: str | int = "5GB", dtype: torch.dtype = torch.float32) -> None:
    """Write weights (safetensors in `dtype`, sharded with an index past max_shard_size), config, tokenizer
    (with chat template) and generation config. The model card (open_sft.export.model_card) and the Hub upload
    (open_sft.export.hub) follow either export."""
    model.config.use_cache = True
    state_dict = cast_floating(state_dict, dtype)
    # a tied head is its embedding: save_pretrained finds it by shared storage, which the cast (from fp32 masters)
    # and a gather copy apart; it would then store a second copy that loaders tie over anyway
    for tied, source in getattr(model, "all_tied_weights_keys", {}).items():
        if source in state_dict:
            state_dict.pop(tied, None)
    with staged_export(output_dir) as staging:
        model.save_pretrained(staging, state_dict=state_dict, safe_serialization=True, max_shard_size=max_shard_size)
        model.config.dtype = dtype  # save_pretrained wrote the live (fp32 master) parameters' dtype
        model.config.save_pretrained(staging)
        save_tokenizer(tokenizer, staging)
        write_generation_config(model.generation_config, tokenizer, staging)
    logger.info("saved model to %s", output_dir)


def write_model_files(model: PreTrainedModel | PeftModel, tokenizer: PreTrainedTokenizerBase, directory: Path,
                      dtype: torch.dtype) -> None:
    """Everything of an export but its weights, as the run's end export writes it: config.json (of the base model
    under LoRA, then also adapter_config.json), the tokenizer and the generation config. A checkpoint keeps these
    (checkpoint.MODEL_FILES) so that `open_sft export` turns it into a model without the run's process."""
    directory.mkdir(parents=True, exist_ok=True)
    peft = is_peft_model(model)
    base = model.get_base_model() if peft else model
    config = copy.deepcopy(base.config)
    config.use_cache, config.dtype = True, dtype
    config.save_pretrained(directory)
    if peft:
        adapter = copy.deepcopy(model.peft_config[ADAPTER])
        adapter.inference_mode = True  # as PeftModel.save_pretrained writes it
        adapter.save_pretrained(directory)
    save_tokenizer(tokenizer, directory)
    write_generation_config(base.generation_config, tokenizer, directory)


def model_files_writer(config: Any, accelerator: Any, trainer: Any,
                       tokenizer: PreTrainedTokenizerBase) -> Callable[[Path], None]:
    """What each checkpoint of the run keeps of its export but the weights (`write_model_files(directory)` of the
    trained model), in the dtype the end export writes."""
    from open_sft.model.load import load_model_config

    dtype = save_dtype(config.checkpoint.save_dtype, load_model_config(config.model))
    return lambda directory: write_model_files(accelerator.unwrap_model(trainer.model).model, tokenizer, directory,
                                               dtype)


def write_adapter(model: PeftModel, state_dict: dict[str, torch.Tensor], directory: Path) -> None:
    """adapter_config.json + adapter_model.safetensors: the adapters and the trained rows of added tokens (peft's
    trainable tokens), never the frozen embedding and LM head. peft would save those whole ("auto") because the run
    resized them: on an 8B model gigabytes of the base's own rows in an "adapter", which then loaded only onto a
    base resized to their exact row count. Every row the run set is a trainable token (open_sft.model.load), so the
    adapter loads onto the base resized to len(tokenizer), as peft's AutoPeftModelForCausalLM resizes it."""
    model.save_pretrained(directory, state_dict=state_dict, safe_serialization=True, save_embedding_layers=False)
    (directory / "README.md").unlink(missing_ok=True)  # peft's stub card; open_sft.export.model_card writes ours


def save_lora(model: PeftModel, state_dict: dict[str, torch.Tensor], tokenizer: PreTrainedTokenizerBase,
              output_dir: Path, merge: bool, max_shard_size: str | int = "5GB",
              dtype: Optional[torch.dtype] = None) -> None:
    """Adapter (+ the merged full model in merged/ with `merge`, in `dtype` when given), tokenizer and generation
    config; main process only. The top level has no config.json (see open_sft.model.lora)."""
    from open_sft.export.lora_merge import merged_state_dict, write_merged_model

    with staged_export(output_dir) as staging:
        write_adapter(model, state_dict, staging)
        directories = [staging]
        if merge:
            merged = merged_state_dict(model, state_dict)
            write_merged_model(model, cast_floating(merged, dtype) if dtype else merged, staging / MERGED_DIR,
                               max_shard_size)
            directories.append(staging / MERGED_DIR)
        for directory in directories:
            save_tokenizer(tokenizer, directory)
            write_generation_config(model.get_base_model().generation_config, tokenizer, directory)
    logger.info("saved the LoRA adapter%s to %s", " and the merged model" if merge else "", output_dir)
