"""What a run's output directory holds, and its model loaded for generation (`open_sft generate`, `open_sft chat`).

A run leaves one of three layouts, and each loads here:
    full export     config.json + model*.safetensors (+ tokenizer, generation_config.json)
    LoRA / QLoRA    adapter_config.json + adapter_model.safetensors: the base named in adapter_config.json's
                    base_model_name_or_path (or --base_model), with the adapter applied through peft; a QLoRA
                    run's base (run.json says which) quantized to 4-bit as it was in training
    merged/         a LoRA run's --merge_lora_on_save model: a full export of its own
The tokenizer (with the run's chat template) and generation_config.json (the end-of-turn ids) are read from the
directory itself, never from the base model: a run may have added template tokens and changed the end of turn.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from open_sft.errors import UserError

FULL, ADAPTER_DIR = "full model", "LoRA adapter"
WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


@dataclass
class RunModel:
    """A loaded model with the tokenizer saved beside it, and what was loaded (for the user's first line)."""

    model: Any
    tokenizer: Any
    kind: str  # FULL or ADAPTER_DIR
    description: str


def _no_model_error(directory: Path) -> UserError:
    """Why `directory` holds no model, and what to pass instead."""
    if not directory.exists():
        return UserError(f"{directory} does not exist; pass the --output_dir of a finished run")
    if not directory.is_dir():
        return UserError(f"{directory} is a file; pass the --output_dir of a finished run (a directory)")
    hint = ""
    if (directory / "checkpoints").is_dir():
        hint = (" It has checkpoints/ but no export: the run has not finished; relaunch the same command to "
                "resume it and export.")
    elif (directory / "run.json").is_file():
        hint = " It has run.json but no export: the run stopped before it saved the model; relaunch it."
    return UserError(f"{directory} holds no model (no config.json with weights, no adapter_config.json).{hint} "
                     "Pass a run's --output_dir after its export: a full model, a LoRA/QLoRA adapter, or its "
                     "merged/ directory.")


def model_kind(directory: Path) -> str:
    """FULL or ADAPTER_DIR for what `directory` holds; a UserError naming the directory and the fix otherwise."""
    if (directory / "adapter_config.json").is_file():
        if not (directory / "adapter_model.safetensors").is_file():
            raise UserError(f"{directory} has adapter_config.json but no adapter_model.safetensors; the export is "
                            "incomplete: relaunch the run to export it again")
        return ADAPTER_DIR
    if (directory / "config.json").is_file():
        if not any((directory / name).is_file() for name in WEIGHTS):
            raise UserError(f"{directory} has config.json but no weights (model*.safetensors); the export is "
                            "incomplete: relaunch the run to export it again")
        return FULL
    raise _no_model_error(directory)


def adapter_base(directory: Path, base_model: Optional[str] = None) -> str:
    """The base model of the adapter in `directory`: `base_model` when given, else adapter_config.json's."""
    if base_model:
        return base_model
    config_file = directory / "adapter_config.json"
    base = json.loads(config_file.read_text()).get("base_model_name_or_path")
    if not base:
        raise UserError(f"{config_file} names no base model (base_model_name_or_path); pass --base_model PATH_OR_ID")
    return base


def load_saved_tokenizer(directory: Path) -> Any:
    """The tokenizer saved in a model directory or a run's output (its chat template, if any, with it)."""
    from transformers import AutoTokenizer

    from open_sft.model.source import TOKENIZER_FILES, has_tokenizer_files

    if not has_tokenizer_files(directory):  # transformers: "install sentencepiece or tiktoken"
        raise UserError(f"{directory} holds no tokenizer files ({', '.join(TOKENIZER_FILES)}); the export writes "
                        "them: relaunch the run to export it again, or copy its base model's tokenizer files in")
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError) as exc:
        raise UserError(f"{directory} has no loadable tokenizer ({exc}); the export writes one: relaunch the run "
                        "to export it again") from exc
    return tokenizer  # without a chat template (a model trained on plain text): generate and chat continue text


def base_loading(directory: Path) -> dict[str, Any]:
    """from_pretrained's arguments for an adapter's base: its own dtype; for a QLoRA run (run.json says so) the
    4-bit NF4 base it trained against, as training quantized it, on the GPU when there is one (generate, chat and
    open_sft merge-lora, which merges into that base dequantized, as the run's merged/ is)."""
    import torch

    info = _read_run_json(directory)
    if not info.get("args", {}).get("lora", {}).get("use_qlora"):
        return {"dtype": "auto"}
    from open_sft.config.args import LoraArguments
    from open_sft.model.lora import quantization_config

    fp16 = info.get("compute_dtype") == str(torch.float16)
    return {"quantization_config": quantization_config(LoraArguments(use_qlora=True), fp16=fp16),
            "dtype": torch.float32, "device_map": {"": 0 if torch.cuda.is_available() else "cpu"}}


def _read_run_json(directory: Path) -> dict[str, Any]:
    try:
        return json.loads((directory / "run.json").read_text())
    except (OSError, ValueError):  # a directory copied without it: the adapter alone decides
        return {}


