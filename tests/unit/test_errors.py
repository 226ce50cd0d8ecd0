"""Our closing message as torch elastic's error file: torchrun's summary reads it back as the root cause (the real
2-rank launch is tests/integration/test_input_errors.py)."""

from __future__ import annotations

import json

import pytest

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from open_sft.errors import ERROR_FILE_ENV, record_exit_code, report_to_launcher


def test_the_launchers_summary_shows_our_message_as_the_root_cause(tmp_path, monkeypatch) -> None:
    message = "error: invalid configuration (2 problem(s)):\n  - --learning_rate must be positive, got -1.0\n  - x"
    monkeypatch.setenv(ERROR_FILE_ENV, str(tmp_path / "error.json"))
    report_to_launcher(message)
    assert json.loads((tmp_path / "error.json").read_text())["message"]["message"] == message
    failure = ProcessFailure(local_rank=0, pid=123, exitcode=2, error_file=str(tmp_path / "error.json"))
    summary = ChildFailedError("finetune.py", {0: failure}).format_msg()
    root = summary[summary.index("Root Cause (first observed failure):"):]
    assert "exitcode  : 2 (pid: 123)" in root
    assert "traceback : error: invalid configuration (2 problem(s)):\n    - --learning_rate must be positive" in root


def test_without_a_launcher_nothing_is_written_and_none_is_exit_0(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(ERROR_FILE_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    report_to_launcher("error: x")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv("OPEN_SFT_EXIT_CODE_DIR", str(tmp_path))
    assert record_exit_code(None) == 0 and (tmp_path / "rank0").read_text() == "0\n"


def test_a_launch_script_finds_the_message_beside_the_code(tmp_path, monkeypatch) -> None:
    """scripts/launch_multinode.sh prints rankR.message after torchrun's summary, so the run's own line ends it."""
    monkeypatch.delenv(ERROR_FILE_ENV, raising=False)
    monkeypatch.setenv("OPEN_SFT_EXIT_CODE_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    report_to_launcher("open_sft: stopped on a signal after step 3")
    assert record_exit_code(75) == 75
    assert (tmp_path / "rank1").read_text() == "75\n"
    assert (tmp_path / "rank1.message").read_text() == "open_sft: stopped on a signal after step 3\n"


def test_sigterm_while_the_entrypoint_imports_exits_75_with_a_line(capsys) -> None:
    """SIGTERM in finetune.py's first seconds (importing torch, before main's handlers) ended the process with 143
    and no word; a scheduler that requeues on 75 did not requeue. The handler is put back after."""
    import os
    import signal

    from open_sft.errors import stop_while_starting

    before = signal.getsignal(signal.SIGTERM)
    restore = stop_while_starting()
    try:
        with pytest.raises(SystemExit) as stopped:
            os.kill(os.getpid(), signal.SIGTERM)
    finally:
        restore()
    assert stopped.value.code == 75
    assert "stopped by SIGTERM while starting (importing)" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is before
