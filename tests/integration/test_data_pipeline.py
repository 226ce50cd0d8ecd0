"""Data pipeline: built-in templates' labels, formats, bad-row handling, mixer arithmetic, text blocks.

(Its fast in-process tests are in tests/unit/data/test_data_pipeline.py.)
"""

from __future__ import annotations



def test_dry_run_prints_report_and_marked_examples(tiny_model_dir, tmp_path) -> None:
    """In a subprocess: the dry run's probe sets up accelerate's process-wide state."""
    from conftest import SAMPLE, run_finetune

    out = run_finetune(["--model_name_or_path", str(tiny_model_dir), "--dataset_mixer_list", str(SAMPLE), "0.05",
                        "--output_dir", str(tmp_path / "out"), "--dry_run"]).stdout
    assert "data report" in out and "mixture" in out and "100" in out
    assert "memory estimate per rank:" in out and "time estimate:" in out
    assert "[[" in out and "]]" in out  # trained spans marked (not a terminal: brackets)
    assert not (tmp_path / "out").exists()
