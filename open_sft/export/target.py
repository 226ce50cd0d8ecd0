"""Where `open_sft export` and `open_sft merge-lora` may write OUT: a new or empty directory, or one that these
commands wrote (their export there is replaced, as a run's export replaces its own). Never one of the command's
inputs (the base model, the adapter's directory) nor a directory of other files: a model that is not theirs would
be written over, or left beside this one for loaders to mix (a config.json and weights beside an adapter)."""

from __future__ import annotations

from pathlib import Path

from open_sft.errors import UserError
from open_sft.export.save import STAGING, export_record

SIDE_COMMANDS = ("open_sft export", "open_sft merge-lora")


def check_target(out: Path, command: str, inputs: dict[str, str]) -> None:
    """Raise UserError when `command` may not write to `out`; `inputs` (what → path or Hub id) are what it reads."""
    target = out.expanduser().resolve()
    for what, value in inputs.items():
        if value and Path(value).expanduser().exists() and Path(value).expanduser().resolve() == target:
            raise UserError(f"{out} is {what} ({value}), which {command} only reads: the model it writes would "
                            "overwrite it or be mixed with it; give a new directory for the output")
    if not target.is_dir() or export_record(target).get("written_by") in SIDE_COMMANDS:
        return
    content = sorted(p.name for p in target.iterdir() if p.name != STAGING)  # a killed export's staging
    if content:
        shown = ", ".join(content[:5]) + (f" (+{len(content) - 5} more)" if len(content) > 5 else "")
        raise UserError(f"{out} already holds files that {' or '.join(SIDE_COMMANDS)} did not write ({shown}): "
                        "they would be written over or mixed with this model; give a new or empty directory, or "
                        "remove that one first")
