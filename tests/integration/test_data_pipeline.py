"""Data pipeline: built-in templates' labels, formats, bad-row handling, mixer arithmetic, text blocks.

(Its fast in-process tests are in tests/unit/data/test_data_pipeline.py.)
"""

from __future__ import annotations



def test_dry_run_prints_report_and_marked_examples(tiny_model_dir, tmp_path) -> None:
    """In a subprocess: the dry run's probe sets up accelerate's process-wide state."""
    import subprocess

    from conftest import ROOT, SAMPLE, child_env, launch_command

    cache = tmp_path / "cache"
    result = subprocess.run(launch_command(1, None) + [
        "--model_name_or_path", str(tiny_model_dir), "--dataset_mixer_list", str(SAMPLE), "0.05",
        "--output_dir", str(tmp_path / "out"), "--dry_run"], cwd=ROOT, env=child_env(OPEN_SFT_CACHE=str(cache)),
        capture_output=True, text=True, timeout=600)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert "data report" in out and "mixture" in out and "100" in out
    assert "memory estimate per rank:" in out and "time estimate:" in out
    assert "[[" in out and "]]" in out  # trained spans marked (not a terminal: brackets)
    # what the README says a dry run writes: nothing in --output_dir; the cache entry the run will use (and
    # its lock file), named in the log
    assert not (tmp_path / "out").exists()
    (entry,) = [p for p in cache.iterdir() if p.is_dir()]
    assert sorted(p.name for p in cache.iterdir()) == [entry.name, f"{entry.name}.lock"]
    assert (entry / "COMPLETE").is_file() and f"tokenized data built: {entry}" in out
