"""Checkpoints that survive anything: kill -9 / SIGTERM and relaunch equals the uninterrupted run
(bitwise in one process, 1e-6 relative with 2 ranks under ZeRO-2 and ZeRO-3), partial checkpoints are
ignored, pruning keeps the newest complete one, resume refuses a changed data/batch layout, the sharded
export reloads, and the Hub upload retries, fails cleanly and never leaks the token.

Runs are shared through module fixtures (one run serves several assertions). The whole launch is
interrupted: the launcher and its workers (torchrun starts workers in their own sessions).

The tests of this subject that launch real processes are in tests/integration/test_checkpoint.py.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest


def _publish_steps(root, steps, timeline=None) -> None:
    """Complete checkpoints of these steps under root, written as a run writes them (tmp, then publish); by a run
    resumed from the named checkpoint `timeline` (a resolved path) if given."""
    from open_sft.training.checkpoint import publish

    for step in steps:
        tmp = root / f"step_{step}.tmp"
        tmp.mkdir(parents=True)
        (tmp / "trainer_state.json").write_text(json.dumps({"step": step, "timeline_from": timeline}))
        publish(tmp, root / f"step_{step}", step)


def test_prune_never_touches_an_incomplete_checkpoint(tmp_path) -> None:
    from open_sft.training.checkpoint import prune

    root = tmp_path / "checkpoints"
    _publish_steps(root, (2, 4, 6))
    (root / "step_8").mkdir()  # being written (renamed, COMPLETE not yet)
    (root / "step_10.tmp").mkdir()
    removed = prune(root, keep=1)
    assert sorted(p.name for p in removed) == ["step_2", "step_4"]
    assert sorted(p.name for p in root.iterdir()) == ["step_10.tmp", "step_6", "step_8"]


def test_what_a_kill_while_pruning_leaves_is_deleted_by_the_next_pruning(tmp_path, monkeypatch, caplog) -> None:
    """hunt C F5: rmtree unlinks in the filesystem's order (COMPLETE first on tmpfs), so a kill while pruning
    step_2 left an incomplete step_2 that prune never touched: a leak of a whole checkpoint, forever. Pruning now
    deletes COMPLETE first, and an incomplete checkpoint older than a usable one is deleted with a line."""
    import shutil

    from open_sft.training import checkpoint

    root = tmp_path / "checkpoints"
    _publish_steps(root, (2, 4, 6))
    (root / "step_2" / "optimizer.bin").write_bytes(b"o" * 100)
    real = shutil.rmtree

    def killed(path, *args, **kwargs):  # the kill, part-way: what it has unlinked so far stays unlinked
        (path / "trainer_state.json").unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.prune(root, keep=2)
    assert not (root / "step_2" / "COMPLETE").exists() and (root / "step_2" / "optimizer.bin").exists()
    monkeypatch.setattr(checkpoint.shutil, "rmtree", real)
    _publish_steps(root, (8,))
    with caplog.at_level(logging.INFO, logger="open_sft.training.checkpoint"):
        assert [p.name for p in checkpoint.prune(root, keep=2)] == ["step_4"]
    assert sorted(p.name for p in root.iterdir()) == ["step_6", "step_8"]
    assert (f"deleted {root / 'step_2'}: it has no COMPLETE and is older than step_8, a usable checkpoint: what a "
            "kill while pruning it left") in caplog.text


def test_damaged_checkpoint_is_detected(tmp_path) -> None:
    import torch

    from open_sft.training.checkpoint import publish
    from open_sft.training.resume import newest_complete

    root = tmp_path / "checkpoints"
    for step in (2, 4):
        tmp = root / f"step_{step}.tmp"
        tmp.mkdir(parents=True)
        (tmp / "trainer_state.json").write_text(json.dumps({"step": step}))
        torch.save({"state": {}}, tmp / "optimizer.bin")
        publish(tmp, root / f"step_{step}", step)
    optimizer = root / "step_4" / "optimizer.bin"
    optimizer.write_bytes(optimizer.read_bytes()[:10])  # truncated after the fact
    assert newest_complete(root) == root / "step_2"


def test_a_checkpoint_whose_tensor_files_do_not_read_is_moved_aside_or_named(tmp_path, caplog) -> None:
    """Zeros over the start of the newest checkpoint's model.safetensors (sizes unchanged, so the manifest passed):
    every relaunch crashed on safetensors' traceback. Now auto moves it to step_4.damaged with a line and resumes
    from the one before; a named damaged checkpoint is refused naming the file."""
    import torch
    from safetensors.torch import save_file

    from open_sft.errors import UserError
    from open_sft.training.checkpoint import publish
    from open_sft.training.resume import IDENTITY_BEFORE_RECORDED, newest_complete, resolve_resume

    root = tmp_path / "checkpoints"
    for step in (2, 4):
        tmp = root / f"step_{step}.tmp"
        tmp.mkdir(parents=True)
        (tmp / "trainer_state.json").write_text(json.dumps({"step": step}))
        save_file({"w": torch.ones(64)}, str(tmp / "model.safetensors"))
        torch.save({"state": {0: torch.ones(64)}}, tmp / "optimizer.bin")
        publish(tmp, root / f"step_{step}", step)

    def zero_start(file) -> None:
        data = bytearray(file.read_bytes())
        data[:64] = bytes(64)
        file.write_bytes(bytes(data))

    zero_start(root / "step_4" / "model.safetensors")
    with caplog.at_level(logging.WARNING):
        assert newest_complete(root) == root / "step_2"
    assert (root / "step_4.damaged").is_dir() and not (root / "step_4").exists()
    assert "model.safetensors is damaged" in caplog.text and "moved to step_4.damaged" in caplog.text
    zero_start(root / "step_2" / "optimizer.bin")
    with pytest.raises(UserError, match=r"step_2: not a usable checkpoint \(optimizer.bin is damaged"):
        resolve_resume(str(root / "step_2"), tmp_path, dict(IDENTITY_BEFORE_RECORDED), is_main=True)


@pytest.mark.parametrize("damage", ["optimizer tail zeroed", "optimizer zeroed", "rng zeroed", "rng byte flipped"])
def test_torch_archives_that_are_no_zip_or_fail_their_crc_are_damage(tmp_path, caplog, damage) -> None:
    """hunt C F2/F3: an optimizer.bin whose last 4 KiB were zeroed (a torn tail) or all of it passed as undamaged
    (only zips were looked into): every relaunch crashed in torch.load; a zeroed random_states_0.pkl (accelerate's
    torch.save archive, whose failed load it only logs at info) resumed with other RNG states, silently off the
    uninterrupted run. Each now moves the checkpoint to step_4.damaged and resumes from step_2."""
    import torch

    from open_sft.training.checkpoint import publish
    from open_sft.training.resume import newest_complete

    root = tmp_path / "checkpoints"
    for step in (2, 4):
        tmp = root / f"step_{step}.tmp"
        tmp.mkdir(parents=True)
        (tmp / "trainer_state.json").write_text(json.dumps({"step": step}))
        torch.save({"state": {0: torch.ones(4096)}}, tmp / "optimizer.bin")
        torch.save({"torch": torch.get_rng_state(), "step": step}, tmp / "random_states_0.pkl")
        publish(tmp, root / f"step_{step}", step)
    file = root / "step_4" / ("optimizer.bin" if damage.startswith("optimizer") else "random_states_0.pkl")
    data = bytearray(file.read_bytes())
    if damage == "optimizer tail zeroed":
        data[-4096:] = bytes(4096)
    elif damage == "rng byte flipped":  # inside the RNG state's tensor data: its member's CRC-32 fails
        data[len(data) // 2] ^= 0xFF
    else:
        data[:] = bytes(len(data))
    file.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        assert newest_complete(root) == root / "step_2"
    assert (root / "step_4.damaged").is_dir()
    assert f"{file.name} is damaged" in caplog.text


def test_resume_none_moves_earlier_checkpoints_aside(tmp_path) -> None:
    from open_sft.training.resume import resolve_resume

    (tmp_path / "checkpoints" / "step_2").mkdir(parents=True)
    assert resolve_resume("none", tmp_path, {}, is_main=True) is None
    assert (tmp_path / "checkpoints.previous-1" / "step_2").is_dir()
    assert not (tmp_path / "checkpoints").exists()


def test_rewind_moves_the_abandoned_checkpoints_aside_and_its_requeue_resumes_its_own(tmp_path, caplog) -> None:
    """--resume_from_checkpoint OUT/checkpoints/step_20 on a run with 20, 25, 30: 25 and 30 (another timeline)
    move aside, so pruning and auto see only the new one; the same command requeued after the new timeline saved
    step_25 (and pruned step_20) resumes from that, not from the named path."""
    from open_sft.config.args import CheckpointArguments
    from open_sft.config.checks import _checkpoint_problems
    from open_sft.training.checkpoint import prune
    from open_sft.training.resume import IDENTITY_BEFORE_RECORDED, resolve_resume, set_aside_other_timeline

    root, identity = tmp_path / "checkpoints", dict(IDENTITY_BEFORE_RECORDED)
    _publish_steps(root, (20, 25, 30))
    named = str(root / "step_20")
    resume = resolve_resume(named, tmp_path, identity, is_main=True)
    assert len(list(root.iterdir())) == 3  # moved once the resume is accepted (a refused one changes nothing)
    with caplog.at_level(logging.WARNING):
        set_aside_other_timeline(resume, tmp_path)
    assert (resume.path, resume.timeline) == (root / "step_20", str((root / "step_20").resolve()))
    assert sorted(p.name for p in (tmp_path / "checkpoints.previous-1").iterdir()) == ["step_25", "step_30"]
    assert "step_25, step_30 were moved to" in caplog.text.replace("(", "").replace(")", "")
    _publish_steps(root, (25,), resume.timeline)
    assert prune(root, keep=1) == [root / "step_20"]
    assert _checkpoint_problems(CheckpointArguments(resume_from_checkpoint=named), str(tmp_path)) == []
    requeued = resolve_resume(named, tmp_path, identity, is_main=True)
    assert (requeued.path, requeued.timeline) == (root / "step_25", resume.timeline)
    set_aside_other_timeline(requeued, tmp_path)
    assert [p.name for p in root.iterdir()] == ["step_25"]
    assert resolve_resume("auto", tmp_path, identity, is_main=True).path == root / "step_25"


def test_warm_start_from_another_run_is_requeued_from_its_own_checkpoints(tmp_path) -> None:
    """open-instruct: --resume_from_checkpoint OTHER_RUN/... counts until the output dir has a checkpoint of its
    own; an unrelated earlier run's checkpoints there are moved aside."""
    from open_sft.training.resume import IDENTITY_BEFORE_RECORDED, resolve_resume, set_aside_other_timeline

    identity, root = dict(IDENTITY_BEFORE_RECORDED), tmp_path / "out" / "checkpoints"
    _publish_steps(tmp_path / "other" / "checkpoints", (20,))
    _publish_steps(root, (5,))
    named = str(tmp_path / "other" / "checkpoints" / "step_20")
    resume = resolve_resume(named, tmp_path / "out", identity, is_main=True)
    set_aside_other_timeline(resume, tmp_path / "out")
    assert resume.path == Path(named) and (tmp_path / "out" / "checkpoints.previous-1" / "step_5").is_dir()
    _publish_steps(root, (25,), resume.timeline)
    assert resolve_resume(named, tmp_path / "out", identity, is_main=True).path == root / "step_25"
    _publish_steps(root, (30,))  # not of this timeline (as if written before the record): the named path wins
    assert resolve_resume(named, tmp_path / "out", identity, is_main=True).path == Path(named)


