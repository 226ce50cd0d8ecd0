"""A killed tokenization-cache build resumes after its last committed chunk, and builds what an uninterrupted
build builds.

A build of chunks of 100 rows is SIGKILLed (a real kill, nothing in the process runs after it) once it has
committed a few chunks; the next build of the same entry tokenizes only the chunks after those (counted), says
so, and its entry's data files (sha256 of each, from the COMPLETE manifest) and data report equal a clean
build's. Chat rows with bad rows dropped (the dropped rows of the chunks before the kill are remembered) and
raw-text documents cut into blocks across chunks. A build that stops on bad data leaves nothing to resume."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, SAMPLE, child_env

BUILD = r"""
import json, logging, sys, time
from transformers import AutoTokenizer
from open_sft.config.args import DataArguments
from open_sft.data import prepare, stream

logging.basicConfig(level=logging.INFO)
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
corpus, pause = sys.argv[2], float(sys.argv[3])
calls = [0]
def counted(label, tokenize):
    def call(*args, **kwargs):
        calls[0] += 1
        time.sleep(pause)  # the run that is killed goes slowly, so the kill lands mid-build
        return (label or tokenize)(*args, **kwargs)
    return call
stream.label_rows = counted(stream.label_rows, None)
text = DataArguments(dataset_mixer_list=[corpus, "1.0"], max_seq_length=64,
                     on_bad_row="drop", preprocessing_num_workers=1)
if corpus.endswith("text.jsonl"):  # documents: count the batches tokenized (a chunk of 100 documents is one)
    stream._document_rows = counted(stream._document_rows, None)
data = prepare.prepare_data(text, tokenizer, 0)
print(json.dumps({"calls": calls[0], "hit": data.cache_hit, "entry": str(data.cache_path)}))
"""


def corpora(tmp_path: Path) -> dict[str, Path]:
    rows = SAMPLE.read_text().splitlines()[:1500]
    chat = tmp_path / "chat.jsonl"
    # bad rows in chunks before and after the kill: a line that is not JSON, a row with no messages
    chat.write_text("\n".join(row if i % 173 else ("{not json" if i % 2 else '{"messages": []}')
                              for i, row in enumerate(rows)) + "\n")
    text = tmp_path / "text.jsonl"
    text.write_text("\n".join(json.dumps({"text": " ".join(m["content"] for m in json.loads(row)["messages"])})
                              for row in rows) + "\n")
    return {"chat": chat, "text": text}


def start(model_dir: Path, corpus: Path, cache: Path, pause: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", BUILD, str(model_dir), str(corpus), str(pause)],
                            cwd=ROOT, env=child_env(OPEN_SFT_BUILD_CHUNK_ROWS="100", OPEN_SFT_CACHE=str(cache)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(process: subprocess.Popen) -> tuple[dict, str]:
    out, err = process.communicate(timeout=600)
    assert process.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1]), err


def committed(cache: Path) -> int:
    states = list(cache.glob("*.partial/source0/*.state.json"))
    try:
        return json.loads(states[0].read_text())["chunks"] if states else 0
    except ValueError:  # being replaced
        return 0


@pytest.mark.parametrize("kind", ["chat", "text"])
def test_a_killed_build_resumes_after_its_last_chunk(tiny_model_dir, tmp_path, kind) -> None:
    corpus = corpora(tmp_path)[kind]
    clean, clean_log = finish(start(tiny_model_dir, corpus, tmp_path / "clean", 0.0))
    assert clean["calls"] == 15 and not clean["hit"]  # 1,500 rows, chunks of 100

    cache = tmp_path / "cache"
    killed = start(tiny_model_dir, corpus, cache, 0.4)
    deadline = time.monotonic() + 300
    while committed(cache) < 4 and killed.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    killed.send_signal(signal.SIGKILL)
    killed.communicate(timeout=60)
    done = committed(cache)
    assert 4 <= done < 15 and killed.returncode == -signal.SIGKILL

    resumed, log = finish(start(tiny_model_dir, corpus, cache, 0.0))
    said = f"resuming the build of {corpus}: {done * 100} rows already tokenized ({done} chunks)"
    assert said in log
    assert resumed["calls"] == 15 - done
    assert not list(cache.glob("*.partial")) and not list(cache.glob("*.tmp-*"))
    entries = {name: Path(run["entry"]) for name, run in (("clean", clean), ("resumed", resumed))}
    files = {name: json.loads((entry / "COMPLETE").read_text())["files"] for name, entry in entries.items()}
    assert files["resumed"] == files["clean"]
    reports = {name: json.loads((entry / "report.json").read_text()) for name, entry in entries.items()}
    assert reports["resumed"] == reports["clean"]
    if kind == "chat":
        assert reports["clean"]["sources"][0]["rows_dropped"] == {"invalid_json": 4, "missing_messages": 5}


def test_a_build_stopped_by_bad_data_leaves_nothing_to_resume(tiny_model_dir, tmp_path, monkeypatch) -> None:
    from transformers import AutoTokenizer

    from open_sft.config.args import DataArguments
    from open_sft.data.prepare import prepare_data
    from open_sft.errors import UserError

    corpus = tmp_path / "bad.jsonl"
    corpus.write_text(SAMPLE.read_text().splitlines()[0] + "\n{not json\n")
    monkeypatch.setenv("OPEN_SFT_CACHE", str(tmp_path / "cache"))
    args = DataArguments(dataset_mixer_list=[str(corpus), "1.0"])
    with pytest.raises(UserError, match=f"{corpus} line 2"):
        prepare_data(args, AutoTokenizer.from_pretrained(tiny_model_dir), 0)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == []  # nor its key's lock file (it was kept)


POOL = r"""
import sys, time
from transformers import AutoTokenizer
from open_sft.data import workers
from open_sft.data.formats import to_messages

tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
row = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
def slow(item):
    time.sleep(0.5)  # the build goes slowly: it is killed while its workers render
    return to_messages(item, "messages")
workers.label_rows(tokenizer, [(i, row) for i in range(4000)], "all_assistant", 2, convert=slow)
"""


def test_a_killed_builds_render_workers_end_with_it(tiny_model_dir) -> None:
    """kill -9 of a build while its render workers (a fork pool) run: they end with it (they waited on the task
    queue for good, each holding a tokenizer and the build's files)."""
    import psutil

    # no pipes: a worker left alive would hold them open
    process = subprocess.Popen([sys.executable, "-c", POOL, str(tiny_model_dir)], cwd=ROOT, env=child_env(),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    parent = psutil.Process(process.pid)
    deadline = time.monotonic() + 120
    while len(parent.children()) < 2 and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    children = parent.children()
    assert len(children) == 2 and process.poll() is None, process.returncode
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    gone, alive = psutil.wait_procs(children, timeout=20)
    for child in alive:  # not to outlive the test
        child.kill()
    assert not alive, [c.pid for c in alive]


STOP_WHILE_FORKING = r"""
import os, signal, sys
from open_sft import run
from open_sft.data import workers

sent = []
def signal_while_forking():  # what a SIGTERM arriving as the build forks its render workers meets (1 try in 3)
    if workers._STATE and not sent:
        sent.append(True)
        os.kill(os.getpid(), signal.SIGTERM)  # its handler runs in this hook, where Python drops what it raises
os.register_at_fork(before=signal_while_forking)
sys.exit(run.main(sys.argv[1:]))
"""


def test_a_stop_signal_while_the_build_forks_stops_it(tiny_model_dir, tmp_path) -> None:
    """SIGTERM landing in the fork of the render workers: the handler's stop, dropped by the fork's hooks ("Exception
    ignored"), is raised after the fork: exit 75 with the line, the entry not built (the build went on to the end,
    and in a launch past the launcher's 30 s grace)."""
    cache = tmp_path / "cache"
    args = ["--model_name_or_path", str(tiny_model_dir), "--dataset_mixer_list", str(SAMPLE), "1.0", "--output_dir",
            str(tmp_path / "out"), "--cache_dataset_only", "--preprocessing_num_workers", "2",
            "--max_seq_length", "128"]
    result = subprocess.run([sys.executable, "-c", STOP_WHILE_FORKING, *args], cwd=ROOT, capture_output=True,
                            text=True, env=child_env(OPEN_SFT_CACHE=str(cache)), timeout=300)
    assert "Exception ignored" in result.stderr, result.stderr[-3000:]  # the hook dropped it, as measured
    assert result.returncode == 75, result.stdout[-2000:] + result.stderr[-3000:]
    assert "open_sft: stopped by SIGTERM outside the training loop" in result.stderr
    assert not list(cache.glob("*/COMPLETE")) and list(cache.glob("*.partial"))
