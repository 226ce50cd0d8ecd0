"""The GPU check: what `python scripts/gpu_check.py OUT_DIR` (or `python -m tests.gpu_check OUT_DIR` from the
repository root) runs on one GPU, and its CPU smoke mode that the suite runs.

- cli: the command line, the parts run side by side or alone, the report rewritten after every part
- parts: the correctness, feature and speed parts, each a function of the check's context
- context, models, runs, speed, report: the check's context, its models and data, finetune.py launches,
  the speed part (benchmark.py and profile_step.py), the JSON and Markdown report
- fused_ce, packed (+ packed_kernel: torch's varlen kernel itself), attention (+ measure): the probes'
  measurements; test_fused_ce.py, test_packed.py, test_attention.py hold them to their tolerances (pytest tests:
  the check runs each file, the suite too); stand_in: the varlen kernel's CPU stand-in (and a faulty one)
"""