def test_retry_policy() -> None:
    import httpx2
    from huggingface_hub.errors import HfHubHTTPError
    from open_sft.export.hub import is_transient, with_retries

    def http_error(status: int) -> HfHubHTTPError:
        response = httpx2.Response(status, request=httpx2.Request("POST", "http://127.0.0.1/x"))
        return HfHubHTTPError(f"{status}", response=response)

    assert is_transient(http_error(503)) and is_transient(http_error(429))
    assert is_transient(httpx2.RemoteProtocolError("dropped")) and is_transient(httpx2.ReadTimeout("slow"))
    assert not is_transient(http_error(403)) and not is_transient(ValueError("bad"))
    from huggingface_hub.errors import OfflineModeIsEnabled

    assert not is_transient(OfflineModeIsEnabled("HF_HUB_OFFLINE is set"))  # waiting does not unset it
    calls, sleeps = [], []

    def forbidden():
        calls.append(1)
        raise http_error(403)

    with pytest.raises(HfHubHTTPError):
        with_retries("x", forbidden, sleep=sleeps.append)
    assert len(calls) == 1 and sleeps == []  # a refusal is not retried
    outcomes = [http_error(500), httpx2.ConnectError("refused"), "ok"]

    def flaky():
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    os.environ["OPEN_SFT_HUB_BACKOFF_S"] = "1.5"
    try:
        assert with_retries("x", flaky, sleep=sleeps.append) == "ok"
    finally:
        del os.environ["OPEN_SFT_HUB_BACKOFF_S"]
    assert sleeps == [1.5, 3.0]  # exponential backoff


