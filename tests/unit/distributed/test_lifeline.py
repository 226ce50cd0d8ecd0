"""Which processes a rank follows, and how it notices a peer that is gone (real processes: `sleep`)."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from open_sft.distributed import lifeline
from open_sft.distributed.lifeline import Lifeline, process_start, started_by_launcher


def test_a_rank_follows_its_parent_only_when_a_launcher_started_it() -> None:
    assert started_by_launcher({"TORCHELASTIC_RUN_ID": "none", "RANK": "0"})  # torchrun, accelerate's multi-rank
    assert started_by_launcher({"ACCELERATE_MIXED_PRECISION": "no"})  # accelerate launch, one process
    assert started_by_launcher({"LOCAL_RANK": "3"})  # deepspeed's launcher, srun scripts
    assert not started_by_launcher({"HOME": "/root"})  # python finetune.py by hand, also under nohup
    assert not started_by_launcher({"LOCAL_RANK": "0", "OPEN_SFT_FOLLOW_LAUNCHER": "0"})
    assert started_by_launcher({"OPEN_SFT_FOLLOW_LAUNCHER": "1"})


def test_a_peer_that_exits_or_waits_unreaped_is_gone_and_named() -> None:
    peer = subprocess.Popen(["sleep", "60"])
    me = Lifeline(rank=0)
    me.follow = False
    me.watch_peers([lifeline.peer_entry(), (me.host, peer.pid, process_start(peer.pid)), ("other-host", 1, "7")])
    assert set(me.peers) == {1}  # a peer on another host is the process-group timeout's
    assert me.gone() is None
    peer.send_signal(signal.SIGKILL)
    time.sleep(0.2)  # not reaped yet: a zombie is not a live peer
    assert me.gone() == f"rank 1 (pid {peer.pid} on {me.host}) is gone"
    peer.wait()
    assert me.gone() == f"rank 1 (pid {peer.pid} on {me.host}) is gone"
    me.release_peers()  # the run's last collective is behind it: peers may finish first
    assert me.gone() is None


def test_a_reused_pid_is_not_the_peer() -> None:
    me = Lifeline(rank=1)
    me.follow = False
    me.watch_peers([(me.host, os.getpid(), "0"), lifeline.peer_entry()])  # rank 0's pid, another start time
    assert me.gone() == f"rank 0 (pid {os.getpid()} on {me.host}) is gone"


def test_process_start_of_a_missing_process() -> None:
    assert process_start(os.getpid()) is not None
    assert process_start(2 ** 22 + 1) is None


def test_a_rank_stopping_on_a_signal_outlives_its_launcher_but_not_its_peers(capfd) -> None:
    """SIGUSR1 to every process (the launcher too: torchrun dies of it) left the ranks without their checkpoint
    (exit 4): a rank carrying out a stop writes its checkpoint first, while its peers are still watched."""
    peer = subprocess.Popen(["sleep", "60"])
    me = Lifeline(rank=0)
    me.follow, me.parent = True, os.getppid() + 1  # the launcher that started this rank is gone
    me.watch_peers([lifeline.peer_entry(), (me.host, peer.pid, process_start(peer.pid))])
    assert me.gone() == f"its launcher (pid {me.parent}) is gone"
    me.note_stop("SIGUSR1")
    assert me.gone() is None
    assert "this rank got SIGUSR1 and finishes its stop: a checkpoint after the current step, then exit 75" \
        in capfd.readouterr().err
    peer.kill()
    peer.wait()
    assert me.gone() == f"rank 1 (pid {peer.pid} on {me.host}) is gone"


def test_a_failed_collective_names_the_peer_that_was_still_exiting(monkeypatch) -> None:
    """Rank 0 stopped (SIGTERM while loading, exit 75) and closed its connections as it exited: rank 1's collective
    failed while rank 0 still lived, and rank 1 printed gloo's traceback. The peer is asked after for a moment."""
    peer = subprocess.Popen(["sleep", "0.5"])  # still alive when the failure is explained, gone 0.5 s later
    me = Lifeline(rank=1)
    me.follow = False
    me.watch_peers([(me.host, peer.pid, process_start(peer.pid)), lifeline.peer_entry()])
    stopped: list[str] = []
    monkeypatch.setattr(me, "exit_lost", stopped.append)
    monkeypatch.setattr(lifeline, "_installed", me)
    lifeline.explain_failure(RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                                          "[127.0.0.1]:15263: Connection reset by peer"))  # as torch 2.13 raises it
    assert stopped == [f"rank 0 (pid {peer.pid} on {me.host}) is gone"]
    peer.wait()


