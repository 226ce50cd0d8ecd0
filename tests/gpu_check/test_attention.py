"""The attention probe: no candidate for packed rows lets one example see another (bit for bit), and at least
one is as exact as the fp32 per-example result; the fastest such one is named in the report."""

from __future__ import annotations

import pytest

from tests.gpu_check import attention
from tests.gpu_check.measure import record, short, smoke

REL_ERROR = 2e-2  # a candidate's output against the fp32 per-example result, relative (bf16 on GPUs)


@pytest.fixture(scope="module")
def figures() -> dict:
    measured = attention.measure(smoke())
    correct = {name: r for name, r in _candidates(measured).items()
               if r["cross_example_change"] == 0.0 and r["rel_error"] < REL_ERROR}
    measured["fastest_correct"] = min(correct, key=lambda n: correct[n]["ms_forward_backward"]) if correct else None
    measured["tolerance"] = (f"relative error < {short(REL_ERROR)} of the fp32 per-example result; other "
                             f"examples' outputs unchanged")
    return record(measured)


def _candidates(figures: dict) -> dict:
    """The candidates that ran here (one this torch cannot run is reported with its error, not held to anything)."""
    return {name: r for name, r in figures.items() if isinstance(r, dict) and "ms_forward_backward" in r}


def test_attention_no_candidate_lets_one_example_see_another(figures) -> None:
    leaks = {name: r["cross_example_change"] for name, r in _candidates(figures).items()}
    assert leaks and all(change == 0.0 for change in leaks.values()), leaks


def test_attention_a_candidate_is_exact_and_the_fastest_is_named(figures) -> None:
    assert figures["fastest_correct"] is not None, {n: r["rel_error"] for n, r in _candidates(figures).items()}
