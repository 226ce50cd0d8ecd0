"""A QLoRA checkpoint holds the trained weights, not the frozen 4-bit base, and reads back exactly; one written
before that layout (the whole state dict, bitsandbytes' quantization state included) reads back too.

(The real run: tests/integration/test_lora.py, a QLoRA run killed after a checkpoint resumes to the straight run's
losses and adapter, in one process and on 2 DDP ranks.)
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, load_model, save_file

from open_sft.config.args import LoraArguments
from open_sft.errors import UserError
from open_sft.model.load import load_model as load_open_sft_model
from open_sft.model.loss import TokenLossModel
from open_sft.training.trained_state import TrainedWeightsState, trained_names
from unit.model.test_model_options import make_batch, model_args


class _Accelerator:
    """accelerate's save_state / load_state as far as the model file goes, hooks included (accelerator.py:
    save-state hooks get (models, state dicts, directory) before the state dicts are written; load-state hooks get
    (models, directory) and what they leave in `models` is read with safetensors' load_model, strictly)."""

    def __init__(self, model: torch.nn.Module):
        self.models, self.save_hooks, self.load_hooks = [model], {}, {}

    def _register(self, hooks: dict, hook) -> object:
        key = object()
        hooks[key] = hook
        return type("Handle", (), {"remove": lambda _self: hooks.pop(key)})()

    def register_save_state_pre_hook(self, hook):
        return self._register(self.save_hooks, hook)

    def register_load_state_pre_hook(self, hook):
        return self._register(self.load_hooks, hook)

    def save_state(self, directory: str) -> None:
        weights = [model.state_dict() for model in self.models]
        for hook in self.save_hooks.values():
            hook(self.models, weights, directory)
        save_file({k: v.contiguous() for k, v in weights[0].items()}, str(Path(directory) / "model.safetensors"))

    def load_state(self, directory: str) -> None:
        models = list(self.models)
        for hook in self.load_hooks.values():
            hook(models, directory)
        for model in models:
            load_model(model, str(Path(directory) / "model.safetensors"))


def _qlora(tiny_model_dir, seed: int) -> TokenLossModel:
    torch.manual_seed(seed)  # the LoRA A factors' initialisation
    model = load_open_sft_model(model_args(tiny_model_dir),
                                lora=LoraArguments(use_qlora=True, lora_rank=4, lora_dropout=0.0))
    return TokenLossModel(model)


def _trained(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in model.named_parameters() if param.requires_grad}


