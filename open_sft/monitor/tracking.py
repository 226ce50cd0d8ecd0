"""Experiment trackers behind `--with_tracking --report_to {tensorboard,wandb,all,none}`.

Every tracker receives the same records that go to metrics.jsonl. Train fields are logged under
`train/<name>`, eval fields (`eval_<name>`) under `eval/<name>`, both against the optimizer step.
Secrets (tokens, passwords, API keys) are removed from anything a tracker stores.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Optional, Protocol, Sequence

from open_sft.errors import UserError
from open_sft.redaction import redact_secrets

logger = logging.getLogger(__name__)

TRACKERS = ("tensorboard", "wandb")
REPORT_TO_CHOICES = (*TRACKERS, "all", "none")
WANDB_INSTALL_HINT = "pip install 'open_sft[wandb]'"


class Tracker(Protocol):
    def log(self, scalars: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def trackers_for(report_to: str | Sequence[str]) -> tuple[str, ...]:
    """The tracker names --report_to stands for (one value or a list, as open-instruct takes it)."""
    names = [report_to] if isinstance(report_to, str) else list(report_to)
    for name in names:
        if name not in REPORT_TO_CHOICES:
            raise UserError(f"--report_to {name!r}: expected one or more of {', '.join(REPORT_TO_CHOICES)}")
    if "all" in names:
        return TRACKERS
    return tuple(dict.fromkeys(name for name in names if name != "none"))


def scalars_of(record: dict[str, Any]) -> dict[str, float]:
    """Tracker names of a metrics record's numeric fields: `train/loss`, `eval/loss`, ... (not `step`)."""
    scalars = {}
    for key, value in record.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        name = f"eval/{key.removeprefix('eval_')}" if key.startswith("eval_") else f"train/{key}"
        scalars[name] = float(value)
    return scalars


class TensorBoardTracker:
    """Event files under `<output_dir>/tensorboard/` via torch's SummaryWriter."""

    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, scalars: dict[str, float], step: int) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A W&B run. WANDB_MODE=offline writes it under `<output_dir>/wandb/` without network
    (`wandb sync` uploads it later). The project is --wandb_project_name, else WANDB_PROJECT, else open_sft;
    the run name --exp_name, else the output directory's name."""

    def __init__(self, output_dir: Path, run_config: dict[str, Any], name: Optional[str] = None,
                 project: Optional[str] = None, entity: Optional[str] = None):
        try:
            import wandb
        except ImportError as exc:
            raise UserError(f"--report_to wandb needs the wandb package: {WANDB_INSTALL_HINT}") from exc
        # x_disable_meta: W&B would otherwise store the command line, where a --hub_token may sit.
        settings = wandb.Settings(x_disable_meta=True, save_code=False, disable_git=True)
        self.run = wandb.init(project=project or os.environ.get("WANDB_PROJECT", "open_sft"),
                              name=name or output_dir.name, entity=entity,
                              dir=os.environ.get("WANDB_DIR", str(output_dir)),
                              config=redact_secrets(run_config), settings=settings)

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


def build_trackers(report_to: str | Sequence[str], output_dir: Path, run_config: Optional[dict[str, Any]] = None,
                   **wandb_options: Optional[str]) -> list[Tracker]:
    """The trackers --report_to asks for; call on the main process only. `wandb_options`: name, project,
    entity of the W&B run."""
    trackers: list[Tracker] = []
    for name in trackers_for(report_to):
        if name == "tensorboard":
            trackers.append(TensorBoardTracker(output_dir / "tensorboard"))
        else:
            trackers.append(WandbTracker(output_dir, run_config or {}, **wandb_options))
    logger.info("tracking with %s", ", ".join(trackers_for(report_to)) or "no tracker")
    return trackers
