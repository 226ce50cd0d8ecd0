"""--push_checkpoints: every complete checkpoint reaches the Hub (one commit each, COMPLETE included) in
the background, an injected 500 is retried, pruning never deletes a checkpoint whose upload is pending,
a failed upload warns with a retry command that works and never stops training, no token anywhere.

The tests of this subject that launch real processes are in tests/integration/test_push_checkpoints.py.
"""

from __future__ import annotations

import json

from open_sft.training.checkpoint import prune


def test_prune_skips_checkpoints_whose_upload_is_pending(tmp_path) -> None:
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        (root / f"step_{step}").mkdir(parents=True)
        (root / f"step_{step}" / "trainer_state.json").write_text("{}")
        (root / f"step_{step}" / "COMPLETE").write_text(json.dumps({"files": {"trainer_state.json": 2}}))
    assert prune(root, 1, busy={root / "step_2"}) == [root / "step_4"]
    assert sorted(p.name for p in root.iterdir()) == ["step_2", "step_6"]
    assert prune(root, 1) == [root / "step_2"]
