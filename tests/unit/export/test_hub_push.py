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
