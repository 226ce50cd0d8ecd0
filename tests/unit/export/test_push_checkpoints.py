"""--push_checkpoints: every complete checkpoint reaches the Hub (one commit each, COMPLETE included) in
the background, an injected 500 is retried, pruning never deletes a checkpoint whose upload is pending,
a failed upload warns with a retry command that works and never stops training, no token anywhere.

The tests of this subject that launch real processes are in tests/integration/test_push_checkpoints.py.
"""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import pytest

from open_sft.training.checkpoint import prune
from unit.export.test_hub_push import TOKEN, loopback_hub  # noqa: F401 (loopback_hub: a fixture)
from unit.training.test_checkpoint import _checkpointer, _publish_steps



@pytest.fixture(autouse=True)
def _uploaders_stopped(request, monkeypatch):
    """Every uploader a test starts has its thread stopped when the test ends. One left running logged after pytest
    had closed the test's capture stream ("Logging error ... Bad file descriptor"), and Python 3.11 prints that
    error's traceback with ast.parse (its caret anchors): racing test_layout's ast.parse in the same worker process,
    it failed that test with "SystemError: AST constructor recursion depth mismatch". The test's loopback Hub and
    capture are set up before this fixture's end, so they are torn down after it: the uploads still queued finish
    against the live server into the open capture (stopped first, the server left them retrying past the join, an
    uploader thread alive into later tests). A thread still running after that fails the test that started it. Its
    end is read off threading.enumerate(), not join()/is_alive(): Python 3.11's join, interrupted by a signal handler
    that raises (a test's SIGTERM during close()'s join: Preempted), marks the still running thread stopped, so a
    later join returned at once and the thread went on uploading into the following tests."""
    for name in ("capsys", "loopback_hub"):
        if name in request.fixturenames:
            request.getfixturevalue(name)
    from open_sft.export.hub_checkpoints import CheckpointUploader

    started, init = [], CheckpointUploader.__init__

    def recorded(self, hub):
        init(self, hub)
        started.append(self)

    monkeypatch.setattr(CheckpointUploader, "__init__", recorded)
    yield
    for uploader in started:
        uploader.queue.put(None)
    deadline = time.monotonic() + 60
    while any(uploader.thread in threading.enumerate() for uploader in started) and time.monotonic() < deadline:
        time.sleep(0.05)  # not join/is_alive: see below
    assert not any(uploader.thread in threading.enumerate() for uploader in started), "an uploader outlived its test"

def test_prune_skips_checkpoints_whose_upload_is_pending(tmp_path) -> None:
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        (root / f"step_{step}").mkdir(parents=True)
        (root / f"step_{step}" / "trainer_state.json").write_text("{}")
        (root / f"step_{step}" / "COMPLETE").write_text(json.dumps({"files": {"trainer_state.json": 2}}))
    assert prune(root, 1, busy={root / "step_2"}) == [root / "step_4"]
    assert sorted(p.name for p in root.iterdir()) == ["step_2", "step_6"]
    assert prune(root, 1) == [root / "step_2"]


def _uploader(revision: str = "main"):
    from open_sft.export.hub_checkpoints import CheckpointUploader

    return CheckpointUploader(SimpleNamespace(hub_model_id="org/c", hub_revision=revision, hub_private=True,
                                              hub_token=TOKEN))


def _hub_files(hub) -> dict:
    return hub.repos["org/c"]["branches"]["main"]


