"""A finished run stays finished: OUTPUT_DIR/RUN_COMPLETE, written last.

A SLURM requeue or a re-run script relaunches the same command. Without a mark of the end, the relaunch would
resume from the newest checkpoint (step 17 of 30, say), train the steps after it again and overwrite the
export. So, as each checkpoint has its COMPLETE, the run writes OUTPUT_DIR/RUN_COMPLETE after everything else
it writes there (the export, the report and model card; before the wait for --push_checkpoints uploads, the
checkpoint clean-up and the optional Hub push, which a relaunch does when they were cut off: UPLOADS_KEY, "pushed"):
a JSON record of the last step and the export's files. The Hub upload leaves it out.

A launch with --resume_from_checkpoint auto (the default) on a directory with that record prints
`already complete: OUTPUT_DIR` on the main process and exits 0 on every rank before anything is loaded, locked
or written (every rank reads the record: checkpoints and their resume already need the directory shared).
`--overwrite_output_dir` starts over on purpose: training from step 0, the earlier checkpoints moved aside to
checkpoints.previous-N (as `--resume_from_checkpoint none` does; kept, never deleted), metrics.jsonl begun
anew and the export overwritten at the end. A launch that trains for any reason (that flag, `none`, or a named
checkpoint) removes the record once its resume point is settled, under the output-directory lock: the directory
then holds a run in progress, which a relaunch resumes (a launch refused before that leaves the record).
`--dry_run` and `--cache_dataset_only` neither read nor write it.

The record also holds the settings the run was launched with (every flag but those that do not change what is
trained or exported: logging, trackers, checkpoint cadence, caches, the Hub; open_sft.training.run_settings),
and, for a run resumed with --allow_changed_settings, the step ranges each set of them trained. A relaunch with
settings that match none of them (a new model, data or learning rate into the same directory) would otherwise
exit 0 with the old model: it is refused, naming each difference from the last range's. The record holds the
settings the run's command gave too (GIVEN_KEY): the same command, whose settings differ only where what it means
changed since (a default, or what a command line implies: an OLMo-core line's --adam_beta2 0.95 against the 0.999 a
run before that trained with), is `already complete` and names what it means now; a requeue of it stays a no-op.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Collection, Mapping, Optional

from open_sft.config.fields import field_default
from open_sft.durable import write_json
from open_sft.errors import UserError
from open_sft.model.precision import COMPUTE_DTYPE_KEY
from open_sft.training.input_identity import INPUT_FLAGS, INPUTS_KEY, MODEL_FLAGS, identities, same_by_content
from open_sft.training.run_settings import (BEFORE_THE_FLAG, DATA_PATH_FLAGS, SECTIONS, SETTINGS_KEY, compared,
                                            differences, differing, given_settings, history_on_resume, matching,
                                            recorded_settings, settings)

logger = logging.getLogger(__name__)

MARKER = "RUN_COMPLETE"  # not COMPLETE: `open_sft push` reads that as a checkpoint directory
PUSHED_KEY = "pushed"  # in the record: each upload of the export that succeeded (--push_to_hub)
#: In the record while the run's --push_checkpoints uploads are awaited (removed once none is left): a relaunch that
#: finds it uploads the checkpoints not recorded as uploaded (the end was stopped or killed during the wait)
UPLOADS_KEY = "checkpoint_uploads_left"
GIVEN_KEY = "given"  # in the record: the settings the run's command line gave (run_settings.given_settings)
IMPLIED_KEY = "implied"  # in the record: the names of the settings its command line implied (FinetuneConfig.implied)
BATCH_KEY = "trained_batch"  # in the record: the layout of the global batch the last steps trained (trained_batch)
# what the export is not: run bookkeeping and the training state, left out of the record's file list
NOT_EXPORT = ("checkpoints", "checkpoints.previous-", "tensorboard.previous-", ".open_sft.lock", "data_order.rank",
              "activations.rank", ".open_sft_export.json", MARKER, "wandb")  # wandb/ and wandb_run_id: the tracker's


def trained_batch(train: Any, world_size: int) -> dict[str, int]:
    """The record's BATCH_KEY: the micro-batch, accumulation and ranks the run's last steps trained with (the
    accumulation as fitted to a checkpoint of another number of ranks: open_sft.training.elastic)."""
    return {"micro_batch_size": int(train.per_device_train_batch_size),
            "gradient_accumulation_steps": int(train.gradient_accumulation_steps), "world_size": int(world_size)}


def _keeps_global_batch(record: dict[str, Any], now: dict[str, Any], env: Mapping[str, str]) -> bool:
    """Whether this launch's --gradient_accumulation_steps on its WORLD_SIZE ranks trains the global batch the run
    finished with: a run resumed on other ranks with an accumulation that keeps it was then launched with another,
    and the original command, requeued, is as much its command (a resume compares it so: CHECKED_BY_IDENTITY)."""
    batch = record.get(BATCH_KEY)
    if not isinstance(batch, dict) or not isinstance(now.get("gradient_accumulation_steps"), int):
        return False
    world = int(env.get("WORLD_SIZE") or 1)
    micro, world_then = int(batch["micro_batch_size"]), int(batch["world_size"])
    return micro * now["gradient_accumulation_steps"] * world == (
        micro * int(batch["gradient_accumulation_steps"]) * world_then)


def _differences(record: dict[str, Any], config: Any, env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """Nothing when this launch's settings match those of any step range the run recorded (the command that
    trained its first steps, before a resume with --allow_changed_settings, is as much its command as the last;
    the accumulation counts by the global batch it trains on this launch's ranks); else the differences from the
    last range's, each setting's name with its line (run_settings.differing)."""
    recorded = recorded_settings(record)
    now = _moved_back(record, recorded, settings(config), config)
    if _keeps_global_batch(record, now, env):
        recorded, now = [compared(then) for then in recorded], compared(now)
    computed = record.get(COMPUTE_DTYPE_KEY)
    if not recorded or matching(recorded, now, computed) is not None:
        return {}
    return differing(recorded[-1], now, computed=computed)


def _moved_back(record: dict[str, Any], recorded: list[dict[str, Any]], now: dict[str, Any], config: Any
                ) -> dict[str, Any]:
    """This launch's settings, each input path (INPUT_FLAGS) that differs from the last range's taken as recorded
    where its inputs are the run's by content (INPUTS_KEY: the same files at another place, a requeue on a node that
    mounts them elsewhere); a record written before they were recorded: none."""
    last = recorded[-1] if recorded else {}
    moved = [flag for flag in INPUT_FLAGS if flag in last and now.get(flag) != last[flag]]
    return {**now, **{flag: last[flag] for flag in same_by_content(record.get(INPUTS_KEY), config, moved)}}


def checks_completion(config: Any) -> bool:
    """Whether this launch stops at a completed run: a training launch that would resume by itself."""
    return not (config.train.dry_run or config.data.cache_dataset_only or config.checkpoint.overwrite_output_dir
                or config.checkpoint.resume_from_checkpoint != "auto")


def resume_setting(config: Any) -> str:
    """--resume_from_checkpoint as the run applies it: `none` under --overwrite_output_dir."""
    return "none" if config.checkpoint.overwrite_output_dir else config.checkpoint.resume_from_checkpoint


def already_complete(config: Any) -> Optional[str]:
    """The line to print when OUTPUT_DIR holds a completed run that this launch would only train again, else
    None. Raises UserError when the record is there but files of the export it lists are not."""
    output_dir = Path(config.train.output_dir)
    if not checks_completion(config):
        return None
    record = read_marker(output_dir)
    if record is None:
        return None
    missing = [name for name in record.get("files", {}) if not (output_dir / name).is_file()]
    if missing:
        raise UserError(f"--output_dir {output_dir}: the run there completed ({output_dir / MARKER}) but its export "
                        f"lacks {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}; restore the files, or "
                        "pass --overwrite_output_dir to train again from scratch")
    changed = _differences(record, config)
    lines = "\n".join(f"  - {line}" for line in changed.values())
    if changed and not _same_command(record, config, changed.keys()):
        from open_sft.training.checkpoint import CHECKPOINTS, newest_usable

        last = newest_usable(output_dir / CHECKPOINTS)  # none where --clean_checkpoints_at_end removed them
        on = (f"; or, to train on from its last checkpoint with these settings (more epochs or steps, another "
              f"learning rate: the steps after it train with them, recorded), --resume_from_checkpoint {last} "
              "--allow_changed_settings") if last else ""
        raise UserError(f"--output_dir {output_dir} holds a completed run launched with other settings:\n{lines}\n"
                        "Pass --overwrite_output_dir to train again with these settings (the earlier checkpoints are "
                        f"moved aside and the export replaced), or choose another --output_dir{on}")
    hub = config.hub
    upload = ""
    if hub.push_to_hub:
        url = pushed(record, hub.hub_model_id, hub.hub_revision)
        upload = (f"; its export was uploaded to {url}" if url else
                  f"; its export is not on the Hub at {hub.hub_model_id} ({hub.hub_revision}) yet: uploading it")
    done = (f"already complete: {output_dir} (trained to step {record.get('step')}, finished at "
            f"{record.get('finished_at')}); nothing to train{upload}.")
    if changed:  # the run's own command, which means other settings now
        return (f"{done} This command line now means settings the run did not train with (what it implies or "
                f"defaults to changed since; the export is what the run trained):\n{lines}\nTo train again with "
                "these settings pass --overwrite_output_dir (the earlier checkpoints are moved aside), or choose "
                "another --output_dir")
    return (f"{done} To train again from scratch pass --overwrite_output_dir (the earlier checkpoints are moved "
            "aside), or choose another --output_dir")


def _same_command(record: dict[str, Any], config: Any, changed: Collection[str]) -> bool:
    """Whether this launch gives what the completed run's command gave, its settings (`changed`: the names of
    those that differ) differing only in what that command means now (a default, or what a command line implies:
    an OLMo-core line's --adam_beta2, changed): a relaunch of it (a requeue, a re-run script) trains nothing, as for
    the same settings. The settings the run's command gave as recorded (GIVEN_KEY), and those it implied
    (IMPLIED_KEY: a flag that sets no setting, an OLMo-core line's --wandb_project, implies --packing and
    --adam_beta2); a relaunch that gives other settings, or gives one the run's command did not or leaves out one
    it gave, or implies others, is another command. An older
    record does not say what its command gave: each setting that differs must be one whose meaning changed
    (`_meaning_changed`), not given now."""
    now = given_settings(config)
    then = record.get(GIVEN_KEY)
    if isinstance(then, dict):
        return (then.keys() == now.keys() and record.get(IMPLIED_KEY, []) == sorted(config.implied)
                and not differences(then, now, computed=record.get(COMPUTE_DTYPE_KEY)))
    trained = recorded_settings(record)[-1]
    return all(name not in now and _meaning_changed(config, name, trained[name]) for name in changed)


def _meaning_changed(config: Any, name: str, trained: Any) -> bool:
    """Whether setting `name`, left out of a command line, meant `trained` (what the run trained with) before and
    means otherwise now: a setting a command line implies now (FinetuneConfig.implied: an OLMo-core line's
    --packing and --adam_beta2), or one that was no flag then (BEFORE_THE_FLAG), the run having trained with what
    it meant when left out (its default; BEFORE_THE_FLAG's value). Another setting that differs and is not given
    now is a flag the run's command gave and this one leaves out."""
    if name not in config.implied and name not in BEFORE_THE_FLAG:
        return False
    if name in BEFORE_THE_FLAG:
        return trained == BEFORE_THE_FLAG[name]
    default = field_default(name, *(type(getattr(config, section)) for section in SECTIONS))
    return trained == json.loads(json.dumps(default, default=str))


def pushed(record: dict[str, Any], repo_id: str, revision: str) -> Optional[str]:
    """The URL of the record's upload to `repo_id` at `revision`, or None."""
    for upload in record.get(PUSHED_KEY) or []:
        if upload.get("hub_model_id") == repo_id and upload.get("hub_revision") == revision:
            return upload.get("url") or repo_id
    return None


def note_uploads_left(output_dir: Path, left: bool) -> None:
    """Note in the completion record whether checkpoint uploads are left for a relaunch (UPLOADS_KEY)."""
    record = read_marker(output_dir)
    if record is not None and bool(record.get(UPLOADS_KEY)) != left:
        record.pop(UPLOADS_KEY, None)
        write_json(output_dir / MARKER, {**record, **({UPLOADS_KEY: True} if left else {})})


def mark_pushed(output_dir: Path, repo_id: str, revision: str, url: str) -> None:
    """Note a successful upload of the export in the completion record (written whole, as mark_complete)."""
    record = read_marker(output_dir)
    if record is None:
        return
    uploads = [u for u in record.get(PUSHED_KEY) or [] if (u.get("hub_model_id"), u.get("hub_revision"))
               != (repo_id, revision)]
    record[PUSHED_KEY] = uploads + [{"hub_model_id": repo_id, "hub_revision": revision, "url": url,
                                     "at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}]
    write_json(output_dir / MARKER, record)


def read_marker(output_dir: Path) -> Optional[dict[str, Any]]:
    """The completion record, or None where there is none (it is written whole or not at all)."""
    try:
        record = json.loads((output_dir / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def export_files(output_dir: Path) -> dict[str, int]:
    """The export's files (relative path → size): everything under OUTPUT_DIR but the run's bookkeeping."""
    files = {}
    for path in sorted(output_dir.rglob("*")):
        name = str(path.relative_to(output_dir))
        if path.is_file() and not name.startswith(NOT_EXPORT):
            files[name] = path.stat().st_size
    return files


def mark_complete(output_dir: Path, step: int, elapsed_s: float, launched: Optional[Any] = None,
                  by_steps: Optional[list[dict[str, Any]]] = None, computed: Any = None,
                  batch: Optional[dict[str, int]] = None, uploads_left: bool = False) -> None:
    """Written last by the main process: the record, fsynced and renamed into place; `launched`: the config as
    parsed, whose settings a relaunch must share; `by_steps`: the step ranges of a run resumed with changed
    settings (open_sft.training.run_settings.by_steps), any of whose settings a relaunch may share; `computed`: the
    compute dtype (torch.dtype) the run trained in (a relaunch's --torch_dtype is compared by it); `batch`: the
    global batch's layout (trained_batch; a relaunch's accumulation is compared by the global batch it trains);
    `uploads_left`: --push_checkpoints uploads are still to be awaited (UPLOADS_KEY). The identities of the
    launch's inputs (INPUTS_KEY) let a relaunch name them at another place."""
    record = {"step": step, "elapsed_s": elapsed_s, "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "files": export_files(output_dir), **({"settings": settings(launched)} if launched else {}),
              **({GIVEN_KEY: given_settings(launched), IMPLIED_KEY: sorted(launched.implied)} if launched else {}),
              **({SETTINGS_KEY: by_steps} if by_steps else {}), **({BATCH_KEY: batch} if batch else {}),
              **({COMPUTE_DTYPE_KEY: str(computed).removeprefix("torch.")} if computed else {}),
              **({UPLOADS_KEY: True} if uploads_left else {}),
              **({INPUTS_KEY: identities(launched)} if launched else {})}
    write_json(output_dir / MARKER, record)


def clear_marker(output_dir: Path) -> None:
    """Training starts (main process, under the output-directory lock, once the resume point is settled): the
    directory holds a run in progress from here on."""
    (output_dir / MARKER).unlink(missing_ok=True)


def refuse_past_schedule(resume: Any, total_steps: int) -> None:
    """A checkpoint past the end of this run's schedule (--max_train_steps lowered since) would be exported as it
    is, under this schedule's step count: refused, with the ways on."""
    if resume is not None and resume.step > total_steps:
        raise UserError(f"the checkpoint to resume from, {resume.path}, is at step {resume.step}, past the end of this "
                        f"run's schedule ({total_steps} optimizer steps): raise --max_train_steps to {resume.step} or "
                        "more (a changed setting: with --allow_changed_settings), or train anew with "
                        "--resume_from_checkpoint none (or --overwrite_output_dir)")


def check_resume_point(resume: Any, total_steps: int, launched: Any, resolved: dict[str, Any],
                       is_main: bool, identity: Optional[dict[str, Any]] = None) -> list[dict[str, Any]]:
    """refuse_past_schedule, then the settings rule (open_sft.training.run_settings): returns this launch's
    settings history. `launched`: the config as parsed; `resolved`: the config this launch trains with; `identity`:
    its run identity (resume.run_identity). The paths of the same inputs at another place are no changed setting:
    the sources', tokenizer's and template's where its data's cache key is the checkpoint's, the model's and
    config's where their identities are (input_identity; a checkpoint written before they were recorded: compared
    as written)."""
    refuse_past_schedule(resume, total_steps)
    saved, identity = (resume.state.get("identity") or {}) if resume else {}, identity or {}
    moved = set(DATA_PATH_FLAGS) if resume and saved.get("dataset_cache_key") == identity.get("dataset_cache_key") \
        and identity.get("dataset_cache_key") is not None else set()
    if moved:
        from open_sft.data.cache_inputs import keys_template

        if not keys_template(launched.data):  # text documents: the key holds neither template, which the export does
            moved -= {"tokenizer_name_or_path", "chat_template_path"}
    recorded, now = saved.get(INPUTS_KEY) or {}, identity.get(INPUTS_KEY) or {}
    moved |= {flag for flag in MODEL_FLAGS if recorded.get(flag) is not None and recorded[flag] == now.get(flag)}
    return history_on_resume(resume, settings(launched), resolved, launched.checkpoint.allow_changed_settings,
                             is_main, moved)