def _identity(*flags: str) -> dict:
    from open_sft.config.parse import parse_config
    from open_sft.distributed.parallelism import Parallelism
    from open_sft.training.resume import run_identity

    return run_identity(parse_config(["--model_name_or_path", "m", "--dataset_mixer_list", "d.jsonl", "1.0",
                                      "--output_dir", "o", *flags]), "key", Parallelism("single"))


@pytest.mark.parametrize("saved_flags, now_flags", [
    ((), ("--use_lora",)), (("--use_lora",), ()), (("--use_lora", "--lora_rank", "8"), ("--use_lora",)),
    (("--use_lora", "--lora_target_modules", "q_proj", "v_proj"), ("--use_lora",)),
    (("--use_lora", "--lora_alpha", "32"), ("--use_lora",))])
def test_a_checkpoint_of_other_adapters_is_refused_by_name(tmp_path, saved_flags, now_flags) -> None:
    from open_sft.errors import UserError
    from open_sft.training.resume import check_compatible

    with pytest.raises(UserError, match="--use_lora / --use_qlora, --lora_rank"):
        check_compatible(tmp_path, _identity(*saved_flags), _identity(*now_flags))
    check_compatible(tmp_path, _identity(*now_flags), _identity(*now_flags))
    saved = _identity(*saved_flags)
    del saved["adapters"]  # a checkpoint written before adapters were recorded resumes as before
    check_compatible(tmp_path, saved, _identity(*now_flags))


