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


def _publish_steps(root, steps) -> None:
    """Complete checkpoints of these steps under root, written as a run writes them (tmp, then publish)."""
    from open_sft.training.checkpoint import publish

    for step in steps:
        tmp = root / f"step_{step}.tmp"
        tmp.mkdir(parents=True)
        (tmp / "trainer_state.json").write_text(json.dumps({"step": step}))
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


def test_damaged_checkpoint_is_detected(tmp_path) -> None:
    from open_sft.training.checkpoint import publish
    from open_sft.training.resume import newest_complete

    root = tmp_path / "checkpoints"
    for step in (2, 4):
        tmp = root / f"step_{step}.tmp"
        tmp.mkdir(parents=True)
        (tmp / "trainer_state.json").write_text(json.dumps({"step": step}))
        (tmp / "model.safetensors").write_bytes(b"x" * 100)
        publish(tmp, root / f"step_{step}", step)
    (root / "step_4" / "model.safetensors").write_bytes(b"x" * 10)  # truncated after the fact
    assert newest_complete(root) == root / "step_2"


def test_resume_none_moves_earlier_checkpoints_aside(tmp_path) -> None:
    from open_sft.training.resume import resolve_resume

    (tmp_path / "checkpoints" / "step_2").mkdir(parents=True)
    assert resolve_resume("none", tmp_path, {}, is_main=True) is None
    assert (tmp_path / "checkpoints.previous-1" / "step_2").is_dir()
    assert not (tmp_path / "checkpoints").exists()


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
    from open_sft.training.checkpoint import Checkpointer

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
    with caplog.at_level(logging.INFO, logger="open_sft.training.checkpoint"):
        assert _checkpointer(tmp_path, keep=2).restore(ResumePoint(root / "step_6", {"step": 6})) == 6
    assert sorted(p.name for p in root.iterdir()) == ["step_4", "step_6"]
    assert f"deleted old checkpoint {root / 'step_2'} (--keep_last_n_checkpoints 2): the pruning the last run was " \
           "stopped before" in caplog.text


def test_a_missing_resume_path_is_refused_before_anything_loads(tmp_path) -> None:
    from open_sft.config.parse import parse_config
    from open_sft.errors import ConfigError

    missing = tmp_path / "checkpoints" / "step_8"
    args = ["--model_name_or_path", "m", "--dataset_mixer_list", "d.jsonl", "1.0", "--output_dir", str(tmp_path)]
    with pytest.raises(ConfigError, match=re.escape(f"--resume_from_checkpoint {missing}: no such directory; pass a "
                                                    "complete checkpoint directory")):
        parse_config([*args, "--resume_from_checkpoint", str(missing)])
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
