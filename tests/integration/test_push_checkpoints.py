"""--push_checkpoints: every complete checkpoint reaches the Hub (one commit each, COMPLETE included) in
the background, an injected 500 is retried, pruning never deletes a checkpoint whose upload is pending,
a failed upload warns with a retry command that works and never stops training, no token anywhere.

(Its fast in-process tests are in tests/unit/export/test_push_checkpoints.py.)
"""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT, child_env
from integration.test_checkpoint import TOKEN, complete_steps, finetune_args, hub, run_layout  # noqa: F401 (hub: fixture)


REPO = "org/ckpts"


def test_push_checkpoints_uploads_each_checkpoint_and_retries(tiny_model_dir, tmp_path, hub) -> None:
    out = tmp_path / "run"
    hub.faults = {"commit": ["500"]}  # the first commit is step_2's upload
    args = finetune_args(tiny_model_dir, out, "single", "--max_train_steps", "4", "--keep_last_n_checkpoints", "1",
                         "--push_to_hub", "--hub_model_id", REPO, "--push_checkpoints")
    result = run_layout("single", args,
                        check=False, HF_HUB_OFFLINE="0", HF_ENDPOINT=hub.url, HF_TOKEN=TOKEN,
                        OPEN_SFT_HUB_RETRIES="3", OPEN_SFT_HUB_BACKOFF_S="0.1")
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-4000:]
    commits = [status for name, _, status in hub.log if name == "commit"]
    assert commits == [500, 200, 200, 200]  # step_2 (refused once, retried), step_4, the export

    files = hub.repos[REPO]["branches"]["main"]
    for step in (2, 4):
        prefix = f"checkpoints/step_{step}/"
        uploaded = {path[len(prefix):]: data for path, data in files.items() if path.startswith(prefix)}
        manifest = json.loads(uploaded["COMPLETE"])
        assert manifest["step"] == step
        assert set(uploaded) == set(manifest["files"]) | {"COMPLETE"}
        assert {name: len(uploaded[name]) for name in manifest["files"]} == manifest["files"]
        assert {"trainer_state.json", "model.safetensors", "optimizer.bin"} <= set(uploaded)
        assert f"uploaded checkpoint step_{step} to" in log
    assert complete_steps(out) == [4]  # --keep_last_n_checkpoints 1
    newest = out / "checkpoints" / "step_4"
    assert all(files[f"checkpoints/step_4/{p.relative_to(newest)}"] == p.read_bytes()
               for p in newest.rglob("*") if p.is_file() and p.name != "PUSHED")
    record = json.loads((newest / "PUSHED").read_text())  # the upload, recorded once its commit landed; not uploaded
    assert [(u["hub_model_id"], u["hub_revision"]) for u in record["pushed"]] == [(REPO, "main")]
    assert "checkpoints/step_4/PUSHED" not in files
    assert "config.json" in files and "README.md" in files  # the final export still goes up
    assert TOKEN not in log
    assert all(TOKEN.encode() not in p.read_bytes() for p in out.rglob("*") if p.is_file())


UPLOAD_FAILS = """
import logging, sys, types
from pathlib import Path
from open_sft.export.hub_checkpoints import CheckpointUploader
logging.basicConfig(level=logging.INFO, stream=sys.stdout)
uploader = CheckpointUploader(types.SimpleNamespace(hub_model_id="org/fails", hub_revision="ckpts", hub_private=True,
                                                    hub_token=None))
uploader.submit(Path(sys.argv[1]))
uploader.close(timeout=60)
print("failed:", [p.name for p in uploader.failed])
"""


def test_failed_checkpoint_upload_warns_with_a_retry_command_that_works(tmp_path, hub) -> None:
    checkpoint = tmp_path / "checkpoints" / "step_3"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text('{"step": 3}')
    (checkpoint / "COMPLETE").write_text(json.dumps({"step": 3, "files": {"trainer_state.json": 11}}))
    env = child_env(HF_HUB_OFFLINE="0", HF_ENDPOINT=hub.url, HF_TOKEN=TOKEN, OPEN_SFT_HUB_RETRIES="2",
                    OPEN_SFT_HUB_BACKOFF_S="0.1")
    hub.always["commit"] = "404"  # failed, not refused (401/403: the refusal's line names no one checkpoint)
    try:
        failed = subprocess.run([sys.executable, "-c", UPLOAD_FAILS, str(checkpoint)], cwd=ROOT, env=env,
                                capture_output=True, text=True, timeout=60)
    finally:
        hub.always.clear()
    log = failed.stdout + failed.stderr
    assert failed.returncode == 0 and "failed: ['step_3']" in failed.stdout, log[-3000:]
    command = f"python -m open_sft push {checkpoint} --hub_model_id org/fails --hub_revision ckpts --hub_private"
    assert "upload of checkpoint" in log and command in log and TOKEN not in log
    retried = subprocess.run([sys.executable, *command.split()[1:]], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=60)
    assert retried.returncode == 0, retried.stderr[-3000:]
    files = hub.repos["org/fails"]["branches"]["ckpts"]
    assert files["checkpoints/step_3/COMPLETE"] == (checkpoint / "COMPLETE").read_bytes()
    assert files["checkpoints/step_3/trainer_state.json"] == b'{"step": 3}'