def test_pushed_is_recorded_and_a_relaunch_uploads_the_rest_in_step_order(tmp_path, loopback_hub) -> None:
    """hunt F F1: an upload cut off by a kill or a preemption was never redone (what had been uploaded lived in
    memory only). A checkpoint's upload is recorded in it (PUSHED, never uploaded) once its commit landed; a relaunch
    submits every complete checkpoint not recorded for its repo and revision, oldest first; pruning keeps those."""
    from open_sft.export.hub import CHECKPOINT_PUSHED, checkpoint_pushed

    root = tmp_path / "checkpoints"
    _publish_steps(root, (2, 4, 6))
    first = _uploader()
    first.submit(root / "step_2")
    assert first.close(timeout=60) == []
    assert checkpoint_pushed(root / "step_2", "org/c", "main").startswith(loopback_hub.url)
    assert "checkpoints/step_2/COMPLETE" in _hub_files(loopback_hub)
    assert not any(path.endswith(CHECKPOINT_PUSHED) for path in _hub_files(loopback_hub))
    relaunch = _uploader()  # the run was killed before step_4's and step_6's uploads
    assert relaunch.unpushed(root) == {root / "step_4", root / "step_6"}
    assert prune(root, 1, relaunch.unpushed(root)) == [root / "step_2"]  # uploaded: pruned; step_4 kept
    assert relaunch.resubmit(root) == [root / "step_4", root / "step_6"]
    assert relaunch.close(timeout=60) == []
    commits = [path for name, path, status in loopback_hub.log if name == "commit" and status == 200]
    assert len(commits) == 3
    assert [json.loads(_hub_files(loopback_hub)[f"checkpoints/step_{s}/COMPLETE"])["step"] for s in (4, 6)] == [4, 6]
    assert relaunch.unpushed(root) == set() and _uploader().resubmit(root) == []
    other = _uploader("v2")  # recorded per repo and revision: another branch gets them all
    assert other.resubmit(root) == [root / "step_4", root / "step_6"]
    other.close(timeout=60)


def test_a_relaunch_uploads_a_cut_off_checkpoint_before_pruning_it(tmp_path, loopback_hub, caplog) -> None:
    """hunt F F1 (one process, kill -9 during step_2's upload, --keep_last_n_checkpoints 1): the relaunch resuming
    step_4 deleted step_2, never uploaded. Now it submits step_2 and step_4 and keeps them until each is uploaded."""
    import logging

    from open_sft.training.checkpoint import ResumePoint

    root = tmp_path / "checkpoints"
    _publish_steps(root, (2, 4))
    checkpointer = _checkpointer(tmp_path, keep=1)
    checkpointer.uploader = _uploader()
    loopback_hub.always["commit"] = "404"  # this launch's uploads fail (not refused: 401/403): kept on disk
    try:
        with caplog.at_level(logging.INFO):
            checkpointer.restore(ResumePoint(root / "step_4", {"step": 4}))
            assert checkpointer.finish_uploads() is False
    finally:
        loopback_hub.always.clear()
    assert sorted(p.name for p in root.iterdir()) == ["step_2", "step_4"]
    assert "2 complete checkpoint(s) not recorded as uploaded to org/c (main): uploading them first: step_2, " \
           "step_4" in caplog.text and "kept on disk (never pruned) until it is uploaded" in caplog.text
    checkpointer = _checkpointer(tmp_path, keep=1)  # the next relaunch: uploaded, then pruned
    checkpointer.uploader = _uploader()
    checkpointer.restore(ResumePoint(root / "step_4", {"step": 4}))
    assert checkpointer.finish_uploads() is True
    assert sorted(p.name for p in root.iterdir()) == ["step_4"]
    assert {f"checkpoints/step_{s}/COMPLETE" for s in (2, 4)} <= set(_hub_files(loopback_hub))


def test_a_stop_waits_briefly_for_the_uploads_after_releasing_the_peers(tmp_path, loopback_hub, monkeypatch) -> None:
    """hunt F F2: on a stop, rank 0 waited up to 900 s for its uploads while its lifeline still watched the other
    ranks, which had exited: it died with exit 4, 'rank 1 is gone ... without writing a checkpoint'. The peers are
    released first and the wait is STOP_WAIT_S; what is left is the relaunch's."""
    from open_sft.export import hub_checkpoints
    from open_sft.training import checkpointer as checkpointing
    from open_sft.training.preemption import Preempted

    assert hub_checkpoints.STOP_WAIT_S <= 10  # inside docker stop's grace, let alone torchrun's and SLURM's 30 s
    root = tmp_path / "checkpoints"
    _publish_steps(root, (2,))
    events: list[str] = []
    monkeypatch.setattr(checkpointing.lifeline, "release", lambda: events.append("release"))
    checkpointer = _checkpointer(tmp_path, keep=1)
    checkpointer.stop = SimpleNamespace(uninstall=lambda: None)
    checkpointer.accelerator.end_training = lambda: None
    checkpointer.preempted_at = 2
    checkpointer.uploader = _uploader()
    checkpointer.uploader.stop_wait_s = 0.5
    close = checkpointer.uploader.close
    checkpointer.uploader.close = lambda timeout=None: (events.append(("wait", timeout)), close(timeout))[1]
    loopback_hub.hang_seconds, loopback_hub.always["preupload"] = 4.0, "hang"
    checkpointer.uploader.submit(root / "step_2")
    with pytest.raises(Preempted, match="stopped on a signal after step 2"):
        checkpointer.raise_if_preempted(metrics=None)
    assert events == ["release", ("wait", 0.5)]  # the stop's bound, not the end's 900 s (no wall clock asserted)
    assert (root / "step_2").is_dir() and not (root / "step_2" / "PUSHED").exists()  # still uploading: kept


