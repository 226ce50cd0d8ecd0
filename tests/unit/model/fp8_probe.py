"""What test_fp8.py asserts on, computed in a process of its own with torchao on its path (tests/conftest.py FP8_SITE:
torchao is kept out of the suite's venv). Prints one JSON object.

- `layers`: open_sft.model.fp8's verdict for each kind of layer of Llama-3.1-8B's and Llama-3.2-1B's shapes (models on
  the meta device: no memory), per recipe;
- `train`: a tiny Llama trained 12 AdamW steps in bf16 and again with --fp8's conversion of every layer (the same
  initial weights and batches): the losses, the converted layers, whether the state dict's names and shapes stayed;
- `nothing_gains`: the error --fp8 gives for a model none of whose layers gains under torchao's rule."""

from __future__ import annotations

import copy
import json
import logging

import torch
import transformers

from open_sft.errors import UserError
from open_sft.model.fp8 import apply_fp8, choose_layers
from open_sft.monitor.quiet import quiet_third_parties

SHAPES = {
    "8B": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8),
    "1B": dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8),
}


def layer_verdicts() -> dict:
    out = {}
    for name, shape in SHAPES.items():
        config = transformers.LlamaConfig(**shape, num_hidden_layers=2, vocab_size=128256)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        for recipe in ("tensorwise", "rowwise"):
            verdicts = choose_layers(model, recipe, "auto")
            out[f"{name} {recipe}"] = {layer.rsplit(".", 1)[-1]: verdict for layer, verdict in verdicts.items()
                                       if ".layers.0." in layer}
    return out


def _tiny() -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    return transformers.AutoModelForCausalLM.from_config(config)


def _losses(model: torch.nn.Module, steps: int = 12) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 64, (4, 48), generator=generator)  # a small vocabulary in use: it can be learned
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def train() -> dict:
    base = _tiny()
    converted = copy.deepcopy(base)
    summary = apply_fp8(converted, "tensorwise", "all")
    names = lambda m: {k: tuple(v.shape) for k, v in m.state_dict().items()}  # noqa: E731
    kinds = sorted({type(m).__name__ for m in converted.modules() if "Linear" in type(m).__name__})
    return {"summary": summary, "module_kinds": kinds, "same_state_dict": names(base) == names(converted),
            "head_kind": type(converted.get_output_embeddings()).__name__,
            "bf16": _losses(base), "fp8": _losses(converted)}


def nothing_gains() -> str:
    try:
        apply_fp8(_tiny(), "tensorwise", "auto")
    except UserError as error:
        return str(error)
    return ""


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    quiet_third_parties()  # as a run does: torchao's import noise left out
    print(json.dumps({"layers": layer_verdicts(), "train": train(), "nothing_gains": nothing_gains()}))