def fit_base_to_adapter(model: Any, directory: Path, tokenizer: Any) -> None:
    """The base resized for the adapter in `directory` where the run added tokens: to len(tokenizer), as
    AutoPeftModelForCausalLM does (the added tokens' rows are the adapter's trainable tokens; the LoRA run grew
    no spare rows); an adapter written before that, which holds the whole resized embedding, to its rows."""
    rows = model.get_input_embeddings().weight.shape[0]
    wanted = _saved_embedding_rows(directory, model) or (len(tokenizer) if len(tokenizer) > rows else rows)
    if wanted != rows:
        model.resize_token_embeddings(wanted, mean_resizing=False)  # trainable tokens (or saved rows) fill them


def _saved_embedding_rows(adapter_dir: Path, model: Any) -> Optional[int]:
    """Rows of `model`'s input embedding that the adapter file holds whole (what peft saved of a resized embedding
    before open_sft left it out); None where it holds none."""
    from safetensors import safe_open

    weights = adapter_dir / "adapter_model.safetensors"
    if not weights.is_file():
        return None
    embedding = next(n for n, m in model.named_modules() if m is model.get_input_embeddings())
    with safe_open(str(weights), "pt") as f:
        for key in f.keys():
            if f".{embedding}." in key and key.endswith(".weight") and ".lora_" not in key:
                return f.get_slice(key).get_shape()[0]
    return None


def load_adapter_base(directory: Path, base_model: Optional[str], **loading: Any) -> tuple[Any, str]:
    """The base model of the adapter in `directory` (--base_model, else the one its adapter_config.json names) and
    its name; one that does not load (a path that does not exist, a Hub id out of reach) is a UserError."""
    from transformers import AutoModelForCausalLM

    from open_sft.model.source import unreachable_reason

    base = adapter_base(directory, base_model)
    try:
        return AutoModelForCausalLM.from_pretrained(base, **loading), base
    except (OSError, ValueError) as exc:  # a missing path reads as a bad Hub id: "Repo id must be in the form ..."
        which = f"--base_model {base}" if base_model else f"{directory} is a LoRA adapter on {base}, which"
        why = unreachable_reason(base) or str(exc).splitlines()[0]
        raise UserError(f"{which} cannot be loaded here ({why}); pass "
                        "--base_model PATH_OR_ID with the base model the run trained from") from exc


def _load_adapter(directory: Path, tokenizer: Any, base_model: Optional[str]) -> tuple[Any, str]:
    from peft import PeftModel

    from open_sft.model.lora_targets import linear_targets_kept

    model, base = load_adapter_base(directory, base_model, **base_loading(directory))
    fit_base_to_adapter(model, directory, tokenizer)
    _check_head_bias_kept(directory, model)
    try:
        with warnings.catch_warnings(), linear_targets_kept():  # the shared experts' adapters too (lora_targets)
            # peft asks transformers' deprecated name; nothing the user can change
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            model = PeftModel.from_pretrained(model, str(directory))
    except (RuntimeError, ValueError) as exc:  # shapes that do not fit: another base than the run's
        raise UserError(f"the adapter in {directory} does not fit the base model {base} "
                        f"({str(exc).splitlines()[0]}); pass --base_model with the model the run trained from") from exc
    return model, base


def _check_head_bias_kept(directory: Path, base: Any) -> None:
    """An adapter whose run added tokens (peft trainable tokens) on a base whose LM head has a bias is refused where
    this peft would leave the bias out of every logit (open_sft.model.lora.peft_drops_head_bias): generation would not
    be the trained model's. open_sft's merge keeps the bias, under any peft."""
    import peft

    from open_sft.model.lora import peft_drops_head_bias

    rows = json.loads((directory / "adapter_config.json").read_text()).get("trainable_token_indices")
    if rows and peft_drops_head_bias(base):
        raise UserError(f"the adapter in {directory} trains the rows of tokens its run added, on an LM head with a "
                        f"bias, which peft {peft.__version__} leaves out of the logits (peft >= 0.22 keeps it): "
                        "upgrade peft (pip install -U 'peft>=0.22'; it needs Python >= 3.11), or use the merged model "
                        f"(the run's {directory / 'merged'} with --merge_lora_on_save, or "
                        f"`open_sft merge-lora {directory} OUT`)")


def load_run_model(directory: Path, base_model: Optional[str] = None) -> RunModel:
    """The model in a run's output directory (full export, LoRA/QLoRA adapter, or merged/), in eval mode, with
    the directory's tokenizer and generation config (its end-of-turn ids)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    kind = model_kind(directory)
    if base_model and kind == FULL:
        raise UserError(f"--base_model is for a LoRA/QLoRA adapter directory; {directory} holds a full model: "
                        "leave --base_model out")
    tokenizer = load_saved_tokenizer(directory)
    if kind == ADAPTER_DIR:
        model, base = _load_adapter(directory, tokenizer, base_model)
        inner = model.get_base_model()
        quantized = getattr(inner, "is_loaded_in_4bit", False)
        description = f"{directory} ({'QLoRA adapter on 4-bit' if quantized else 'LoRA adapter on'} {base})"
    else:
        model = inner = AutoModelForCausalLM.from_pretrained(directory, dtype="auto")
        description = f"{directory} (full model)"
    if (directory / "generation_config.json").is_file():  # the run's end-of-turn ids, not the base model's
        inner.generation_config = GenerationConfig.from_pretrained(directory)
    return RunModel(model.eval(), tokenizer, kind, description)