def test_a_stop_while_the_end_waits_for_uploads_exits_75_and_the_relaunch_uploads_them(tmp_path, loopback_hub,
                                                                                      monkeypatch, capsys) -> None:
    """hunt F F3: a SIGTERM while the end of the run waited for its checkpoint uploads (up to 900 s) was held like
    one during the export, and the export's push then started anyway, past a scheduler's grace (SIGKILLed, no 75).
    Now the run is complete first (RUN_COMPLETE notes the uploads left), the stop exits 75, and the same command
    uploads the checkpoints and the export without training; a stop held during the export skips the push too."""
    import os
    import signal
    import threading

    from open_sft import run
    from open_sft.config.parse import parse_config
    from open_sft.export import hub
    from open_sft.export.hub_checkpoints import CheckpointUploader, end_of_run
    from open_sft.training import completion
    from open_sft.training.preemption import Preempted, stop_outside_training
    from unit.export.test_hub_push import _completed_run

    out, argv = _completed_run(tmp_path, monkeypatch)
    argv = argv + ["--push_checkpoints", "--keep_last_n_checkpoints", "1"]
    config = parse_config(argv)
    _publish_steps(out / "checkpoints", (2, 4))
    completion.mark_complete(out, 4, 1.0, config, uploads_left=True)
    checkpointer = _checkpointer(out, keep=1)
    checkpointer.uploader = CheckpointUploader(config.hub)
    # the stopped launch's uploader goes on in this process (a real launch exits 75): a request of its own that is
    # left unanswered ends in seconds and is not retried, instead of keeping its thread for minutes into later tests
    monkeypatch.setenv("OPEN_SFT_HUB_RETRIES", "1")
    monkeypatch.setenv("OPEN_SFT_HUB_TIMEOUT_S", "5")
    loopback_hub.hang_seconds, loopback_hub.always["preupload"] = 3.0, "hang"
    checkpointer.uploader.resubmit(out / "checkpoints")
    restore = stop_outside_training()  # as run.main has it
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
    try:
        with pytest.raises(Preempted, match=f"stopped by SIGTERM while the checkpoint uploads were awaited; the run is "
                                            f"complete \\(the export is in {out}\\): the same command uploads"):
            end_of_run(checkpointer, out, config, [], is_main=True)
    finally:
        restore()
        loopback_hub.always.clear()
    assert completion.read_marker(out)[completion.UPLOADS_KEY] is True
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_2", "step_4"]
    assert run.main(argv) == 0  # the requeue: nothing trained; the checkpoints, then the export uploaded
    assert f"already complete: {out}" in capsys.readouterr().out
    files = loopback_hub.repos["org/m"]["branches"]["main"]
    assert {"checkpoints/step_2/COMPLETE", "checkpoints/step_4/COMPLETE", "config.json"} <= set(files)
    record = completion.read_marker(out)
    assert completion.UPLOADS_KEY not in record and completion.pushed(record, "org/m", "main")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_4"]  # pruned once uploaded
    commits = loopback_hub.count("commit")
    assert run.main(argv) == 0 and loopback_hub.count("commit") == commits  # nothing left: nothing uploaded
    pushes = []
    monkeypatch.setattr(hub, "push_folder", lambda *args, **kwargs: pushes.append(args))
    with pytest.raises(Preempted, match="stopped by SIGUSR1 after the last step"):  # noted during the export
        end_of_run(_checkpointer(out, keep=1), out, config, ["SIGUSR1"], is_main=True)
    assert pushes == []


