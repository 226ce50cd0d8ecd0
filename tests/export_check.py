"""`open_sft export` of a run's step checkpoint against the run's own end export of the same step: the integration
tests of each engine call `assert_export_is_the_runs` on a run they already launched (no launch of their own)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from safetensors.torch import load_file


def weights_of(directory: Path) -> dict[str, torch.Tensor]:
    weights = {}
    for file in sorted(directory.glob("*.safetensors")):
        weights.update(load_file(file))
    return weights


def tree_digest(directory: Path) -> dict[str, str]:
    """Every file under `directory` with its content's SHA-256: the run's directory must not change."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def assert_export_is_the_runs(run_dir: Path, step: int, out: Path, **options) -> Path:
    """Export run_dir's checkpoint of `step` (the run's last) to `out` in this process; its weights (and merged/'s)
    must be the run's end export's, bitwise, with the same names and dtypes; the run's directory is left as it
    was. Returns `out`."""
    from open_sft.export.from_checkpoint import export_checkpoint

    checkpoint = run_dir / "checkpoints" / f"step_{step}"
    before = tree_digest(run_dir)
    export_checkpoint(checkpoint, out, **options)
    assert tree_digest(run_dir) == before
    for sub in ("", "merged"):
        ours, theirs = weights_of(out / sub), weights_of(run_dir / sub)
        assert theirs, f"the run wrote no weights in {run_dir / sub}"
        assert sorted(ours) == sorted(theirs), (set(ours) ^ set(theirs))
        for name, tensor in theirs.items():
            assert ours[name].dtype == tensor.dtype and torch.equal(ours[name], tensor), name
        if not (run_dir / "merged").is_dir():
            break
    return out
