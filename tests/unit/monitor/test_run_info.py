"""What run.json records of the code that ran: open_sft's own git revision."""

from __future__ import annotations

import subprocess
from pathlib import Path

from conftest import ROOT
from open_sft.monitor import run_info


def test_the_git_revision_is_open_sfts_own(tmp_path, monkeypatch) -> None:
    """run.json's git_revision (the model card's "open_sft git revision") is the commit of the checkout open_sft
    runs from. A copy installed in a project's .venv inside the project's repository recorded the project's commit:
    git, run in site-packages, answers for the repository around it. Here git answers as it does there."""
    project = tmp_path / "project"
    site = project / ".venv" / "lib" / "python3.12" / "site-packages"
    site.mkdir(parents=True)
    asked = []

    def git(args, cwd, **kwargs):
        asked.append(Path(cwd))
        if not Path(cwd).is_relative_to(project):
            return subprocess.CompletedProcess(args, 128, stdout="", stderr="fatal: not a git repository")
        return subprocess.CompletedProcess(args, 0, stdout=f"{project}\n4b1d2c3\n", stderr="")

    monkeypatch.setattr(run_info.subprocess, "run", git)
    assert run_info.git_revision(site) is None
    assert run_info.git_revision(project) == "4b1d2c3"
    assert run_info.git_revision(tmp_path) is None
    assert asked == [site, project, tmp_path]
    assert run_info.CHECKOUT == ROOT  # this checkout's root, where its git answers for itself