def test_a_hub_that_refuses_the_token_is_said_once_and_the_checkpoints_are_pruned(tmp_path, loopback_hub,
                                                                                   caplog) -> None:
    """A token that cannot write to the repository (403; 401 alike): each checkpoint was tried, refused, warned about
    and kept on disk for good (measured: 8 checkpoints kept under --keep_last_n_checkpoints 1 in 8 steps, until the
    disk fills). The first refusal is one error naming the repository and the fix; the launch tries no more uploads
    and prunes as without --push_checkpoints; the checkpoints still on disk are left for the relaunch."""
    import logging
    import time

    root = tmp_path / "checkpoints"
    checkpointer = _checkpointer(tmp_path, keep=1)
    checkpointer.uploader = uploader = _uploader()
    loopback_hub.always["commit"] = "403"
    try:
        with caplog.at_level(logging.INFO):
            for step in (2, 4, 6):  # as Checkpointer.save: published, pruned, submitted
                _publish_steps(root, (step,))
                prune(root, 1, checkpointer._unpushed())  # what save prunes with
                uploader.submit(root / f"step_{step}")
                while uploader.pending():  # each upload settled before the next save prunes
                    time.sleep(0.05)
            assert checkpointer.finish_uploads() is False  # step_6 is not on the Hub: the relaunch uploads it
    finally:
        loopback_hub.always.clear()
    assert sorted(p.name for p in root.iterdir()) == ["step_6"]
    assert loopback_hub.count("commit") == 1  # step_4's and step_6's uploads were not tried
    refused = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(refused) == 1 and refused[0].startswith("the Hub refused the upload of checkpoint step_2 to org/c "
                                                       "(HfHubHTTPError: 403")
    assert "Fix: a token with write access to org/c" in refused[0] and TOKEN not in caplog.text
    # step_2 was pruned at the next save: the line named a retry command for a checkpoint gone moments later
    assert f"python -m open_sft push {root / 'step_2'}" not in refused[0]
    assert f"relaunch the command: it uploads every complete checkpoint still in {root} first" in refused[0]
    assert f"Or upload one that is still there (step_N) now with:\n  python -m open_sft push {root / 'step_N'} " \
        "--hub_model_id org/c" in refused[0]


def test_the_upload_only_relaunch_prunes_no_checkpoint_the_hub_refused(tmp_path, loopback_hub) -> None:
    """The relaunch of a completed run whose checkpoint uploads were left (RUN_COMPLETE's uploads left) with a token
    the Hub still refuses (403): it pruned as a refused training launch does and deleted step_2 and step_4 under
    --keep_last_n_checkpoints 1, never uploaded: the checkpoints it exists to upload. It writes no checkpoint, so it
    keeps every one not uploaded; the relaunch with a good token uploads the three, then prunes."""
    from open_sft.export.hub_checkpoints import upload_left

    root = tmp_path / "checkpoints"
    _publish_steps(root, (2, 4, 6))
    hub = SimpleNamespace(hub_model_id="org/c", hub_revision="main", hub_private=True, hub_token=TOKEN)
    config = SimpleNamespace(hub=hub, checkpoint=SimpleNamespace(keep_last_n_checkpoints=1,
                                                                 clean_checkpoints_at_end=False))
    loopback_hub.always["commit"] = "403"
    try:
        assert upload_left(tmp_path, config) is False
    finally:
        loopback_hub.always.clear()
    assert sorted(p.name for p in root.iterdir()) == ["step_2", "step_4", "step_6"]
    assert upload_left(tmp_path, config) is True  # a token that can write: the three go up, then pruning
    assert sorted(p.name for p in root.iterdir()) == ["step_6"]
    assert {f"checkpoints/step_{s}/COMPLETE" for s in (2, 4, 6)} <= set(_hub_files(loopback_hub))