def test_adapter_identity_ignores_the_order_of_target_modules() -> None:
    assert (_identity("--use_lora", "--lora_target_modules", "q_proj", "v_proj")["adapters"]
            == _identity("--use_lora", "--lora_target_modules", "v_proj", "q_proj")["adapters"]
            == "LoRA rank 64, alpha 16, on q_proj v_proj")


class _Accelerator:
    is_main_process = True

    def wait_for_everyone(self) -> None:
        pass


class _StateIO:
    def save(self, directory: str) -> None:
        (Path(directory) / "model.safetensors").write_bytes(b"weights")

    def load(self, directory: str) -> None:
        pass


def _checkpointer(output_dir: Path, keep: int):
    from open_sft.training.checkpointer import Checkpointer

    steps = SimpleNamespace(position=lambda step: (0, step), epochs_done=lambda step: 0.0, to_dict=dict)
    trainer = SimpleNamespace(steps=steps, state_dict=dict, load_state_dict=lambda state: None)
    args = SimpleNamespace(checkpointing_steps="2", keep_last_n_checkpoints=keep)
    return Checkpointer(_Accelerator(), trainer, output_dir, args, identity={"seed": 1}, config={},
                        reduce_sum=None, stop=None, state_io=_StateIO())


def test_metrics_are_on_disk_before_the_checkpoint_that_covers_them_is_complete(tmp_path, monkeypatch) -> None:
    """A resume keeps metrics.jsonl's lines up to its step: they are fsynced before COMPLETE is."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 2, "loss": 1.0}\n')
    synced: list[str] = []
    fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), fsync(fd)))
    final = _checkpointer(tmp_path, keep=2).save(2)
    metrics, complete = str(tmp_path / "metrics.jsonl"), str(final / "COMPLETE.tmp")
    assert metrics in synced and complete in synced
    assert synced.index(metrics) < synced.index(complete)


def test_a_resume_completes_the_pruning_a_kill_left_undone(tmp_path, caplog) -> None:
    """Killed between step 6's COMPLETE and its pruning (--keep_last_n_checkpoints 2): three checkpoints. The next
    start resuming step 6 deletes step 2, with a line; one resuming the named step 4 deletes nothing."""
    from open_sft.training.checkpoint import ResumePoint

    root = tmp_path / "checkpoints"
    _publish_steps(root, (2, 4, 6))
    _checkpointer(tmp_path, keep=2).restore(ResumePoint(root / "step_4", {"step": 4}))
    assert sorted(p.name for p in root.iterdir()) == ["step_2", "step_4", "step_6"]
    with caplog.at_level(logging.INFO, logger="open_sft.training.checkpointer"):
        assert _checkpointer(tmp_path, keep=2).restore(ResumePoint(root / "step_6", {"step": 6})) == 6
    assert sorted(p.name for p in root.iterdir()) == ["step_4", "step_6"]
    assert f"deleted old checkpoint {root / 'step_2'} (--keep_last_n_checkpoints 2): the pruning the last run was " \
           "stopped before" in caplog.text


def test_a_lowered_keep_says_so_when_the_resume_prunes(tmp_path, caplog) -> None:
    """hunt C F9: a relaunch with --keep_last_n_checkpoints 1 over checkpoints kept under 3 said 'the pruning the
    last run was stopped before'; the setting changed."""
    from open_sft.training.checkpoint import ResumePoint

    root = tmp_path / "checkpoints"
    _publish_steps(root, (2, 4, 6))
    state = {"step": 6, "config": {"checkpoint": {"keep_last_n_checkpoints": 3}}}
    with caplog.at_level(logging.INFO, logger="open_sft.training.checkpointer"):
        _checkpointer(tmp_path, keep=1).restore(ResumePoint(root / "step_6", state))
    assert sorted(p.name for p in root.iterdir()) == ["step_6"]
    assert f"deleted old checkpoint {root / 'step_4'} (--keep_last_n_checkpoints 1): lowered from 3 since the " \
           "checkpoints were written" in caplog.text
    assert "stopped before" not in caplog.text