def test_only_a_failed_collective_waits_for_a_peer_the_other_errors_are_checked_once(monkeypatch) -> None:
    """explain_failure waited up to 2 s after any exception: every crash cost 2 s, and a peer that exited meanwhile
    for its own reasons replaced this rank's real traceback with "rank 0 ... is gone (exit 4)". Here the peer is
    gone from the second look on: only a collective that failed on a connection looks again."""
    import torch.distributed as dist

    me = Lifeline(rank=1)
    me.follow, me.peers = False, {0: (7, "1")}
    looks: list[int] = []

    def gone_from_the_second_look() -> str | None:
        looks.append(1)
        return "rank 0 (pid 7 on host) is gone" if len(looks) > 1 else None

    stopped: list[str] = []
    monkeypatch.setattr(me, "gone", gone_from_the_second_look)
    monkeypatch.setattr(me, "exit_lost", stopped.append)
    monkeypatch.setattr(lifeline, "_installed", me)
    for error in (ValueError("a bug of this rank"), RuntimeError("CUDA out of memory"), KeyError("labels")):
        looks.clear()
        me.peers = {0: (7, "1")}  # each explain_failure releases them
        lifeline.explain_failure(error)
        assert (stopped, len(looks)) == ([], 1)  # the traceback propagates
    wrapped = RuntimeError("step failed")
    wrapped.__cause__ = RuntimeError("Connection closed by peer [127.0.0.1]:29500")
    for error in (dist.DistBackendError("NCCL error: remote process exited"), wrapped):
        looks.clear()
        me.peers = {0: (7, "1")}
        lifeline.explain_failure(error)
        assert stopped.pop() == "rank 0 (pid 7 on host) is gone"
    assert not lifeline.lost_connection(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


def test_the_lost_line_names_the_step_the_relaunch_resumes_from(tmp_path) -> None:
    """A SIGKILLed rank: the launch ended on torchrun's summary and the survivors' line, which said only "the last
    complete checkpoint"; it names the step now, as resume picks it: a checkpoint still being written (no COMPLETE)
    and a damaged one (COMPLETE, its safetensors unreadable: resume moves it aside) are not it."""
    from open_sft.training.checkpoint import publish
    from open_sft.training.resume import relaunch_point
    from unit.training.test_checkpoint import _publish_steps

    me = Lifeline(rank=0)
    why = "rank 1 (pid 7 on host) is gone"
    assert me.lost_message(why).endswith("Relaunch the same command: under --resume_from_checkpoint auto (the "
                                         "default) it resumes from the last complete checkpoint in --output_dir\n")
    me.output_dir, me._point = tmp_path, relaunch_point
    root = tmp_path / "checkpoints"
    assert f"it resumes from step 0 (no complete checkpoint in {root} yet)" in me.lost_message(why)
    _publish_steps(root, (2, 4))
    (root / "step_6.tmp").mkdir()
    (root / "step_6.tmp" / "model.safetensors").write_bytes(b"\0" * 64)  # zeroed by a crash, size as listed
    publish(root / "step_6.tmp", root / "step_6", 6)
    (root / "step_8").mkdir()
    assert me.lost_message(why) == (f"error: rank 0: {why}; stopping this rank without writing a checkpoint (exit 4). "
                                    f"Relaunch the same command: it resumes from step 4 ({root / 'step_4'})\n")


def test_the_lost_line_says_where_a_relaunch_starts_under_none_or_a_named_checkpoint(tmp_path, monkeypatch) -> None:
    """"Relaunch the same command: it resumes from step N" was said whatever --resume_from_checkpoint was: under
    none (or --overwrite_output_dir, which applies none) the relaunch starts over, and a named checkpoint resumes
    from itself, or from this run's newest checkpoint once the run wrote one after it (a requeue)."""
    from open_sft.training.resume import relaunch_point
    from unit.training.test_checkpoint import _publish_steps

    me = Lifeline(rank=1)
    why = "its launcher (pid 7) is gone"
    _publish_steps(tmp_path / "checkpoints", (2, 4))
    monkeypatch.setattr(lifeline, "_installed", me)
    lifeline.resume_from(tmp_path, "none", relaunch_point)
    assert me.lost_message(why).endswith(
        "A relaunch of the same command starts over from step 0 (--resume_from_checkpoint none or "
        "--overwrite_output_dir); to resume from the last complete checkpoint instead, relaunch with "
        "--resume_from_checkpoint auto and without --overwrite_output_dir\n")
    named = tmp_path / "other_run" / "checkpoints" / "step_3"
    _publish_steps(named.parent, (3,))
    lifeline.resume_from(tmp_path, str(named), relaunch_point)
    assert me.lost_message(why).endswith(f"Relaunch the same command: it resumes from {named}\n")
    _publish_steps(tmp_path / "checkpoints", (5,), timeline=str(named.resolve()))  # this run's, after the named one
    assert me.lost_message(why).endswith(f"it resumes from {tmp_path / 'checkpoints' / 'step_5'}\n")
