"""`open_sft push` says what is missing before it waits on the network: no token is an error at once, and a Hub
host name that does not resolve fails the first try instead of six with backoff (a minute of silence)."""

from __future__ import annotations

import socket

import httpx2
import pytest

from open_sft.export import hub


def test_no_token_is_an_error_before_any_network_wait(tmp_path, monkeypatch, capsys) -> None:
    from huggingface_hub import constants

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # the suite sets it; a user's shell need not
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no_token"))  # no stored login either
    monkeypatch.setenv("HF_ENDPOINT", "http://no-such-host.invalid")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text("{}")
    uploads = []  # no upload is tried (it would wait on the network): the token is checked first
    monkeypatch.setattr(hub, "push_folder", lambda *args, **kwargs: uploads.append(args))
    code = hub.main([str(tmp_path / "out"), "--hub_model_id", "org/model"])
    assert code == 2 and uploads == []
    assert capsys.readouterr().err.startswith("error: no Hugging Face token: pass --hub_token, set HF_TOKEN")
    (tmp_path / "no_token").write_text("hf_stored")  # a login's stored token is one
    assert hub.has_token(None) and hub.has_token("hf_given")


def test_the_directory_and_the_id_are_checked_before_the_token(tmp_path, monkeypatch, capsys) -> None:
    """`open_sft push /nonexist --hub_model_id "bad id"` said only 'no Hugging Face token'."""
    from huggingface_hub import constants

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no_token"))
    assert hub.main([str(tmp_path / "nonexist"), "--hub_model_id", "bad id"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / 'nonexist'}: no such directory; pass the --output_dir of a finished run")
    assert "\n  --hub_model_id 'bad id' is not a Hub repository id (" in err and "give NAME or ORG/NAME" in err
    assert "\n  no Hugging Face token" in err
    (tmp_path / "dataset").mkdir()
    monkeypatch.setenv("HF_TOKEN", "hf_given")
    assert hub.main([str(tmp_path / "dataset"), "--hub_model_id", "org/model"]) == 2
    assert capsys.readouterr().err == (f"error: {tmp_path / 'dataset'} has no exported model (config.json) and is not "
                                       "a complete checkpoint (COMPLETE); pass the --output_dir of a finished run or "
                                       "OUTPUT_DIR/checkpoints/step_N\n")


def test_hf_hub_offline_is_refused_before_the_upload(tmp_path, monkeypatch, capsys) -> None:
    """`HF_HUB_OFFLINE=1 open_sft push OUT --hub_model_id org/model` (the shell of an offline run, whose
    --push_to_hub finetune refuses pointing here) tried the upload, failed with exit 3 and printed this same
    command as the retry; it is refused at once, exit 2, saying to unset it."""
    monkeypatch.setenv("HF_TOKEN", "hf_given")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text("{}")
    uploads = []
    monkeypatch.setattr(hub, "push_folder", lambda *args, **kwargs: uploads.append(args))
    assert hub.main([str(tmp_path / "out"), "--hub_model_id", "org/model"]) == 2 and uploads == []
    assert capsys.readouterr().err == ("error: HF_HUB_OFFLINE is set, so nothing can be uploaded: unset it for this "
                                       "command (HF_HUB_OFFLINE= open_sft push ...)\n")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # read as huggingface_hub reads it: "0" is online
    monkeypatch.setattr(hub, "push_export", lambda *args: "https://hub/org/model")
    monkeypatch.setattr("open_sft.training.completion.mark_pushed", lambda *args: None)
    assert hub.main([str(tmp_path / "out"), "--hub_model_id", "org/model"]) == 0


def test_a_run_pushing_to_a_bad_hub_id_is_refused_with_the_flags(monkeypatch) -> None:
    from open_sft.config.parse import parse_config
    from open_sft.errors import ConfigError

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    with pytest.raises(ConfigError, match=r"--hub_model_id 'org/my model' is not a Hub repository id"):
        parse_config(["--model_name_or_path", "m", "--dataset_mixer_list", "a.jsonl", "1.0", "--push_to_hub",
                      "--hub_model_id", "org/my model"])


def test_a_host_name_that_does_not_resolve_is_not_retried() -> None:
    def unresolved() -> httpx2.ConnectError:
        try:
            try:
                raise socket.gaierror(-2, "Name or service not known")
            except socket.gaierror as cause:
                raise httpx2.ConnectError("[Errno -2] Name or service not known") from cause
        except httpx2.ConnectError as exc:
            return exc

    assert not hub.is_transient(unresolved()) and hub.is_transient(httpx2.ConnectError("refused"))
    calls, sleeps = [], []

    def call():
        calls.append(1)
        raise unresolved()

    with pytest.raises(httpx2.ConnectError):
        hub.with_retries("create repo", call, sleep=sleeps.append)
    assert calls == [1] and sleeps == []


TOKEN = "hf_TESTtoken_unit_1234"


@pytest.fixture
def loopback_hub(monkeypatch):
    """The loopback Hub (tests/hub_server.py) in this process, huggingface_hub pointed at it and online."""
    from huggingface_hub import constants
    from hub_server import FakeHub

    server = FakeHub(TOKEN).start()
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", server.url)
    yield server
    server.stop()


def _completed_run(tmp_path, monkeypatch) -> tuple:
    """A finished run's output dir with a small export and its completion record, and the run's command line
    (--push_to_hub to org/m)."""
    from open_sft.config.parse import parse_config
    from open_sft.training import completion

    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.chdir(tmp_path)  # d.jsonl: the command line's parse names a missing data file
    (tmp_path / "d.jsonl").write_text("{}\n")
    argv = ["--model_name_or_path", "m", "--dataset_mixer_list", "d.jsonl", "1.0", "--output_dir", str(out),
            "--push_to_hub", "--hub_model_id", "org/m", "--hub_token", TOKEN]
    config = parse_config(argv)  # as the run parsed it, before it wrote its export
    for name, text in {"config.json": "{}", "model.safetensors": "x" * 100, "README.md": "# m\n"}.items():
        (out / name).write_text(text)
    completion.mark_complete(out, 4, 1.0, config)
    return out, argv


def test_a_requeued_run_whose_upload_was_stopped_uploads_it_and_only_once(tmp_path, loopback_hub, monkeypatch,
                                                                          capsys) -> None:
    """SIGTERM during the --push_to_hub upload (a preempted job) exited 3 with 'upload failed: stopped by SIGTERM
    ... training from the newest complete checkpoint, then the export'; the requeued command then printed
    `already complete` and an `open_sft push` command, and exited 0 with nothing on the Hub. Now: exit 75 saying
    the export is complete, and the same command uploads it (training nothing), notes the upload in RUN_COMPLETE,
    and a further relaunch uploads nothing."""
    import json
    import os
    import signal

    from open_sft import run

    out, argv = _completed_run(tmp_path, monkeypatch)
    pushed = hub.push_folder

    def stopped(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # the handler run.main installs raises here
        return pushed(*args, **kwargs)

    monkeypatch.setattr(hub, "push_folder", stopped)
    assert run.main(argv) == 75
    err = capsys.readouterr().err
    assert f"stopped by SIGTERM during the upload to the Hub; the export in {out} is complete: the same command " \
           "uploads it (it does not train again)" in err and "python -m open_sft push" in err
    assert "upload to the Hub failed" not in err and "pushed" not in json.loads((out / "RUN_COMPLETE").read_text())
    assert loopback_hub.count("commit") == 0
    monkeypatch.setattr(hub, "push_folder", pushed)
    assert run.main(argv) == 0  # the requeue: nothing trained, the export uploaded
    said = capsys.readouterr().out
    assert f"already complete: {out}" in said and "not on the Hub at org/m (main) yet: uploading it" in said
    assert loopback_hub.count("commit") == 1
    assert set(loopback_hub.repos["org/m"]["branches"]["main"]) == {"config.json", "model.safetensors", "README.md"}
    record = json.loads((out / "RUN_COMPLETE").read_text())
    assert [(u["hub_model_id"], u["hub_revision"]) for u in record["pushed"]] == [("org/m", "main")]
    assert run.main(argv) == 0  # once uploaded, a relaunch says where and uploads nothing
    assert "its export was uploaded to " in capsys.readouterr().out and loopback_hub.count("commit") == 1
    # another revision is another upload
    assert run.main(argv + ["--hub_revision", "v2"]) == 0 and loopback_hub.count("commit") == 2


def test_a_tokenization_cache_inside_the_output_dir_is_not_uploaded(tmp_path, loopback_hub, caplog) -> None:
    """--dataset_local_cache_dir OUT/cache (or OPEN_SFT_CACHE there) put the tokenized training data, which may be
    private and is often larger than the model, into the upload of the export. It is left out, with a line."""
    import logging

    out = tmp_path / "out"
    key = "ab" * 32
    for name, text in {"config.json": "{}", "model.safetensors": "x" * 100, "README.md": "# m\n",
                       f"cache/{key}.lock": "", f"cache/{key}/data-00000-of-00001.arrow": "private rows",
                       f"cache/{key}/COMPLETE": "", "notes/a.lock": "a lock of another name is uploaded",
                       f"failed/{key}.partial/rows-0.arrow": "a failed build's rows: no lock left"}.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    with caplog.at_level(logging.INFO, logger="open_sft.export.hub"):
        hub.push_export(out, "org/m", token=TOKEN)
    assert set(loopback_hub.repos["org/m"]["branches"]["main"]) == {"config.json", "model.safetensors", "README.md",
                                                                     "notes/a.lock"}
    assert f"{out} holds a tokenization cache (cache): it is not uploaded" in caplog.text
    assert f"{out} holds a tokenization cache (failed): it is not uploaded" in caplog.text


def _full_export(directory, seed: int, max_shard_size: str = "1GB") -> dict:
    """A tiny Llama saved as an export (README.md, run.json beside it); returns its state dict."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(directory, max_shard_size=max_shard_size)
    (directory / "README.md").write_text(f"# seed {seed}\n")
    (directory / "run.json").write_text("{}")
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def _files(directory) -> set:
    return {p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file()}


def test_a_re_push_leaves_the_repo_holding_this_export_only(tmp_path, loopback_hub) -> None:
    """A re-push kept every file of the earlier push: a run re-done with another sharding left the first run's
    model.safetensors beside the new shards, and from_pretrained loaded the old model; a LoRA run of the same name
    left a full model's config.json and weights, and peft applied the new adapter to the old model. Now the export's
    kinds of file that this export lacks are deleted in its commit; the user's own files, .gitattributes and pushed
    checkpoints stay."""
    import torch
    import transformers

    first, second, lora = tmp_path / "first", tmp_path / "second", tmp_path / "lora"
    _full_export(first, seed=1)
    hub.push_export(first, "org/m", token=TOKEN)
    repo = loopback_hub.repos["org/m"]["branches"]["main"]
    kept = {".gitattributes": b"*.safetensors filter=lfs\n", "notes/eval.md": b"the user's own",
            "checkpoints/step_3/model.safetensors": b"a pushed checkpoint", "LICENSE": b"MIT"}
    repo.update(kept)
    weights = _full_export(second, seed=2, max_shard_size="12KB")
    assert {"model-00001-of-00003.safetensors", "model.safetensors.index.json"} <= _files(second)
    hub.push_export(second, "org/m", token=TOKEN)
    assert set(repo) == _files(second) | set(kept)
    for path, data in repo.items():  # the repo as a download of it would be
        (tmp_path / "repo" / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "repo" / path).write_bytes(data)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "repo").state_dict()
    assert loaded.keys() == weights.keys() and all(torch.equal(loaded[k], weights[k]) for k in weights)
    lora.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors", "README.md", "tokenizer.json"):
        (lora / name).write_text(name)
    (lora / "merged").mkdir()
    (lora / "merged" / "config.json").write_text("{}")
    hub.push_export(lora, "org/m", token=TOKEN)
    assert set(repo) == _files(lora) | set(kept)
    for path in ("checkpoints/step_3/model.safetensors", "notes/eval.md", ".gitattributes"):
        assert repo[path] == kept[path]


def test_w_and_bs_run_directory_is_not_uploaded_and_an_earlier_pushs_is_deleted(tmp_path, loopback_hub) -> None:
    """--report_to wandb writes W&B's run directory into --output_dir (the whole console log, the resolved config with
    local paths, the installed packages) and the run id: --push_to_hub uploaded them with the export (public under
    --no_hub_private), another offline-run-* folder each launch. They are left out, what an earlier push uploaded
    is deleted, and they are no part of the export a relaunch checks."""
    from open_sft.training.completion import export_files

    out = tmp_path / "out"
    export = {"config.json": "{}", "model.safetensors": "x" * 100, "README.md": "# m\n"}
    tracker = {"wandb/offline-run-20261206_1-abc/files/output.log": "the console log",
               "wandb/offline-run-20261206_1-abc/run-abc.wandb": "history", "wandb/debug.log": "debug",
               "wandb_run_id": "abc"}
    for name, text in {**export, **tracker}.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    hub.push_export(out, "org/m", token=TOKEN)
    repo = loopback_hub.repos["org/m"]["branches"]["main"]
    assert set(repo) == set(export)
    repo.update({"wandb/offline-run-20261205_9-old/files/output.log": b"an earlier push's", "wandb_run_id": b"old"})
    hub.push_export(out, "org/m", token=TOKEN)
    assert set(repo) == set(export)
    assert set(export_files(out)) == set(export)


def test_a_run_inside_the_pushed_one_is_not_uploaded(tmp_path, loopback_hub, caplog) -> None:
    """A day-two run `--model_name_or_path out --output_dir out/day2` (README allows it) was uploaded with out's
    export: its checkpoints (optimizer states), lock and completion record, as EXPORT_IGNORE's patterns are anchored
    at the top. A directory holding an open_sft run or export is left out, with a line; other folders go up."""
    import logging

    out = tmp_path / "out"
    for name in ("config.json", "model.safetensors", "README.md", "run.json", "RUN_COMPLETE", ".open_sft.lock",
                 "notes/plan.md", "checkpoints/step_2/run.json",
                 "day2/.open_sft.lock", "day2/run.json", "day2/RUN_COMPLETE", "day2/model.safetensors",
                 "day2/checkpoints/step_3/optimizer.bin", "day2/deeper/run.json",
                 "killed/.open_sft.lock",  # killed while loading: the lock is all it has
                 "evals/step_30/.open_sft_export.json", "evals/step_30/model.safetensors"):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(name)
    with caplog.at_level(logging.INFO, logger="open_sft.export.hub"):
        hub.push_export(out, "org/m", token=TOKEN)
    assert set(loopback_hub.repos["org/m"]["branches"]["main"]) == {"config.json", "model.safetensors", "README.md",
                                                                     "run.json", "notes/plan.md"}
    for inside in ("day2", "killed", "evals/step_30"):
        assert f"{out} holds another open_sft run or export ({inside}): it is not uploaded; push it on its own" \
            in caplog.text
    assert "(checkpoints/step_2)" not in caplog.text and "(day2/deeper)" not in caplog.text


def test_open_sft_push_notes_the_upload_so_a_relaunch_uploads_nothing(tmp_path, loopback_hub, monkeypatch,
                                                                      capsys) -> None:
    """`open_sft push`, the command a failed --push_to_hub prints, uploaded but did not note it in RUN_COMPLETE
    (the run's own push does): the next relaunch of the training command (a requeue) uploaded the export again."""
    import json

    from open_sft import run

    out, argv = _completed_run(tmp_path, monkeypatch)
    assert hub.main([str(out), "--hub_model_id", "org/m", "--hub_revision", "main", "--hub_token", TOKEN]) == 0
    url = capsys.readouterr().out.strip().splitlines()[-1]
    record = json.loads((out / "RUN_COMPLETE").read_text())
    assert [(u["hub_model_id"], u["hub_revision"], u["url"]) for u in record["pushed"]] == [("org/m", "main", url)]
    assert loopback_hub.count("commit") == 1
    assert run.main(argv) == 0  # the requeued training command: says where, uploads nothing
    assert f"its export was uploaded to {url}" in capsys.readouterr().out and loopback_hub.count("commit") == 1
    exported = tmp_path / "exported"  # an `open_sft export` directory has no completion record: none is made
    exported.mkdir()
    (exported / "config.json").write_text("{}")
    assert hub.main([str(exported), "--hub_model_id", "org/e", "--hub_token", TOKEN]) == 0
    assert not (exported / "RUN_COMPLETE").exists()


def test_the_upload_is_retried_by_huggingface_hub_alone_and_each_retry_said_once(tmp_path, loopback_hub,
                                                                                 monkeypatch) -> None:
    """open_sft retried the whole upload OPEN_SFT_HUB_RETRIES times around huggingface_hub's own retries of each
    request: with 3 and a commit that always fails, 18 commit attempts and 85 s; with the defaults about 36 and
    200 s. And each of huggingface_hub's retry lines came twice (its own handler and the root's). Now the upload's
    requests are retried by huggingface_hub only (1 + 5 tries, waits 1, 2, 4, 8, 8 s), and each line comes once,
    through the root logger; creating the repo is still retried by open_sft (huggingface_hub sends it once)."""
    import io
    import logging
    import types

    from huggingface_hub.utils import _http

    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")
    monkeypatch.setenv("OPEN_SFT_HUB_RETRIES", "3")
    monkeypatch.setenv("OPEN_SFT_HUB_BACKOFF_S", "0.5")
    sleeps = []  # huggingface_hub's backoff waits (its commits run on worker threads), recorded, not waited
    monkeypatch.setattr(_http, "time", types.SimpleNamespace(sleep=sleeps.append))
    own, root = io.StringIO(), io.StringIO()  # huggingface_hub's default handler, and what basicConfig sets up
    monkeypatch.setattr(logging.getLogger("huggingface_hub"), "handlers", [logging.StreamHandler(own)])
    monkeypatch.setattr(logging.getLogger(), "handlers", [logging.StreamHandler(root)])
    loopback_hub.faults["create"] = ["500"]
    loopback_hub.always["commit"] = "500"
    with pytest.raises(hub.PushFailed, match="upload to the Hub failed: HfHubHTTPError"):
        hub.push_export(out, "org/m", token=TOKEN)
    assert loopback_hub.count("create") == 2 and loopback_hub.count("commit") == 6
    assert sleeps == [1, 2, 4, 8, 8]  # huggingface_hub's (open_sft's 0.5 s before the second create: below)
    said = own.getvalue() + root.getvalue()
    assert said.count("Retrying in 8s [Retry 5/5]") == 1 and said.count("Retrying in 1s [Retry 1/5]") == 1
    assert "create repo failed (HfHubHTTPError" in root.getvalue() and "retry 1/2 in 0.5s" in root.getvalue()
    assert "upload failed" not in said


def test_an_upload_failing_with_a_client_error_inside_hf_xet_is_tried_once(tmp_path, loopback_hub,
                                                                          monkeypatch) -> None:
    """hf_xet reports an HTTP 404 of its token request as a builtin ConnectionError, which is_transient takes for a
    network failure: the upload was tried 6 times with backoff. The upload is not retried by open_sft at all now
    (huggingface_hub and hf_xet retry their own requests), so it is tried once and fails at once."""
    from huggingface_hub import HfApi

    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")
    monkeypatch.setenv("OPEN_SFT_HUB_BACKOFF_S", "0")
    calls = []

    def xet_404(self, **kwargs):
        calls.append(kwargs["repo_id"])
        raise ConnectionError("Data processing error: HTTP status client error (404 Not Found) for url "
                              f"({loopback_hub.url}/api/models/org/m/xet-write-token/main)")

    monkeypatch.setattr(HfApi, "upload_folder", xet_404)
    with pytest.raises(hub.PushFailed, match=r"ConnectionError: .*client error \(404 Not Found\)"):
        hub.push_export(out, "org/m", token=TOKEN)
    assert calls == ["org/m"]
