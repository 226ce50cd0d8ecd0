"""A QLoRA checkpoint's model file holds the weights the run trains (LoRA factors, added tokens' rows), not the
frozen 4-bit base.

Why the base is left out rather than stored and read back: it is made again at every start from
--model_name_or_path (bitsandbytes' NF4 quantization is deterministic: the same base gives the same 4-bit weights
and quantization state), so a copy in every checkpoint is dead weight (~5 GB per checkpoint of an 8B model); and
what accelerate's load_state reads it with (torch's load_state_dict, strictly) takes none of the quantization-state
entries bitsandbytes writes beside each 4-bit weight (`weight.absmax`, `weight.quant_map`, `weight.nested_absmax`,
...): the relaunch of a preempted QLoRA run stopped there. The other readers of a checkpoint's weights need no
more: `open_sft export` gives a QLoRA checkpoint's adapter from its trained tensors (its merge is refused: the base
is 4-bit), and a resume under another engine refuses LoRA and QLoRA checkpoints (training.portable).

On load every trained parameter must be in the file, with its shape, and the file may hold nothing this model lacks
(a missing one is an error naming it, never a silent start from a fresh adapter); the frozen base a checkpoint
written before this layout holds (quantization state included) is passed over, so those checkpoints resume too.
The optimizer, RNG states and the rest are accelerate's save_state and load_state as for every other run.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from open_sft.errors import UserError

MODEL_FILE = "model{}.safetensors"  # accelerate's save_state: model.safetensors, model_1.safetensors, ...
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth")
SAMPLES, SAMPLE = 8, 8 << 10  # a local base's fingerprint: 8 windows of 8 KiB spread over each file's tensor data
HEADER_MAX = 100 << 20  # safetensors' own limit on a header; a larger length is no safetensors header


def base_fingerprint(name: str, model_config: Any) -> str:
    """What names the base a QLoRA run quantizes again at every start (its checkpoint records it: resume.run_identity):
    its Hub commit (the loaded config's _commit_hash), else, for a local directory, a digest of each weight file's
    name, size, safetensors header (the tensors' names, shapes and offsets) and SAMPLES windows of SAMPLE bytes
    spread evenly over its tensor data, first and last included (another fine-tune of the same shapes has the same
    header, MoE shards' headers are over 100 KB: its weights differ in the data). A multi-GB base is not read whole
    at each start: 64 KiB of data per file. Full and LoRA checkpoints hold their base's weights and record none."""
    commit = getattr(model_config, "_commit_hash", None)
    if commit:
        return f"revision {commit}"
    directory = Path(name).expanduser()
    files = sorted({f for pattern in WEIGHT_FILES for f in directory.glob(pattern)}) if directory.is_dir() else []
    digest = hashlib.sha256()
    for file in files:
        digest.update(f"{file.name}\0{file.stat().st_size}\0".encode())
        sample_weights(file, digest)
    return f"local files {digest.hexdigest()[:16]}" if files else f"{name} (no revision, no local weight files)"


def sample_weights(file: Path, digest: Any) -> None:
    """Into `digest`: a weight file's safetensors header (nothing for other formats) and SAMPLES windows of SAMPLE
    bytes spread over its tensor data (the whole file where it is no longer than the windows together)."""
    size = file.stat().st_size
    with file.open("rb") as handle:
        data = _data_start(handle, size) if file.suffix == ".safetensors" else 0
        handle.seek(0)
        digest.update(handle.read(data))
        for offset, length in _windows(data, size):
            handle.seek(offset)
            digest.update(handle.read(length))


def _data_start(handle: Any, size: int) -> int:
    """Where a safetensors file's tensor data begins (after its 8-byte little-endian header length and the header),
    or 0 where the length is no header's (the windows then spread over the whole file)."""
    length = int.from_bytes(handle.read(8), "little")
    return 8 + length if 8 + length <= size and length <= HEADER_MAX else 0


def _windows(start: int, end: int) -> list[tuple[int, int]]:
    """(offset, length) of SAMPLES windows of SAMPLE bytes spread evenly over [start, end), the first at start and
    the last ending at end; the whole span in one where it is no longer than the windows together."""
    span = end - start
    if span <= SAMPLES * SAMPLE:
        return [(start, span)]
    step = (span - SAMPLE) / (SAMPLES - 1)
    return [(start + round(i * step), SAMPLE) for i in range(SAMPLES)]


def trained_names(model: torch.nn.Module) -> list[str]:
    return [name for name, param in model.named_parameters() if param.requires_grad]


def keep_trained(models: list[torch.nn.Module], weights: list[dict[str, torch.Tensor]], _directory: str) -> None:
    """accelerate's save-state hook: each model's state dict cut down to its trained parameters."""
    for model, state in zip(models, weights):
        trained = set(trained_names(model))
        for name in [name for name in state if name not in trained]:
            del state[name]


def load_trained(model: torch.nn.Module, path: Path) -> None:
    """The trained parameters of `model` from the safetensors file `path` (see the module's docstring)."""
    from safetensors import safe_open

    params = dict(model.named_parameters())
    trained = trained_names(model)
    with safe_open(str(path), "pt") as file:
        stored = set(file.keys())
        missing = [name for name in trained if name not in stored]
        unknown = sorted(stored - set(model.state_dict()))
        if missing or unknown:
            raise UserError(f"{path.parent}: the checkpoint does not hold this run's trained weights (missing "
                            f"{len(missing)}: {', '.join(missing[:3]) or 'none'}; not in this model {len(unknown)}: "
                            f"{', '.join(unknown[:3]) or 'none'}); resume it with the model and adapters it was "
                            "trained with, or start over with --resume_from_checkpoint none")
        tensors = {name: file.get_tensor(name) for name in trained}
    wrong = [f"{name} {tuple(t.shape)} (this model: {tuple(params[name].shape)})"
             for name, t in tensors.items() if t.shape != params[name].shape]
    if wrong:
        raise UserError(f"{path.parent}: trained weights of other shapes than this model's: {'; '.join(wrong[:3])}; "
                        "resume it with the model and adapters it was trained with")
    with torch.no_grad():
        for name, tensor in tensors.items():
            params[name].copy_(tensor)


class TrainedWeightsState:
    """The Checkpointer's `state_io` of a QLoRA run: accelerate's save_state and load_state, the model file holding
    its trained weights only (keep_trained; load_trained, which takes the models from accelerate's own load)."""

    def __init__(self, accelerator: Any):
        self.accelerator = accelerator

    def save(self, directory: str) -> None:
        handle = self.accelerator.register_save_state_pre_hook(keep_trained)
        try:
            self.accelerator.save_state(directory)
        finally:
            handle.remove()

    def load(self, directory: str) -> None:
        def load_models(models: list[torch.nn.Module], input_dir: str) -> None:
            for index, model in enumerate(models):
                load_trained(model, Path(input_dir) / MODEL_FILE.format(f"_{index}" if index else ""))
            models.clear()  # loaded: accelerate's strict load of the whole state dict is not run

        handle = self.accelerator.register_load_state_pre_hook(load_models)
        try:
            self.accelerator.load_state(directory)
        finally:
            handle.remove()