def test_a_missing_resume_path_is_refused_before_anything_loads(tmp_path) -> None:
    from open_sft.config.parse import parse_config
    from open_sft.errors import ConfigError
    from open_sft.training.checkpoint import problem_with

    missing = tmp_path / "checkpoints" / "step_8"
    args = ["--model_name_or_path", "m", "--dataset_mixer_list", "d.jsonl", "1.0", "--output_dir", str(tmp_path)]
    with pytest.raises(ConfigError, match=re.escape(f"--resume_from_checkpoint {missing}: no such directory; pass a "
                                                    "complete checkpoint directory")):
        parse_config([*args, "--resume_from_checkpoint", str(missing)])
    weights = tmp_path / "model.safetensors"  # a file: it read 'no such directory'
    weights.write_bytes(b"")
    with pytest.raises(ConfigError, match=re.escape(f"--resume_from_checkpoint {weights}: a file, not a directory; "
                                                    "pass a complete checkpoint directory")):
        parse_config([*args, "--resume_from_checkpoint", str(weights)])
    assert problem_with(weights) == "a file, not a directory"
    missing.mkdir(parents=True)
    assert parse_config([*args, "--resume_from_checkpoint", str(missing)]).checkpoint.resume_from_checkpoint == \
        str(missing)


def test_a_repeated_signal_after_the_stop_checkpoint_changes_nothing(tmp_path) -> None:
    """Ctrl-C reaches a rank twice (the terminal, then the launcher forwarding it): after the stop's checkpoint the
    second one is noted, not raised as KeyboardInterrupt, and the run ends as stopped (Preempted, exit 75)."""
    import signal

    from open_sft.training.preemption import Preempted, StopRequest

    checkpointer = _checkpointer(tmp_path, keep=2)
    checkpointer.stop = StopRequest().install()
    checkpointer.accelerator.end_training = lambda: None
    checkpointer.preempted_at = 4
    previous = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(Preempted, match="stopped on a signal after step 4"):
            checkpointer.raise_if_preempted(metrics=None)
        signal.raise_signal(signal.SIGINT)  # the second Ctrl-C: no KeyboardInterrupt
        assert checkpointer.stop.signal_name == "SIGINT"
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_run_directory_given_for_a_checkpoint_names_its_newest_complete_one(tmp_path, capsys) -> None:
    """`open_sft export RUN_DIR OUT` said "no COMPLETE marker (interrupted while being written)": nothing was."""
    from open_sft.export.from_checkpoint import main

    run = tmp_path / "run"
    _publish_steps(run / "checkpoints", (2, 4))
    (run / "checkpoints" / "step_6").mkdir()  # being written: not the one to pass
    (run / "run.json").write_text("{}")
    for given, what in ((run, "output directory"), (run / "checkpoints", "checkpoints/ directory")):
        assert main([str(given), str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert (f"{given}: not a usable checkpoint (it is a run's {what}, not a checkpoint; pass its newest "
                f"complete checkpoint, {run / 'checkpoints' / 'step_4'})") in err
        assert "interrupted" not in err


def test_a_refused_resume_names_the_world_size_only_where_the_ranks_are_what_is_refused(tmp_path) -> None:
    """A checkpoint of 2 ranks resumes on 1 (open_sft.training.elastic): refused for another micro-batch, the
    refusal names the micro-batch alone (it listed the world size too, which made the ranks look like the reason)."""
    from open_sft.errors import UserError
    from open_sft.training.resume import check_compatible

    saved = {**_identity("--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2"), "world_size": 2}
    now = _identity("--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2")
    with pytest.raises(UserError) as refused:
        check_compatible(tmp_path, saved, now)
    lines = [line for line in str(refused.value).splitlines() if line.startswith("  - ")]
    assert lines == ["  - --per_device_train_batch_size: checkpoint 2, now 4"]
    staged = {**saved, "engine": "pipeline", "pipeline_parallel_size": 2}  # written per rank: the ranks are refused
    with pytest.raises(UserError, match=r"the number of processes \(world size\): checkpoint 2, now 1"):
        check_compatible(tmp_path, staged, {**now, "engine": "pipeline", "pipeline_parallel_size": 2})


def test_pruning_a_symlinked_checkpoint_removes_the_link_and_leaves_its_target(tmp_path, caplog) -> None:
    """review ckpt 2: checkpoints/step_2 -> a bigger disk: pruning deleted COMPLETE through the link, then
    shutil.rmtree raised 'Cannot call rmtree on a symbolic link' after the new checkpoint was published (and at
    every later save). The link is removed; the target, the user's and outside the run, is left whole."""
    from open_sft.training.checkpoint import prune

    root, big = tmp_path / "out" / "checkpoints", tmp_path / "big"
    _publish_steps(big, (2,))
    _publish_steps(root, (4, 6))
    (root / "step_2").symlink_to(big / "step_2")
    with caplog.at_level(logging.WARNING, logger="open_sft.training.checkpoint"):
        assert [p.name for p in prune(root, keep=1)] == ["step_4", "step_2"]
    assert sorted(p.name for p in root.iterdir()) == ["step_6"]
    assert sorted(p.name for p in (big / "step_2").iterdir()) == ["COMPLETE", "trainer_state.json"]
    assert (f"old checkpoint {root / 'step_2'} is a link to {big / 'step_2'}: the link was removed, its target is "
            "left (delete it yourself to free its space)") in caplog.text


def test_a_checkpoint_pruning_cannot_delete_is_a_warning_and_the_next_pruning_deletes_it(tmp_path, monkeypatch,
                                                                                        caplog) -> None:
    """review ckpt 2: on NFS, deleting a checkpoint another process reads leaves .nfsXXXX files and rmtree fails
    ENOTEMPTY: the run died after publishing its checkpoint. Pruning warns; the next one deletes what is left."""
    import errno
    import shutil

    from open_sft.training import checkpoint

    root = tmp_path / "checkpoints"
    _publish_steps(root, (2, 4))
    real = shutil.rmtree

    def busy(path, *args, **kwargs):
        raise OSError(errno.ENOTEMPTY, "Directory not empty", str(path / ".nfs0000000000a1"))

    monkeypatch.setattr(checkpoint.shutil, "rmtree", busy)
    with caplog.at_level(logging.WARNING, logger="open_sft.training.checkpoint"):
        assert checkpoint.prune(root, keep=1) == []
    assert f"could not delete old checkpoint {root / 'step_2'} (" in caplog.text
    assert "Directory not empty" in caplog.text and "the next pruning deletes what is left" in caplog.text
    assert sorted(p.name for p in (root / "step_2").iterdir()) == ["trainer_state.json"]  # COMPLETE went first
    monkeypatch.setattr(checkpoint.shutil, "rmtree", real)
    _publish_steps(root, (6,))
    assert [p.name for p in checkpoint.prune(root, keep=1)] == ["step_4"]
    assert sorted(p.name for p in root.iterdir()) == ["step_6"]


def _linked_root(tmp_path) -> tuple[Path, Path]:
    """OUT/checkpoints, a link to BIG/ckpts (a run's checkpoints routed to a bigger disk), with step_2 and step_4."""
    out, big = tmp_path / "out", tmp_path / "big" / "ckpts"
    _publish_steps(big, (2, 4))
    out.mkdir()
    (out / "checkpoints").symlink_to(big)
    return out, big


def test_clean_checkpoints_at_end_empties_a_symlinked_checkpoints_dir_and_keeps_the_link(tmp_path) -> None:
    """review ckpt 2: --clean_checkpoints_at_end on a symlinked checkpoints/ crashed in shutil.rmtree. The run's
    checkpoints in the target are deleted; the link, the target and what else it holds stay."""
    from open_sft.training.checkpoint import remove_all

    out, big = _linked_root(tmp_path)
    (big / "step_6.tmp").mkdir()
    (big / "notes.txt").write_text("mine")
    remove_all(out)
    assert (out / "checkpoints").is_symlink() and [p.name for p in big.iterdir()] == ["notes.txt"]


def test_starting_over_keeps_a_symlinked_checkpoints_dir_and_its_target_in_place(tmp_path, monkeypatch) -> None:
    """review ckpt 2: --resume_from_checkpoint none renamed the link itself, so the new run wrote a new checkpoints/
    onto the output disk; then it renamed the link's target, which needs write access beside it (a link to
    /scratch/$USER: EACCES; to a mount point: EBUSY) and renamed a folder the user may keep other things in. The
    earlier files move into previous-N inside the target (on its disk); the link and the target stay; a rewind's
    abandoned checkpoints move there as well; step_dirs and pruning see none of them."""
    import errno

    from open_sft.training import checkpoint
    from open_sft.training.resume import IDENTITY_BEFORE_RECORDED, resolve_resume, set_aside_other_timeline

    out, big = _linked_root(tmp_path)
    (big / "notes.txt").write_text("mine")
    real_rename = Path.rename

    def rename(self, target):  # the target's parent is not the user's to write (the tests run as root: chmod can't)
        if self == big or Path(target).parent == big.parent:
            raise PermissionError(errno.EACCES, "Permission denied")
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    assert resolve_resume("none", out, {}, is_main=True) is None
    assert (out / "checkpoints").is_symlink() and (out / "checkpoints").resolve() == big
    assert [p.name for p in big.iterdir()] == ["previous-1"]
    assert sorted(p.name for p in (big / "previous-1").iterdir()) == ["notes.txt", "step_2", "step_4"]
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints"] and list(big.parent.iterdir()) == [big]
    _publish_steps(big, (2, 4))
    resume = resolve_resume(str(out / "checkpoints" / "step_2"), out, dict(IDENTITY_BEFORE_RECORDED), is_main=True)
    set_aside_other_timeline(resume, out)
    assert sorted(p.name for p in big.iterdir()) == ["previous-1", "previous-2", "step_2"]
    assert [p.name for p in (big / "previous-2").iterdir()] == ["step_4"]
    assert [n for n, _ in checkpoint.step_dirs(out / "checkpoints")] == [2]
    assert [p.name for p in checkpoint.prune(out / "checkpoints", keep=0)] == ["step_2"]
    assert sorted(p.name for p in big.iterdir()) == ["previous-1", "previous-2"]
    _publish_steps(big, (6,))  # a second start over: the earlier previous-K stay where they are
    assert resolve_resume("none", out, {}, is_main=True) is None
    assert sorted(p.name for p in big.iterdir()) == ["previous-1", "previous-2", "previous-3"]
    assert [p.name for p in (big / "previous-3").iterdir()] == ["step_6"]


def test_a_symlinked_checkpoints_dir_whose_files_cannot_move_is_set_aside_as_a_link(tmp_path, monkeypatch,
                                                                                   caplog) -> None:
    """Where the target's entries cannot be moved inside it (EXDEV from a mount under it, a read-only target), the
    link is renamed aside, as before, and the run says its checkpoints are now on the output directory's disk."""
    import errno

    from open_sft.training.resume import resolve_resume

    out, big = _linked_root(tmp_path)
    real_rename = Path.rename

    def rename(self, target):
        if self.parent == big:
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    with caplog.at_level(logging.WARNING):
        assert resolve_resume("none", out, {}, is_main=True) is None
    assert (out / "checkpoints.previous-1").is_symlink() and (out / "checkpoints.previous-1").resolve() == big
    assert not (out / "checkpoints").is_symlink() and list((out / "checkpoints").iterdir()) == []
    assert sorted(p.name for p in big.iterdir()) == ["step_2", "step_4"]
    assert (f"{out / 'checkpoints'} links to {big}, whose earlier files could not be moved into previous-1 there "
            f"([Errno {errno.EXDEV}] Invalid cross-device link): the link was renamed to "
            f"{out / 'checkpoints.previous-1'} instead, and the new run writes to a new directory "
            f"{out / 'checkpoints'} on the output directory's disk") in caplog.text
    assert f"the earlier checkpoints were moved to {out / 'checkpoints.previous-1'}" in caplog.text


def test_a_named_resume_removes_the_partial_checkpoints_of_its_output_dir(tmp_path, caplog) -> None:
    """review ckpt 4: only --resume_from_checkpoint auto removed a step_N.tmp a SIGKILL left mid-save, and the
    .universal.tmp/.portable.tmp scratch of a load: a requeued command naming its checkpoint kept them forever (no
    pruning counts them). Every resume but none (which moves the whole directory aside) removes them."""
    from open_sft.training.resume import _choose

    root = tmp_path / "checkpoints"
    _publish_steps(root, (5,))
    for partial in ("step_7.tmp", "step_5.universal.tmp", "step_5.portable.tmp"):
        (root / partial / "pytorch_model").mkdir(parents=True)
    with caplog.at_level(logging.WARNING, logger="open_sft.training.resume"):
        assert _choose(str(root / "step_5"), tmp_path) == (root / "step_5", str((root / "step_5").resolve()))
    assert [p.name for p in root.iterdir()] == ["step_5"]
    assert f"removing partial checkpoint {root / 'step_7.tmp'} (interrupted while being written)" in caplog.text


def test_a_warm_start_begins_metrics_anew_and_a_rewind_keeps_its_own_lines(tmp_path) -> None:
    """review ckpt 3: a warm start from another run's checkpoint kept the output dir's earlier run's metrics.jsonl
    lines up to the step, mixed with the new run's. A resume from a checkpoint outside OUT/checkpoints begins
    metrics.jsonl anew (as a fresh start); one inside (auto, a rewind, a requeue) keeps its lines up to the step."""
    from open_sft.training.checkpoint import ResumePoint
    from open_sft.training.resume import prepare_metrics_file

    out, other = tmp_path / "out", tmp_path / "other" / "checkpoints"
    _publish_steps(other, (4,))
    _publish_steps(out / "checkpoints", (4,))
    metrics, lines = out / "metrics.jsonl", "".join(f'{{"step": {s}, "loss": {s}}}\n' for s in range(1, 7))
    metrics.write_text(lines)
    prepare_metrics_file(metrics, ResumePoint(out / "checkpoints" / "step_4", {"step": 4}))
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2, 3, 4]
    metrics.write_text(lines)
    prepare_metrics_file(metrics, ResumePoint(other / "step_4", {"step": 4}, str((other / "step_4").resolve())))
    assert not metrics.exists()
