"""The measured activation bytes: what autograd saves for backward, parameters excluded, views counted once."""

from __future__ import annotations

import torch

from open_sft.monitor.activations import SavedActivations


def test_counts_saved_activations_not_parameters() -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(32, 48)
    meter = SavedActivations()
    x = torch.randn(10, 32)
    with meter.measure():
        out = torch.relu(layer(x))  # Linear saves its input (and its weight: a parameter), relu its output
    assert meter.peak_bytes == x.nbytes + out.nbytes
    with meter.measure():
        torch.relu(layer(torch.randn(5, 32)))  # a smaller forward leaves the peak where it was
    assert meter.peak_bytes == x.nbytes + out.nbytes
    with meter.measure():
        wide = torch.randn(20, 32)
        torch.relu(layer(wide[:, :]))  # a view of the input: its storage once
    assert meter.peak_bytes == 2 * (x.nbytes + out.nbytes)


def test_off_unless_asked(monkeypatch) -> None:
    monkeypatch.delenv("OPEN_SFT_RECORD_ACTIVATIONS", raising=False)
    assert SavedActivations.if_requested() is None
    monkeypatch.setenv("OPEN_SFT_RECORD_ACTIVATIONS", "1")
    assert isinstance(SavedActivations.if_requested(), SavedActivations)