@pytest.fixture(scope="module")
def trained_qlora(tiny_model_dir) -> TokenLossModel:
    """A QLoRA model after two AdamW steps (LoRA B no longer zero)."""
    model = _qlora(tiny_model_dir, seed=0).train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step in range(2):
        model(**make_batch(seed=step)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def test_a_qlora_checkpoint_holds_the_trained_weights_and_reads_back_exactly(trained_qlora, tiny_model_dir,
                                                                             tmp_path) -> None:
    TrainedWeightsState(_Accelerator(trained_qlora)).save(str(tmp_path))
    stored = load_file(tmp_path / "model.safetensors")
    assert sorted(stored) == sorted(trained_names(trained_qlora)) and len(stored) == 2 * 7 * 2
    fresh = _qlora(tiny_model_dir, seed=1)
    assert not all(torch.equal(a, b) for a, b in zip(_trained(fresh).values(), _trained(trained_qlora).values()))
    accelerator = _Accelerator(fresh)
    TrainedWeightsState(accelerator).load(str(tmp_path))
    want, got = _trained(trained_qlora), _trained(fresh)
    assert want.keys() == got.keys() and all(torch.equal(want[n], got[n]) for n in want)
    assert not accelerator.save_hooks and not accelerator.load_hooks  # the hooks are this save's and load's only
    batch = make_batch(seed=5)
    with torch.no_grad():
        assert torch.equal(fresh.eval()(**batch), trained_qlora.eval()(**batch))


def test_a_checkpoint_holding_the_whole_4bit_base_resumes_and_a_missing_trained_weight_is_named(
        trained_qlora, tiny_model_dir, tmp_path) -> None:
    """What a QLoRA run wrote before (accelerate's whole state dict: the 4-bit base with its quantization state,
    which torch's strict load refused: the relaunch of every preempted QLoRA run failed) loads; a file without a
    trained weight is refused, naming it, not started from a fresh adapter."""
    _Accelerator(trained_qlora).save_state(str(tmp_path))
    whole = load_file(tmp_path / "model.safetensors")
    assert any(name.endswith(".weight.absmax") for name in whole)
    fresh = _qlora(tiny_model_dir, seed=1)
    with pytest.raises(RuntimeError, match="Unexpected key.*absmax"):
        _Accelerator(fresh).load_state(str(tmp_path))  # the plain load, as before
    TrainedWeightsState(_Accelerator(fresh)).load(str(tmp_path))
    want, got = _trained(trained_qlora), _trained(fresh)
    assert all(torch.equal(want[n], got[n]) for n in want)

    lost = trained_names(trained_qlora)[3]
    save_file({k: v for k, v in whole.items() if k != lost}, str(tmp_path / "model.safetensors"))
    with pytest.raises(UserError, match=rf"missing 1: {re.escape(lost)};.*adapters it was trained with"):
        TrainedWeightsState(_Accelerator(_qlora(tiny_model_dir, seed=1))).load(str(tmp_path))


def test_a_qlora_resume_on_another_base_is_refused_naming_the_revision(tmp_path, tiny_model_dir) -> None:
    """review ckpt 6: a QLoRA checkpoint holds the adapter alone and each start quantizes --model_name_or_path again,
    so a base moved to another Hub revision (or local files replaced) resumed the adapter on weights it was never
    trained on, silently. The identity records the base: its Hub commit, or a local directory's fingerprint (each
    weight file's size, header and 8 × 8 KiB of its data); full and LoRA checkpoints hold their base and record none."""
    import shutil
    from types import SimpleNamespace

    from open_sft.config.parse import parse_config
    from open_sft.distributed.parallelism import Parallelism
    from open_sft.training.resume import check_compatible, run_identity

    base = Path(shutil.copytree(tiny_model_dir, tmp_path / "base"))

    def identity(*flags: str, model_config=None) -> dict:
        config = parse_config(["--model_name_or_path", str(base), "--output_dir", str(tmp_path / "out"),
                               "--dataset_mixer_list", "d.jsonl", "1.0", *flags])
        return run_identity(config, "k", Parallelism(engine="single"), model_config)

    local = SimpleNamespace(_commit_hash=None)
    saved = identity("--use_qlora", model_config=local)
    assert re.fullmatch(r"local files [0-9a-f]{16}", saved["base"])
    assert identity("--use_qlora", model_config=local) == saved  # the same files: the same fingerprint
    assert "base" not in identity("--use_lora", model_config=local) and "base" not in identity(model_config=local)
    weights = load_file(base / "model.safetensors")
    save_file({name: tensor + 1 for name, tensor in weights.items()}, str(base / "model.safetensors"))  # same shapes
    now = identity("--use_qlora", model_config=local)
    with pytest.raises(UserError) as refused:
        check_compatible(tmp_path, saved, now)
    assert ("  - the QLoRA base's weights (--model_name_or_path: each start quantizes it again, the checkpoint holds "
            "the adapter alone; pin the checkpoint's Hub revision with --model_revision, or restore its files): "
            f"checkpoint {saved['base']!r}, now {now['base']!r}") in str(refused.value)
    hub = identity("--use_qlora", model_config=SimpleNamespace(_commit_hash="0123abc"))
    assert hub["base"] == "revision 0123abc"
    check_compatible(tmp_path, {k: v for k, v in saved.items() if k != "base"}, now)  # a checkpoint before the record


def test_a_local_base_fingerprint_sees_a_middle_tensor_behind_a_large_header(tmp_path) -> None:
    """An MoE shard's header (~700 tensors) is over 64 KiB: the first 64 KiB of two fine-tunes of the same shapes
    were the same header, and their last 64 KiB the same last tensors, so a base whose middle tensor changed kept
    its fingerprint. The tensor data is sampled evenly now (8 × 8 KiB), the header read whole."""
    from types import SimpleNamespace

    from open_sft.training.trained_state import base_fingerprint

    tensors = {f"model.layers.{i:03d}.mlp.experts.{e}.down_proj.weight": torch.zeros(64)
               for i in range(100) for e in range(7)}
    tensors["model.layers.050.mlp.experts.3.middle.weight"] = torch.zeros(1 << 20)  # 4 MiB, in the data's middle
    files = []
    for name, shift in (("one", 0.0), ("two", 1.0)):
        (tmp_path / name).mkdir()
        save_file({k: v + shift if "middle" in k else v for k, v in tensors.items()},
                  str(tmp_path / name / "model.safetensors"))
        files.append((tmp_path / name / "model.safetensors").read_bytes())
    header = 8 + int.from_bytes(files[0][:8], "little")
    assert header > 64 << 10 and len(files[0]) == len(files[1])
    assert files[0][:64 << 10] == files[1][:64 << 10] and files[0][-(64 << 10):] == files[1][-(64 << 10):]
    local = SimpleNamespace(_commit_hash=None)
    one, two = (base_fingerprint(str(tmp_path / name), local) for name in ("one", "two"))
    assert re.fullmatch(r"local files [0-9a-f]{16}", one) and one != two
    assert base_fingerprint(str(tmp_path / "one"), local) == one
