"""Which signals the launcher of `accelerate launch` (torchrun, torch elastic) handles, which open_sft's stop on a
signal relies on (open_sft.training.preemption, open_sft.distributed.lifeline, scripts/launch_multinode.sh).

open_sft sets and reads no TORCHELASTIC_SIGNALS_TO_HANDLE: it is what the launcher writes for itself, from torchrun's
--signals_to_handle, which `accelerate launch` does not pass, so it comes from PET_SIGNALS_TO_HANDLE or torchrun's
default, SIGTERM,SIGINT,SIGHUP,SIGQUIT. The launcher forwards those to the ranks and kills them 30 s later; SIGUSR1,
the one open_sft's stop takes that it does not handle, ends the launcher, and the ranks finish their stop without
it (lifeline.note_stop), or, under launch_multinode.sh, the launcher ignores it. Checked here in the launcher's own
code, stopped before it starts anything (no process launched)."""

from __future__ import annotations

import argparse
import os

import pytest
import torch.distributed.run as torchrun
from accelerate.utils.launch import _filter_args
from torch.distributed.launcher import api

from open_sft.training.preemption import SIGNALS


class _Started(Exception):
    """The launcher got past setting its environment: it would start the ranks now."""


def _launcher_signals(monkeypatch, environment: dict[str, str]) -> tuple[set[str], str]:
    """(the signals the launcher handles, the TORCHELASTIC_SIGNALS_TO_HANDLE it leaves its ranks) with `environment`:
    torchrun's arguments as accelerate's _run_torchrun makes them (its own options filtered through torchrun's
    parser, the others torchrun's defaults or PET_* variables)."""
    for name in ("PET_SIGNALS_TO_HANDLE", "TORCHELASTIC_SIGNALS_TO_HANDLE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", environment.get("TORCHELASTIC_SIGNALS_TO_HANDLE", ""))
    accelerate_args = argparse.Namespace(nproc_per_node=1, master_addr="127.0.0.1", master_port=29500)
    args = _filter_args(accelerate_args, torchrun.get_args_parser(), ["--training_script", "finetune.py"])
    config, command, command_args = torchrun.config_from_args(args)

    def started(*args, **kwargs):
        raise _Started

    monkeypatch.setattr(api, "WorkerSpec", started)
    with pytest.raises(_Started):
        api.launch_agent(config, command, command_args)
    return set(config.signals_to_handle.split(",")), os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"]


def test_the_launcher_handles_sigterm_and_sigint_and_dies_of_sigusr1(monkeypatch) -> None:
    handled, written = _launcher_signals(monkeypatch, {})
    assert handled == {"SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"} and written == "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    assert {sig.name for sig in SIGNALS} - handled == {"SIGUSR1"}  # lifeline.note_stop's case


def test_torchelastic_signals_to_handle_is_the_launchers_output_not_an_input(monkeypatch) -> None:
    """Set by hand (open_sft's preemption docstring said SIGUSR1 reached the launcher only if listed there) it is
    replaced: the launcher still dies of SIGUSR1. PET_SIGNALS_TO_HANDLE (torchrun's --signals_to_handle) is what
    changes the launcher's list."""
    handled, written = _launcher_signals(monkeypatch, {"TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGUSR1"})
    assert "SIGUSR1" not in handled and written == "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    handled, written = _launcher_signals(monkeypatch, {"PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGUSR1"})
    assert handled == {"SIGTERM", "SIGINT", "SIGUSR1"} and written == "SIGTERM,SIGINT,SIGUSR1"
