"""Where a model or a tokenizer comes from (a local directory or a Hub id), and why one given cannot be used, said
before anything loads. transformers answers these mistakes misleadingly: a local path that does not exist reads as
a malformed Hub id ("Repo id must be in the form ..."), a directory without tokenizer files as a missing
sentencepiece, a tokenizer.json file as a bad repo id."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from open_sft.training.checkpoint import COMPLETE

# Files a tokenizer loads from: the fast tokenizer, its config, and the vocabularies slow tokenizers read
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "spiece.model", "vocab.json",
                   "vocab.txt", "tiktoken.model")
_TOKENIZER_NAMES = "tokenizer.json, tokenizer_config.json or vocabulary files such as tokenizer.model or vocab.json"


def has_tokenizer_files(path: Path) -> bool:
    return any((path / file).is_file() for file in TOKENIZER_FILES)


def is_hub_id(name: str) -> bool:
    """Whether `name` has the form of a Hub repository id (NAME or ORG/NAME), as huggingface_hub judges it."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if name.startswith((".", "/", "~")):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def hub_offline() -> bool:
    """Whether HF_HUB_OFFLINE is set, read as huggingface_hub reads it (now: a test or a caller may set it late)."""
    from huggingface_hub.constants import ENV_VARS_TRUE_VALUES

    return os.environ.get("HF_HUB_OFFLINE", "").upper() in ENV_VARS_TRUE_VALUES


def in_hub_cache(repo_id: str, revision: Optional[str] = None) -> bool:
    """Whether the local Hugging Face cache holds any file of `repo_id` a model or tokenizer loads from."""
    from huggingface_hub import try_to_load_from_cache

    names = ("config.json", "adapter_config.json", *TOKENIZER_FILES)
    return any(isinstance(try_to_load_from_cache(repo_id, name, revision=revision), str) for name in names)


def _missing(name: str) -> Optional[str]:
    """Why `name` names nothing (no local path and no Hub id either), without the fix; None where it may load."""
    if Path(name).expanduser().exists() or is_hub_id(name):
        return None
    return "no such directory" + ("" if name.startswith((".", "/", "~")) else " (nor a Hub id, which reads ORG/NAME)")


def missing_problem(flag: str, name: str) -> Optional[str]:
    """Why `name`, given to `flag`, names nothing: a local path that does not exist and is no Hub id either (checked
    up front); None where it may load."""
    why = _missing(name)
    return f"{flag} {name}: {why}; check the path" if why else None


def unreachable_reason(name: str, revision: Optional[str] = None) -> Optional[str]:
    """Why `name` did not load where transformers' own reason misleads, without the fix: a missing local path, or
    a Hub id offline that the local cache lacks (asked after a load failed: the cache is not searched up front)."""
    why = _missing(name)
    if why or Path(name).expanduser().exists() or not hub_offline() or in_hub_cache(name, revision):
        return why
    from huggingface_hub.constants import HF_HUB_CACHE

    return (f"no such local directory, and as a Hub id it is not in the local Hugging Face cache ({HF_HUB_CACHE}) "
            "while HF_HUB_OFFLINE is set")


def unreachable_problem(flag: str, name: str, revision: Optional[str] = None) -> Optional[str]:
    """unreachable_reason, said of `flag` with its fix."""
    why = unreachable_reason(name, revision)
    if why is None:
        return None
    fix = "check the path" if why.startswith("no such directory") else \
        "give the path of a local copy, or unset HF_HUB_OFFLINE to download it"
    return f"{flag} {name}: {why}; {fix}"


