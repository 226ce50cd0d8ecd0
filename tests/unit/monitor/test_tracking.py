"""--report_to without --with_tracking: the trackers asked for are named in a warning, not silently dropped."""

from __future__ import annotations


def test_trackers_asked_for_without_with_tracking_are_named_in_a_warning() -> None:
    from open_sft.monitor.tracking import ignored_trackers

    warning = ignored_trackers(False, ["wandb"], frozenset({"report_to"}))
    assert warning and warning.startswith("--report_to wandb: no tracker is written without --with_tracking")
    assert "--report_to tensorboard wandb:" in ignored_trackers(False, "all", frozenset({"report_to"}))
    assert ignored_trackers(True, ["wandb"], frozenset({"report_to"})) is None  # written
    assert ignored_trackers(False, ["tensorboard"], frozenset()) is None  # the default, not asked for
    assert ignored_trackers(False, ["none"], frozenset({"report_to"})) is None
