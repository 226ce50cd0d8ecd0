"""What run.json records besides the arguments: library versions and the git revision of open_sft."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

LIBRARIES = ("open_sft", "torch", "transformers", "accelerate", "deepspeed", "datasets", "peft", "tokenizers",
             "safetensors", "huggingface-hub")


CHECKOUT = Path(__file__).resolve().parents[2]  # the directory holding open_sft/: a checkout's root, or site-packages


def git_revision(checkout: Path = CHECKOUT) -> str | None:
    """The commit of the open_sft checkout this code runs from; None for an installed copy (`pip install .`), whose
    site-packages may lie inside another repository (a project's .venv/): its commit was recorded as open_sft's."""
    try:
        out = subprocess.run(["git", "rev-parse", "--show-toplevel", "HEAD"], capture_output=True, text=True,
                             timeout=10, cwd=checkout)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.split("\n")
    if out.returncode != 0 or len(lines) < 2 or Path(lines[0]).resolve() != checkout.resolve():
        return None
    return lines[1].strip() or None


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


def write_run_files(job: Any, trainer: Any) -> None:
    """run.json (what ran, where, with what) and data_report.json, before the first step."""
    import torch

    from open_sft.model.base_record import base_model_record
    from open_sft.training.optim import optimizer_impl
    from open_sft.training.run_settings import by_steps

    acc, launch = job.accelerator, job.launch
    write_json(job.output_dir / "run.json", {
        "args": job.config.to_dict(), "base_model": base_model_record(job.config.model.model_name_or_path),
        "versions": library_versions(), "world_size": acc.num_processes,
        "distributed_type": acc.distributed_type.name, "compute_dtype": str(job.dtype),
        "loss_normalization": job.config.train.loss_normalization, "schedule": job.steps.to_dict(),
        "dataset_cache_key": job.data.cache_key, "dataset_cache_path": str(job.data.cache_path),
        "git_revision": git_revision(), "deepspeed_config": job.ds_config, "threads_per_rank": torch.get_num_threads(),
        "compute_dtype_choice": launch.dtype_choice.to_dict(), "launch": launch.record,
        "preflight": job.preflight.to_dict(), "optimizer": optimizer_impl(trainer.optimizer),
        **({"eval_dataset_cache_key": job.eval_data.cache_key} if job.eval_data is not None else {}),
        **({"settings_by_steps": changed} if (changed := by_steps(job.settings_history, job.steps.total_steps))
           else {})})
    # the evaluation mixture's report beside the training one's (its rows in, kept and dropped per source; under
    # --eval_split_ratio the rows held out): only the build log and the cache had it
    eval_report = {"eval": job.eval_data.report} if job.eval_data is not None else {}
    write_json(job.output_dir / "data_report.json", {**job.data.report, **eval_report})


def write_audit_files(output_dir: Path, rank: int, trainer: Any) -> None:
    """Audit and test aids of this rank, when asked for: the examples it trained on, in order
    (OPEN_SFT_RECORD_DATA_ORDER), and its measured activation bytes (OPEN_SFT_RECORD_ACTIVATIONS)."""
    if os.environ.get("OPEN_SFT_RECORD_DATA_ORDER"):
        write_json(output_dir / f"data_order.rank{rank}.json",
                   {"rank": rank, "example_indices": trainer.seen_example_ids})
    if trainer.saved_activations is not None:
        write_json(output_dir / f"activations.rank{rank}.json",
                   {"rank": rank, "peak_saved_bytes": trainer.saved_activations.peak_bytes})