def tokenizer_problem(flag: str, name: str) -> Optional[str]:
    """Why the local `name`, given to `flag` as where the tokenizer comes from, holds no tokenizer; None where it
    does or is not local. A bare tokenizer.json file is refused, not loaded: it names no eos or pad token and no
    tokenizer class (which --add_bos asks), and a tokenizer_config.json beside it is where those are written."""
    path = Path(name).expanduser()
    if path.is_file():
        return (f"{flag} {name} is a file; {flag} takes the directory holding tokenizer.json, with a "
                "tokenizer_config.json naming eos_token and pad_token beside it (e.g. mkdir tok && cp "
                f"{name} tok/tokenizer.json, then pass tok)")
    if not path.is_dir() or has_tokenizer_files(path):
        return None
    if flag == "--model_name_or_path" and _is_empty_of_models(path):
        return (f"{flag} {name} holds no model files (config.json, weights) and no tokenizer files "
                f"({_TOKENIZER_NAMES}); pass the directory of a downloaded or exported model")
    if flag == "--model_name_or_path":
        return (f"{flag} {name} holds no tokenizer files ({_TOKENIZER_NAMES}); pass the model's tokenizer "
                "directory with --tokenizer_name_or_path")
    return f"{flag} {name} holds no tokenizer files ({_TOKENIZER_NAMES}); pass the directory that holds them"


def model_file_problem(name: str, config_given: bool = False, weights_needed: bool = True) -> Optional[str]:
    """Why the local `name` given to --model_name_or_path is no model directory: a file, a LoRA run's output
    (an adapter without config.json, which transformers calls 'Unrecognized model ... Should have a model_type key
    in its config.json' after the data is tokenized), a run's output directory or step checkpoint before its
    export, or a directory without config.json (unless `config_given`: --config_name) or, `weights_needed`, without
    weights (both said by transformers only after the data is tokenized); None otherwise."""
    problem = _not_a_model_dir(name)
    path = Path(name).expanduser()
    if problem or not path.is_dir() or (path / "adapter_config.json").is_file() or not has_tokenizer_files(path):
        return problem  # (a directory without tokenizer files is named when the tokenizer loads: tokenizer_problem)
    if not config_given and not (path / "config.json").is_file():
        return (f"--model_name_or_path {name} holds no config.json (the model's architecture); pass the directory of "
                "a downloaded or exported model, or name its config with --config_name")
    if weights_needed and not any(next(path.glob(pattern), None) for pattern in WEIGHT_FILES):
        return (f"--model_name_or_path {name} holds no weights (model.safetensors, pytorch_model.bin or their "
                "shards); copy or download them "
                "beside its config.json (a copy cut short?), or pass the directory of a downloaded or exported model")
    return None


# What transformers loads a model's weights from (sharded ones have an index beside them)
WEIGHT_FILES = ("*.safetensors", "*.bin")


def _not_a_model_dir(name: str) -> Optional[str]:
    """Why the local `name` is something other than a model directory: a file, a LoRA adapter, a run's output
    directory or step checkpoint from which no model was exported; None otherwise."""
    path = Path(name).expanduser()
    if path.is_file():
        return (f"--model_name_or_path {name} is a file; pass the directory holding the model's config.json and "
                "weights")
    if (path / "adapter_config.json").is_file() and not (path / "config.json").is_file():
        merged = path / "merged"
        way = (f"pass its merged model, {merged} (--merge_lora_on_save wrote it)" if (merged / "config.json").is_file()
               else f"merge it into its base first, `python -m open_sft merge-lora {name} {name.rstrip('/')}_merged`, "
               "and pass that directory")
        return (f"--model_name_or_path {name} is a LoRA adapter (adapter_config.json, no config.json), not a model "
                f"to fine-tune from; {way}")
    if (path / COMPLETE).is_file():
        return (f"--model_name_or_path {name} is a training checkpoint, not a model; export it first, `python -m "
                f"open_sft export {name} OUT`, and pass OUT")
    if (path / "checkpoints").is_dir() and not (path / "config.json").is_file():
        steps = [done.parent for done in path.glob(f"checkpoints/step_*/{COMPLETE}") if done.parent.name[5:].isdigit()]
        newest = max(steps, key=lambda step: int(step.name[5:]), default=path / "checkpoints" / "step_N")
        return (f"--model_name_or_path {name} is a run's output directory from which no model was exported yet; "
                f"export its newest complete checkpoint, `python -m open_sft export {newest} OUT`, and pass OUT")
    return None


def _is_empty_of_models(path: Path) -> bool:
    return not (path / "config.json").is_file() and not (path / "adapter_config.json").is_file()
