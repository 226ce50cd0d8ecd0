"""Experiment trackers behind `--with_tracking --report_to {tensorboard,wandb,all,none}`.

Every tracker receives the same records that go to metrics.jsonl. Train fields are logged under
`train/<name>`, eval fields (`eval_<name>`) under `eval/<name>`, both against the optimizer step.
Secrets (tokens, passwords, API keys) are removed from anything a tracker stores.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from pathlib import Path
from urllib.parse import urlparse
from typing import Any, Optional, Protocol, Sequence

from open_sft.errors import UserError
from open_sft.redaction import redact_secrets

logger = logging.getLogger(__name__)

TRACKERS = ("tensorboard", "wandb")
REPORT_TO_CHOICES = (*TRACKERS, "all", "none")
WANDB_INSTALL_HINT = "pip install -e '.[wandb]' in the open_sft checkout"
WANDB_LOGIN_HINT = ("run `wandb login` (or set WANDB_API_KEY), log offline with WANDB_MODE=offline (`wandb sync` "
                    "uploads later), or track with --report_to tensorboard")


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


def wandb_login_problem(environ: Optional[dict[str, str]] = None, interactive: Optional[bool] = None,
                        home: Optional[Path] = None) -> Optional[str]:
    """Why W&B would refuse to start this run, found before the data and the model load (wandb.init would raise
    only when the trackers start); None where it may start. Looks where W&B looks for credentials: the
    environment, the netrc file, W&B's settings file; an interactive terminal lets W&B prompt for a key.
    (Read by hand: wandb's own lookup moves between releases and sits behind its private modules.)"""
    env = os.environ if environ is None else environ
    interactive = sys.stdin is not None and sys.stdin.isatty() if interactive is None else interactive
    home = Path.home() if home is None else home
    if env.get("WANDB_MODE", "online").lower() in ("offline", "dryrun", "disabled") or interactive:
        return None
    if env.get("WANDB_DISABLED", "").lower() in ("1", "true", "yes"):
        return None
    if env.get("WANDB_API_KEY") or env.get("WANDB_IDENTITY_TOKEN_FILE"):
        return None
    host = urlparse(env.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    netrc = Path(env["NETRC"]) if env.get("NETRC") else home / ".netrc"
    settings = Path(env.get("WANDB_CONFIG_DIR", home / ".config" / "wandb")) / "settings"
    for path, needle in ((netrc, host), (settings, "api_key")):
        try:
            if needle in path.read_text(errors="replace"):
                return None
        except OSError:
            continue
    return (f"--report_to wandb: no W&B API key for {host} (none in WANDB_API_KEY, {netrc} or {settings}) and no "
            f"terminal to ask for one; {WANDB_LOGIN_HINT}")


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
    """Event files under `<output_dir>/tensorboard/` via torch's SummaryWriter. Resumed from step N, the events
    a killed launch wrote after step N are purged (SummaryWriter's purge_step), so no step appears twice. A run
    that starts over (--overwrite_output_dir, --resume_from_checkpoint none) moves an earlier run's events to
    tensorboard.previous-N, as its checkpoints go to checkpoints.previous-N: TensorBoard shows two runs, not one
    curve drawn twice."""

    def __init__(self, log_dir: Path, resume_step: int = 0):
        from torch.utils.tensorboard import SummaryWriter

        from open_sft.durable import set_aside

        earlier = None if resume_step else set_aside(log_dir)
        if earlier is not None:
            logger.warning("starting over: the earlier run's TensorBoard events were moved to %s", earlier)
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=resume_step + 1 if resume_step else None)

    def log(self, scalars: dict[str, float], step: int) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


WANDB_RUN_ID = "wandb_run_id"  # in the output directory: the W&B run a resumed launch continues


class WandbTracker:
    """A W&B run. WANDB_MODE=offline writes it under `<output_dir>/wandb/` without network
    (`wandb sync` uploads it later). The project is --wandb_project_name, else WANDB_PROJECT, else open_sft;
    the run name --exp_name, else the output directory's name. A launch that resumes from a checkpoint
    continues the W&B run of the launch before it (its id kept in `<output_dir>/wandb_run_id`); one that
    starts over starts a new run."""

    def __init__(self, output_dir: Path, run_config: dict[str, Any], name: Optional[str] = None,
                 project: Optional[str] = None, entity: Optional[str] = None, resume_step: int = 0):
        try:
            import wandb
        except ImportError as exc:
            raise UserError(f"--report_to wandb needs the wandb package: {WANDB_INSTALL_HINT}") from exc
        # x_disable_meta: W&B would otherwise store the command line, where a --hub_token may sit.
        settings = wandb.Settings(x_disable_meta=True, save_code=False, disable_git=True)
        id_file = output_dir / WANDB_RUN_ID
        run_id = id_file.read_text().strip() if resume_step and id_file.exists() else None
        # what a failed start writes in the output directory is removed: with nothing else there, the run leaves
        # no directory behind (open_sft.training.output_lock), as for any other mistake of the user's
        fresh = None if os.environ.get("WANDB_DIR") or (output_dir / "wandb").exists() else output_dir / "wandb"
        try:
            self.run = wandb.init(project=project or os.environ.get("WANDB_PROJECT", "open_sft"),
                                  name=name or output_dir.name, entity=entity,
                                  dir=os.environ.get("WANDB_DIR", str(output_dir)),
                                  config=redact_secrets(run_config), settings=settings,
                                  **({"id": run_id, "resume": "allow"} if run_id else {}))
        except wandb.errors.Error as exc:  # no login, a refused key, an unreachable server: the user's to fix
            if fresh is not None:
                shutil.rmtree(fresh, ignore_errors=True)
            raise UserError(f"--report_to wandb: W&B did not start ({type(exc).__name__}: {exc}); "
                            f"{WANDB_LOGIN_HINT}") from None
        id_file.write_text(self.run.id + "\n")
        if run_id:
            logger.info("W&B: continuing run %s from step %d", run_id, resume_step)

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


def build_trackers(report_to: str | Sequence[str], output_dir: Path, run_config: Optional[dict[str, Any]] = None,
                   resume_step: int = 0, **wandb_options: Optional[str]) -> list[Tracker]:
    """The trackers --report_to asks for; call on the main process only. `resume_step`: the checkpoint step this
    launch resumes from (0: a new run). `wandb_options`: name, project, entity of the W&B run."""
    trackers: list[Tracker] = []
    for name in sorted(trackers_for(report_to), key=lambda n: n != "wandb"):  # W&B may refuse: before any file
        if name == "tensorboard":
            trackers.append(TensorBoardTracker(output_dir / "tensorboard", resume_step))
        else:
            trackers.append(WandbTracker(output_dir, run_config or {}, resume_step=resume_step, **wandb_options))
    logger.info("tracking with %s", ", ".join(trackers_for(report_to)) or "no tracker")
    return trackers


def ignored_trackers(with_tracking: bool, report_to: str | Sequence[str], explicit: frozenset[str]) -> Optional[str]:
    """The warning for trackers asked for with --report_to but not written, as open-instruct gates them too:
    without --with_tracking (a run that had asked for W&B exited 0 with no W&B run and no word of why)."""
    asked = trackers_for(report_to)
    if with_tracking or "report_to" not in explicit or not asked:
        return None
    return (f"--report_to {' '.join(asked)}: no tracker is written without --with_tracking (as in open-instruct); "
            "metrics.jsonl has every logged value. Add --with_tracking to write them")

