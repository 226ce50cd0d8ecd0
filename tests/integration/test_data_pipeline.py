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


def test_render_workers_end_when_the_caller_has_its_own_sigterm_handler(tiny_model_dir, tmp_path) -> None:
    """A program with a SIGTERM handler of its own builds the data with two render workers: the pool's exit sends
    each worker SIGTERM, which ends it; the program's handler never runs in them (it did, inherited at the fork: the
    GPU check's handler, run in a worker, hung the suite; one that prints, a build). In a process of its own, so a
    hang fails here, not the suite."""
    import subprocess
    import sys

    from conftest import ROOT, SAMPLE

    ran = tmp_path / "handler_ran_in"
    script = f"""
import logging, os, signal
logging.basicConfig(level=logging.INFO)
from transformers import AutoTokenizer
from open_sft.config.args import DataArguments
from open_sft.data.prepare import prepare_data
def handler(signum, frame):
    with open({str(ran)!r}, "a") as f:
        f.write(str(os.getpid()) + "\\n")
signal.signal(signal.SIGTERM, handler)
tokenizer = AutoTokenizer.from_pretrained({str(tiny_model_dir)!r})
data = prepare_data(DataArguments(dataset_mixer_list=[{str(SAMPLE)!r}, "1.0"], dataset_skip_cache=True,
                                  preprocessing_num_workers=2), tokenizer, 0)
print("built", len(data), flush=True)
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and "built 2000" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
    assert "rendered, tokenized and checked 2000 rows in 2 process(es)" in done.stderr, done.stderr[-2000:]
    assert not ran.exists(), f"the program's SIGTERM handler ran in the render workers {ran.read_text().split()}"
