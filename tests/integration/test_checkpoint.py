"""Checkpoints that survive anything: kill -9 / SIGTERM and relaunch equals the uninterrupted run
(bitwise in one process, 1e-6 relative with 2 ranks under ZeRO-2 and ZeRO-3; a ZeRO-3 checkpoint of 2 ranks
resumes on 1, under ZeRO-3 and as one plain process, and a ZeRO-2 one under FSDP2 on 4 ranks, within 1e-6), partial checkpoints are ignored, pruning keeps the newest complete one, resume refuses a
changed data/batch layout, the sharded export reloads, and the Hub upload retries, fails cleanly and never leaks
the token.

Runs are shared through module fixtures (one run serves several assertions). The whole launch is
interrupted: the launcher and its workers (torchrun starts workers in their own sessions).

(Its fast in-process tests are in tests/unit/training/test_checkpoint.py.)
"""

from __future__ import annotations

import glob
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import FINETUNE, ROOT, SAMPLE, TESTS, child_env, fsdp_command, launch_command, read_metrics
from export_check import assert_export_is_the_runs, weights_of
from open_sft.export.from_checkpoint import export_checkpoint
from hub_server import FakeHub


STEPS = 8


EXACT_FIELDS = ("step", "epoch", "loss", "learning_rate", "grad_norm", "train_tokens", "total_tokens")


TOKEN = "hf_TESTtoken_never_on_disk_1234"


SLOW_FINETUNE = TESTS / "slow_finetune.py"
LAYOUTS = {"single": (1, None, 4, 2), "zero2": (2, "zero2.json", 2, 2), "zero3": (2, "zero3.json", 2, 2)}


def finetune_args(model_dir: Path, output_dir: Path, layout: str, *extra: str) -> list[str]:
    _, _, micro_batch, accumulation = LAYOUTS[layout]
    return ["--model_name_or_path", str(model_dir), "--dataset_mixer_list", str(SAMPLE), "1.0",
            "--output_dir", str(output_dir), "--max_train_steps", str(STEPS),
            "--per_device_train_batch_size", str(micro_batch), "--gradient_accumulation_steps", str(accumulation),
            "--learning_rate", "3e-3", "--warmup_ratio", "0.1", "--logging_steps", "1", "--seed", "1",
            "--torch_dtype", "float32", "--max_seq_length", "256", "--checkpointing_steps", "2",
            "--keep_last_n_checkpoints", "2", "--max_shard_size", "300KB", *extra]


def run_layout(layout: str, args: list[str], check: bool = True, timeout: float = 600,
               **env: str) -> subprocess.CompletedProcess:
    """One launch; a launch still running after `timeout` seconds (a hung rank) fails the test."""
    processes, ds_config, _, _ = LAYOUTS[layout]
    result = subprocess.run(launch_command(processes, ds_config) + args, cwd=ROOT, env=child_env(**env),
                            capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"finetune failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result


def interrupt(layout: str, args: list[str], output_dir: Path, at_line: int, sig: int, log: Path,
              only_rank: int | None = None, env: dict[str, str] | None = None,
              command: list[str] | None = None, only_launcher: bool = False, fate: dict | None = None,
              launcher_first: bool = False) -> int:
    """Launch (the layout's launch command, or `command`; finetune.py as tests/slow_finetune.py, its micro-batches
    0.1 s slower unless `env` says otherwise), wait until metrics.jsonl has `at_line` lines, send
    `sig` to the launcher and every worker (or only to the worker of `only_rank`, or only to the launcher; the
    launcher first with `launcher_first`, as Slurm and pkill may).
    `fate` receives how many seconds the last of the run's processes took to go (within 60 s, else None)."""
    processes, ds_config, _, _ = LAYOUTS[layout]
    command = command or launch_command(processes, ds_config)
    if command[-1] == str(FINETUNE):  # steps slowed (tests/slow_finetune.py), so the signal lands mid-run
        command = [*command[:-1], str(SLOW_FINETUNE)]
    with log.open("w") as handle:
        proc = subprocess.Popen(command + args, cwd=ROOT, env=child_env(**{"SLOW_FORWARD_S": "0.1", **(env or {})}),
                                stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
        metrics = output_dir / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= at_line:
                break
            time.sleep(0.05)
        assert proc.poll() is None, f"run ended before step {at_line}:\n{log.read_text()[-3000:]}"
        launcher = psutil.Process(proc.pid)
        workers = launcher.children(recursive=True)
        targets = [launcher] if only_launcher else [launcher, *workers] if launcher_first else [*workers, launcher]
        if only_rank is not None:
            targets = [t for t in targets if t.environ().get("RANK") == str(only_rank)]
            assert len(targets) == 1, targets
        signalled = time.monotonic()
        for target in targets:
            try:
                target.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
        code = proc.wait(timeout=120)
        while any(_alive(p) for p in workers) and time.monotonic() - signalled < 60:
            time.sleep(0.05)
        if fate is not None:
            fate["gone_after_s"] = None if any(_alive(p) for p in workers) else time.monotonic() - signalled
        return code


def _alive(process: psutil.Process) -> bool:
    """Running, not a zombie waiting to be reaped (an orphan's new parent reaps it when it gets to it)."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def load_weights(output_dir: Path) -> dict[str, torch.Tensor]:
    weights = {}
    for file in sorted(glob.glob(str(output_dir / "model*.safetensors"))):
        weights.update(load_file(file))
    return weights


def assert_continues_exactly(killed: Path, uninterrupted: Path, steps: int) -> None:
    """A killed and relaunched run logged every step once, as the uninterrupted run did, bitwise, and exported the
    same weights."""
    view = [{k: r[k] for k in EXACT_FIELDS} for r in read_metrics(killed) if "loss" in r]
    base = [{k: r[k] for k in EXACT_FIELDS} for r in read_metrics(uninterrupted) if "loss" in r]
    assert [r["step"] for r in view] == list(range(1, steps + 1))
    assert view == base  # measured: bitwise
    resumed, reference = load_weights(killed), load_weights(uninterrupted)
    assert all(torch.equal(resumed[name], tensor) for name, tensor in reference.items())


def resume_elsewhere(run, step: int, output_dir, command: list[str], args: list[str]) -> str:
    """Relaunch `run` from its checkpoint at `step` on another number of ranks (`command`), with the run's own flags
    (the same command, as a requeued job relaunches it): its checkpoint and metrics.jsonl copied into `output_dir`,
    as a kill right after that checkpoint leaves them. Returns the relaunch's stdout and stderr."""
    (output_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(run / "checkpoints" / f"step_{step}", output_dir / "checkpoints" / f"step_{step}")
    shutil.copy(run / "metrics.jsonl", output_dir / "metrics.jsonl")
    result = subprocess.run(command + args, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result.stdout + result.stderr


def assert_continues_within(resumed, uninterrupted, steps: int, atol: float) -> None:
    """Every step logged once; the losses and eval loss within 1e-6 relative of the uninterrupted run's, the gradient
    norms (an fp32 norm of fp32 sums) within 1e-5; token counts and learning rates equal (the same examples and
    schedule); the exported weights within `atol`."""
    view, base = read_metrics(resumed), read_metrics(uninterrupted)
    assert [r["step"] for r in view if "loss" in r] == list(range(1, steps + 1))
    for field, rel in (("loss", 1e-6), ("eval_loss", 1e-6), ("grad_norm", 1e-5)):
        expected = [r[field] for r in base if field in r]
        assert [r[field] for r in view if field in r] == pytest.approx(expected, rel=rel)
    for field in ("train_tokens", "total_tokens", "learning_rate", "epoch"):
        assert [r[field] for r in view if "loss" in r] == [r[field] for r in base if "loss" in r]
    weights, reference = load_weights(resumed), load_weights(uninterrupted)
    assert weights.keys() == reference.keys() and len(reference) > 10
    for name, tensor in reference.items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=atol, msg=name)


def reloaded_loss(output_dir: Path) -> float:
    """The export loaded by transformers in a fresh process, with nothing missing or unexpected: its loss on a
    fixed sequence."""
    code = ("import sys, torch; from transformers import AutoModelForCausalLM\n"
            "m, info = AutoModelForCausalLM.from_pretrained(sys.argv[1], output_loading_info=True)\n"
            "ids = torch.tensor([[1, 5, 9, 40, 7]])\n"
            "print(sum(len(v) for v in info.values()), float(m(ids, labels=ids).loss))")
    result = subprocess.run([sys.executable, "-c", code, str(output_dir)], capture_output=True, text=True,
                            env=child_env(), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    problems, loss = result.stdout.split()[-2:]
    assert problems == "0"
    return float(loss)


def exact_view(records: list[dict]) -> list[dict]:
    return [{k: r[k] for k in EXACT_FIELDS} for r in records]


def complete_steps(output_dir: Path) -> list[int]:
    root = output_dir / "checkpoints"
    return sorted(int(p.name[5:]) for p in root.glob("step_*") if (p / "COMPLETE").is_file())


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("logs")


def run_beside_a_live_run(args: list[str], output_dir: Path, log: Path) -> dict:
    """A run, paused (SIGSTOP) after its first step while a second launch with the same --output_dir starts;
    resumed once that one has exited; runs to its end. Returns the second launch's exit code, seconds, stderr."""
    with log.open("w") as handle:
        first = subprocess.Popen(launch_command(1, None) + args, cwd=ROOT, env=child_env(), stdout=handle,
                                 stderr=subprocess.STDOUT)
        metrics = output_dir / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while first.poll() is None and time.monotonic() < deadline and not (
                metrics.exists() and metrics.read_text().strip()):
            time.sleep(0.05)
        first.send_signal(signal.SIGSTOP)  # alive, holding its lock, mid-run
        try:
            started = time.monotonic()
            second = run_layout("single", args, check=False, timeout=120)
            seconds = time.monotonic() - started
        finally:
            first.send_signal(signal.SIGCONT)
        assert first.wait(timeout=300) == 0, log.read_text()[-3000:]
    return {"code": second.returncode, "seconds": seconds, "stderr": second.stderr, "first_pid": first.pid}


@pytest.fixture(scope="module")
def single(tiny_model_dir, tmp_path_factory, logs) -> dict:
    """Uninterrupted; SIGTERM at step 1 (checkpoint at 1 although checkpointing_steps is 2); relaunch
    killed -9 at step 5; partial checkpoints planted; relaunch."""
    base = tmp_path_factory.mktemp("single_base")
    intruder = run_beside_a_live_run(finetune_args(tiny_model_dir, base, "single"), base, logs / "single_base.log")
    out = tmp_path_factory.mktemp("single_killed")
    args = finetune_args(tiny_model_dir, out, "single")
    term_code = interrupt("single", args, out, 1, signal.SIGTERM, logs / "single_sigterm.log")
    stop_step = read_metrics(out)[-1]["step"]
    term = {"code": term_code, "step": stop_step, "log": (logs / "single_sigterm.log").read_text(),
            "state": json.loads((out / "checkpoints" / f"step_{stop_step}" / "trainer_state.json").read_text())}
    killed_code = interrupt("single", args, out, 5, signal.SIGKILL, logs / "single_killed.log")
    newest = max(complete_steps(out))
    partial = out / "checkpoints" / f"step_{STEPS + 2}.tmp"  # a crash while writing (past the last step,
    partial.mkdir(exist_ok=True)                              # so only the relaunch's cleanup removes it)
    (partial / "optimizer.bin").write_bytes(b"partial")
    planted = out / "checkpoints" / f"step_{newest + 2}"
    planted.mkdir(exist_ok=True)  # renamed but COMPLETE never written
    (planted / "trainer_state.json").write_text("{}")
    relaunch = run_layout("single", args)
    (logs / "single_relaunch.log").write_text(relaunch.stdout + relaunch.stderr)
    return {"base": base, "out": out, "killed_code": killed_code, "newest_before": newest, "term": term,
            "relaunch": relaunch.stdout + relaunch.stderr, "intruder": intruder}


@pytest.fixture(scope="module")
def zero2(tiny_model_dir, tmp_path_factory, logs, hub) -> dict:
    """Uninterrupted; SIGTERM to rank 1 only at step 2; relaunch's launcher alone killed -9 at step 5; relaunch to
    the end. The interrupted runs push their checkpoints (--push_checkpoints, the loopback Hub, whose preupload
    answers after hub.hang_seconds during the SIGTERM's run: uploads are in flight when it stops); each rank's exit
    code is kept (OPEN_SFT_EXIT_CODE_DIR)."""
    base = tmp_path_factory.mktemp("zero2_base")
    run_layout("zero2", finetune_args(tiny_model_dir, base, "zero2"))
    out = tmp_path_factory.mktemp("zero2_interrupted")
    codes = tmp_path_factory.mktemp("zero2_codes")
    online = {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN}
    args = finetune_args(tiny_model_dir, out, "zero2", "--push_to_hub", "--hub_model_id", "org/zero2",
                         "--push_checkpoints")
    hub.always["preupload"] = "hang"
    try:
        term_code = interrupt("zero2", args, out, 2, signal.SIGTERM, logs / "zero2_sigterm.log", only_rank=1,
                              env={**online, "SLOW_FORWARD_S": "0.1", "OPEN_SFT_EXIT_CODE_DIR": str(codes)})
    finally:
        hub.always.clear()
    rank_codes = {path.name: path.read_text().strip() for path in codes.iterdir()}
    term_log = (logs / "zero2_sigterm.log").read_text()
    stop_step = read_metrics(out)[-1]["step"]
    after_term = {"complete": complete_steps(out), "metrics": read_metrics(out),
                  "state": json.loads((out / "checkpoints" / f"step_{stop_step}" / "trainer_state.json").read_text())}
    orphans: dict = {}  # only the launcher killed (the OOM killer's choice): its workers must follow it
    kill_code = interrupt("zero2", args, out, 5, signal.SIGKILL, logs / "zero2_killed.log", only_launcher=True,
                          fate=orphans, env={**online, "SLOW_FORWARD_S": "0.1"})
    relaunch = run_layout("zero2", args, **online)
    return {"base": base, "out": out, "term_code": term_code, "term_log": term_log, "after_term": after_term,
            "rank_codes": rank_codes, "hub_files": dict(hub.repos["org/zero2"]["branches"]["main"]),
            "kill_code": kill_code, "orphans": orphans, "killed_log": (logs / "zero2_killed.log").read_text(),
            "relaunch_log": relaunch.stdout + relaunch.stderr}


@pytest.fixture(scope="module")
def hub():
    server = FakeHub(TOKEN).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def zero3(tiny_model_dir, tmp_path_factory, hub, logs) -> dict:
    """Uninterrupted; rank 1 alone killed -9 at step 3; relaunch with --push_to_hub against a Hub that always fails.
    All three runs are online (HF_HUB_OFFLINE=0, HF_ENDPOINT on loopback), as the push needs."""
    online = {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": hub.url}
    base = tmp_path_factory.mktemp("zero3_base")
    run_layout("zero3", finetune_args(tiny_model_dir, base, "zero3"), **online)
    out = tmp_path_factory.mktemp("zero3_interrupted")
    args = finetune_args(tiny_model_dir, out, "zero3")
    peer: dict = {}  # only rank 1 killed mid-run: rank 0 must not wait for it in a collective
    kill_code = interrupt("zero3", args, out, 3, signal.SIGKILL, logs / "zero3_killed.log", env=online, only_rank=1,
                          fate=peer)
    hub.always["create"] = "500"
    creates_before = hub.count("create")
    final = run_layout("zero3", args + ["--push_to_hub", "--hub_model_id", "org/zero3", "--hub_token", TOKEN],
                       check=False, timeout=300, **online, OPEN_SFT_HUB_RETRIES="3",
                       OPEN_SFT_HUB_BACKOFF_S="0.1")
    hub.always.clear()
    (logs / "zero3_final.log").write_text(final.stdout + final.stderr)
    return {"base": base, "out": out, "kill_code": kill_code, "final": final, "peer": peer,
            "killed_log": (logs / "zero3_killed.log").read_text(), "create_attempts": hub.count("create") - creates_before}


def test_single_process_resume_after_kill_is_bitwise(single) -> None:
    assert single["killed_code"] == -signal.SIGKILL
    base, resumed = read_metrics(single["base"]), read_metrics(single["out"])
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))  # continued, no duplicates
    assert exact_view(resumed) == exact_view(base)
    a, b = load_weights(single["base"]), load_weights(single["out"])
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("layout", ["zero2", "zero3"])
def test_two_rank_resume_matches_uninterrupted(layout, zero2, zero3) -> None:
    runs = {"zero2": zero2, "zero3": zero3}[layout]
    assert runs["kill_code"] != 0
    base, resumed = read_metrics(runs["base"]), read_metrics(runs["out"])
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    for x, y in zip(base, resumed):
        for key in EXACT_FIELDS:
            assert y[key] == pytest.approx(x[key], rel=1e-6, abs=1e-12), (x["step"], key)
    a, b = load_weights(runs["base"]), load_weights(runs["out"])
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-6, atol=1e-7, msg=key)


def test_workers_follow_their_killed_launcher_and_the_relaunch_resumes(zero2) -> None:
    """Only the launcher SIGKILLed at step 5 (torchrun starts workers in sessions of their own): both workers are
    gone within seconds, each saying why, and the relaunch resumed (its losses are held to the uninterrupted run's
    by test_two_rank_resume_matches_uninterrupted)."""
    assert zero2["kill_code"] == -signal.SIGKILL
    assert zero2["orphans"]["gone_after_s"] is not None and zero2["orphans"]["gone_after_s"] < 30
    for rank in (0, 1):
        assert f"error: rank {rank}: its launcher (pid " in zero2["killed_log"]
    assert "stopping this rank without writing a checkpoint (exit 4)" in zero2["killed_log"]
    assert "resuming from " in zero2["relaunch_log"]


def test_a_rank_whose_peer_is_killed_stops_naming_it(zero3) -> None:
    """Rank 1 alone SIGKILLed mid-run: rank 0 stops within seconds (not the process-group timeout) with an error
    naming rank 1, and no traceback of the failed collective."""
    assert zero3["peer"]["gone_after_s"] is not None and zero3["peer"]["gone_after_s"] < 30
    log = zero3["killed_log"]
    assert "error: rank 0: rank 1 (pid " in log and " is gone; stopping this rank without writing a checkpoint" in log
    assert "exitcode  : 4" in log  # torchrun's summary of rank 0


def test_a_second_run_on_a_live_runs_output_dir_stops_naming_it(single) -> None:
    """While the first run lives (paused, its lock held) a second launch on its --output_dir exits at once with
    `error:` naming the first (pid, host, start); the first then finishes unaffected (its losses are the reference
    the resumed runs are held to bitwise)."""
    intruder = single["intruder"]
    assert intruder["code"] == 2 and intruder["seconds"] < 60
    assert f"is in use by a live run (pid {intruder['first_pid']} on " in intruder["stderr"]
    assert "started at" in intruder["stderr"] and "pick another --output_dir" in intruder["stderr"]
    assert "Traceback" not in intruder["stderr"]
    assert [r["step"] for r in read_metrics(single["base"])] == list(range(1, STEPS + 1))
    assert json.loads((single["base"] / ".open_sft.lock").read_text())["state"] == "ended"


def test_the_relaunch_takes_over_the_lock_of_a_killed_run(zero2) -> None:
    """The launcher killed at step 5 took rank 0 (the lock's holder) with it: the relaunch takes the lock over."""
    assert "taking over the lock of a run that is gone (pid " in zero2["relaunch_log"]
    assert json.loads((zero2["out"] / ".open_sft.lock").read_text())["state"] == "ended"


def test_resume_inside_a_logging_window_logs_what_the_uninterrupted_run_logs(tiny_model_dir, tmp_path) -> None:
    """Six-step logging windows and a SIGTERM after the first: the checkpoint is taken inside the second
    window, and the resumed run logs that window (loss, padding ratio, tokens, every exact field) as the
    uninterrupted run does. Unpacked micro-batches of 4, so the padding ratio is far from 0."""
    args = ["--max_train_steps", "12", "--logging_steps", "6", "--checkpointing_steps", "100"]
    base = tmp_path / "base"
    run_layout("single", finetune_args(tiny_model_dir, base, "single") + args)
    out = tmp_path / "resumed"
    # the micro-batches after step 6 (2 a step) slowed by 0.5 s: the SIGTERM surely lands inside steps 7-12
    interrupt("single", finetune_args(tiny_model_dir, out, "single") + args, out, 1, signal.SIGTERM,
              tmp_path / "term.log", env={"SLOW_AFTER_CALLS": "12", "SLOW_FORWARD_S": "0.5"})
    saved = complete_steps(out)
    assert len(saved) == 1 and 6 < saved[0] < 12, saved  # inside the window of steps 7-12
    run_layout("single", finetune_args(tiny_model_dir, out, "single") + args)
    fields = (*EXACT_FIELDS, "padding_ratio", "nonfinite_steps")
    expected, resumed = read_metrics(base), read_metrics(out)
    assert [r["step"] for r in resumed] == [6, 12] and expected[1]["padding_ratio"] > 0.05
    assert [{k: r[k] for k in fields} for r in resumed] == [{k: r[k] for k in fields} for r in expected]


def test_partial_checkpoints_are_skipped_with_a_warning(single) -> None:
    newest, log = single["newest_before"], single["relaunch"]
    partial = single["out"] / "checkpoints" / f"step_{STEPS + 2}.tmp"
    assert f"removing partial checkpoint {partial} (interrupted while being written)" in log
    assert f"skipping checkpoint {single['out'] / 'checkpoints' / f'step_{newest + 2}'}: no COMPLETE marker" in log
    assert f"resuming from {single['out'] / 'checkpoints' / f'step_{newest}'} (step {newest})" in log


def test_pruning_keeps_the_newest_complete_checkpoints(single, zero2) -> None:
    for run in (single, zero2):
        assert complete_steps(run["out"]) == [STEPS - 2, STEPS]
        assert not list((run["out"] / "checkpoints").glob("*.tmp"))


def test_checkpoint_holds_rng_per_rank_state_and_no_token(zero2, single) -> None:
    ckpt = zero2["out"] / "checkpoints" / f"step_{STEPS}"
    assert (ckpt / "random_states_0.pkl").is_file() and (ckpt / "random_states_1.pkl").is_file()
    assert list((ckpt / "pytorch_model").glob("zero_pp_rank_*_optim_states.pt"))  # DeepSpeed's own format
    state = json.loads((ckpt / "trainer_state.json").read_text())
    metrics = read_metrics(zero2["out"])
    assert state["step"] == STEPS and state["train_tokens"] == metrics[-1]["train_tokens"]
    assert state["identity"]["world_size"] == 2 and len(state["identity"]["dataset_cache_key"]) == 64
    assert state["data_position"] == {"epoch": 0, "step_in_epoch": STEPS, "seed": 1}
    assert state["config"]["hub"]["hub_token"] is None
    single_ckpt = single["out"] / "checkpoints" / f"step_{STEPS}"
    assert {"model.safetensors", "optimizer.bin", "random_states_0.pkl"} <= {p.name for p in single_ckpt.iterdir()}


def test_sigterm_saves_a_checkpoint_and_all_ranks_stop_at_the_same_step(zero2) -> None:
    after = zero2["after_term"]
    stop_step = after["metrics"][-1]["step"]
    assert stop_step >= 2
    assert after["complete"][-1] == stop_step  # saved at the step where it stopped
    state = after["state"]
    assert state["preempted"] is True and state["step"] == stop_step
    log = zero2["term_log"]
    # rank 1 got the signal, rank 0 learned it through the all-reduce: both stop after the same step
    assert f"(SIGTERM received here): saving a checkpoint at step {stop_step} and exiting" in log, log[-3000:]
    assert f"(signal received by another rank): saving a checkpoint at step {stop_step} and exiting" in log, log[-3000:]
    assert "exitcode: 75" in log, log[-3000:]  # PREEMPTED_EXIT_CODE, reported by the launcher
    assert zero2["term_code"] != 0
    # hunt F F2: rank 0 waited for its checkpoint uploads while its lifeline watched rank 1, which had exited: exit 4,
    # "rank 1 ... is gone; stopping this rank without writing a checkpoint". Every rank exits 75 with the true line
    codes = zero2["rank_codes"]
    assert (codes["rank0"], codes["rank1"]) == ("75", "75"), (codes, log[-3000:])
    assert codes["rank0.message"].startswith(f"open_sft: stopped on a signal after step {stop_step}; checkpoint saved")
    assert "is gone" not in log, log[-3000:]
    # hunt F F1: the preemption checkpoint, whose upload the stop cut off, reached the Hub through the relaunch
    files = zero2["hub_files"]
    assert {f"checkpoints/step_{step}/COMPLETE" for step in (stop_step, STEPS)} <= set(files)
    assert json.loads(files[f"checkpoints/step_{stop_step}/COMPLETE"])["step"] == stop_step


def test_sigterm_single_process_exit_code(single) -> None:
    from open_sft.training.preemption import PREEMPTED_EXIT_CODE

    term = single["term"]
    assert term["code"] == PREEMPTED_EXIT_CODE
    assert term["state"]["preempted"] is True and term["state"]["step"] == term["step"]
    assert "relaunch the same command to resume" in term["log"]


def test_resume_refused_on_changed_data_or_batch_layout(single, tiny_model_dir) -> None:
    # the run is finished (a relaunch with auto would say 'already complete'): resume its checkpoint by name
    args = finetune_args(tiny_model_dir, single["out"], "single", "--resume_from_checkpoint",
                         str(single["out"] / "checkpoints" / f"step_{STEPS}"))
    changed = {"--per_device_train_batch_size": "2", "--gradient_accumulation_steps": "4", "--max_seq_length": "200"}
    for flag, value in changed.items():
        args[args.index(flag) + 1] = value
    result = run_layout("single", args, check=False)
    assert result.returncode == 2
    message = result.stderr
    assert "cannot resume from" in message and f"step_{STEPS}" in message
    assert "--per_device_train_batch_size: checkpoint 4, now 2" in message
    assert "--gradient_accumulation_steps: checkpoint 2, now 4" in message
    assert "--max_seq_length: 256 in the checkpoint, 200 now" in message  # the data's flag, before tokenizing
    assert "--resume_from_checkpoint none" in message
    assert complete_steps(single["out"]) == [STEPS - 2, STEPS]  # nothing touched
    assert (single["out"] / "RUN_COMPLETE").is_file()  # refused before training: the run is still complete


RELOAD = """
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
path = sys.argv[1]
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path).eval()
enc = tok.apply_chat_template([{"role": "user", "content": "What is 2 plus 3?"}], add_generation_prompt=True,
                              return_tensors="pt", return_dict=True)
with torch.no_grad():
    logits = model(**enc).logits
total = sum(float(p.double().sum()) for p in model.parameters())
print(json.dumps({"finite": bool(torch.isfinite(logits).all()), "template": bool(tok.chat_template),
                  "eos": GenerationConfig.from_pretrained(path).eos_token_id, "param_sum": total}))
"""


def test_sharded_export_reloads_in_a_fresh_process(single) -> None:
    out = single["out"]
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) >= 2 and (out / "model.safetensors.index.json").is_file()
    assert not (out / "model.safetensors").exists()
    result = subprocess.run([sys.executable, "-c", RELOAD, str(out)], cwd=ROOT, env=child_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["finite"] and summary["template"] and summary["eos"] is not None
    weights = load_weights(out)
    expected = sum(float(w.double().sum()) for name, w in weights.items())
    assert summary["param_sum"] == pytest.approx(expected, rel=1e-9)


def test_model_card(single) -> None:
    card = (single["out"] / "README.md").read_text()
    last = read_metrics(single["out"])[-1]
    assert card.startswith("---\nlibrary_name: transformers")
    assert "A fine-tune of" in card and str(SAMPLE) in card  # base model and data source
    assert "| 2000 |" in card and "100.0%" in card  # rows kept and share of trained tokens
    assert "| learning_rate | 0.003 |" in card and "| per_device_train_batch_size | 4 |" in card
    assert f"| loss | {last['loss']:.6g} |" in card and f"| step | {STEPS} |" in card
    for name in ("run.json", "data_report.json", "generation_config.json", "tokenizer_config.json"):
        assert (single["out"] / name).is_file(), name


def test_push_retries_transient_failures_and_uploads_the_export(single, hub, logs) -> None:
    hub.faults = {"create": ["500"], "commit": ["500", "drop", "hang"]}
    hub.hang_seconds = 4
    env = child_env(HF_ENDPOINT=hub.url, HF_HUB_OFFLINE="0", HF_TOKEN=TOKEN, OPEN_SFT_HUB_RETRIES="4",
                    OPEN_SFT_HUB_BACKOFF_S="0.1", OPEN_SFT_HUB_TIMEOUT_S="2")
    result = subprocess.run([str(ROOT / "scripts" / "push_to_hub.sh"), str(single["out"]), "--hub_model_id",
                             "org/single", "--hub_revision", "v1"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=300)
    (logs / "push.log").write_text(result.stdout + result.stderr)
    assert result.returncode == 0, result.stderr[-3000:]
    statuses = [(name, status) for name, _, status in hub.log]
    assert ("create", 500) in statuses and ("commit", 500) in statuses and ("commit", -1) in statuses
    assert "retry 1/3" in result.stderr  # our backoff around create_repo
    repo = hub.repos["org/single"]
    assert repo["private"] is True
    files = repo["branches"]["v1"]
    local = {str(p.relative_to(single["out"])) for p in single["out"].rglob("*") if p.is_file()}
    expected = {name for name in local if not name.startswith("checkpoints") and not name.startswith("data_order")
                and name not in (".open_sft.lock", "RUN_COMPLETE", ".open_sft_export.json")}  # (the export's record)
    assert set(files) == expected
    for name in ("model.safetensors.index.json", "README.md", "run.json"):
        assert files[name] == (single["out"] / name).read_bytes()


def test_failed_push_exits_nonzero_with_retry_command_and_keeps_the_export(zero3) -> None:
    final, out = zero3["final"], zero3["out"]
    assert final.returncode != 0
    assert zero3["create_attempts"] == 3  # OPEN_SFT_HUB_RETRIES
    assert f"python -m open_sft push {out} --hub_model_id org/zero3 --hub_revision main --hub_private" in final.stderr
    assert "The local export in" in final.stderr
    assert load_weights(out) and (out / "README.md").is_file() and (out / "config.json").is_file()


def test_token_never_written_or_logged(single, zero2, zero3, hub, logs) -> None:
    """Every file of the runs (exports, checkpoints, logs) and every captured output: no token."""
    needle = TOKEN.encode()
    scanned = 0
    for root in (single["out"], zero2["out"], zero3["out"], logs):
        for path in Path(root).rglob("*"):
            if path.is_file():
                scanned += 1
                assert needle not in path.read_bytes(), path
    assert TOKEN not in zero3["final"].stdout + zero3["final"].stderr
    run_json = json.loads((zero3["out"] / "run.json").read_text())
    assert run_json["args"]["hub"]["hub_token"] == "<redacted>"
    assert scanned > 20


@pytest.mark.parametrize("layout", ["single", "zero2", "zero3"])
def test_export_of_a_step_checkpoint_is_the_runs_own_export(layout, single, zero2, zero3, tmp_path) -> None:
    """`open_sft export` of the last checkpoint of a one-process run, of DeepSpeed ZeRO-2's (the module in rank 0's
    model states) and of ZeRO-3's (each rank's partition of the fp32 masters): the run's own export, bitwise."""
    run = {"single": single, "zero2": zero2, "zero3": zero3}[layout]
    out = assert_export_is_the_runs(run["base"], STEPS, tmp_path / "export")
    record = json.loads((out / "export.json").read_text())
    assert record["step"] == STEPS and record["total_steps"] == STEPS
    assert ("ZeRO-3" in record["engine"]) == (layout == "zero3")
    assert f"Exported from the checkpoint of step {STEPS} of {STEPS}" in (out / "README.md").read_text()
    assert len(list(out.glob("model-*.safetensors"))) > 1  # the run's --max_shard_size 300KB, as the run's export


def test_export_of_a_bf16_zero3_checkpoint_in_a_fresh_process_gives_the_runs_loss(tiny_model_dir, tmp_path) -> None:
    """ZeRO-3 under bf16 keeps fp32 masters, which an fp32 export holds (the run's and the CLI's, bitwise: the
    module holds them rounded to bf16, which one process and FSDP2 never export); a bf16 export is the masters
    cast, what the module held. The same loss when loaded with transformers; an earlier step's checkpoint gives
    that step's weights."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    run = tmp_path / "run"
    args = finetune_args(tiny_model_dir, run, "zero3", "--save_dtype", "float32")
    for flag, value in (("--torch_dtype", "bfloat16"), ("--max_train_steps", "4")):
        args[args.index(flag) + 1] = value
    run_layout("zero3", args)
    result = subprocess.run([sys.executable, "-m", "open_sft", "export", str(run / "checkpoints" / "step_4"),
                             str(tmp_path / "step4")], cwd=ROOT, env=child_env(), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == str(tmp_path / "step4")
    export_checkpoint(run / "checkpoints" / "step_2", tmp_path / "step2")
    ours, theirs = weights_of(tmp_path / "step4"), weights_of(run)
    assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert {t.dtype for t in ours.values()} == {torch.float32}
    masters = get_fp32_state_dict_from_zero_checkpoint(str(run / "checkpoints" / "step_4"), tag="pytorch_model")
    assert all(torch.equal(theirs[k], masters[f"model.{k}"]) for k in theirs)  # not their bf16 rounding
    assert not all(torch.equal(t, t.bfloat16().float()) for t in theirs.values())
    bf16 = weights_of(export_checkpoint(run / "checkpoints" / "step_4", tmp_path / "bf16", "bfloat16"))
    assert all(torch.equal(bf16[k], theirs[k].bfloat16()) for k in theirs)
    assert any(not torch.equal(weights_of(tmp_path / "step2")[k], theirs[k]) for k in theirs)  # step 2 is not 4
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "step4")
    ids = tokenizer("hello world", return_tensors="pt").input_ids
    exported, own = (float(AutoModelForCausalLM.from_pretrained(d)(ids, labels=ids).loss)
                     for d in (tmp_path / "step4", run))
    assert exported == own and 0 < own < 20


def test_a_two_rank_zero3_checkpoint_resumes_on_one_process(zero3, tiny_model_dir, tmp_path) -> None:
    """The ZeRO-3 partitions of 2 ranks, converted to DeepSpeed's universal format, on 1 process: accumulation
    2 -> 4 keeps the global batch of 8, and steps 7-8 train what the 2 ranks trained."""
    out = tmp_path / "out"
    log = resume_elsewhere(zero3["base"], STEPS - 2, out, launch_command(1, "zero3.json"),
                           finetune_args(tiny_model_dir, out, "zero3"))
    assert ("resuming a 2-rank checkpoint on 1 rank: gradient accumulation 2 -> 4 keeps the global batch of 8 "
            "sequences") in log
    assert "to DeepSpeed's universal format, to load on 1 rank(s)" in log
    assert not list((out / "checkpoints").glob("*.universal.tmp"))  # the conversion is removed once loaded
    # measured: losses 2.4e-8 relative, gradient norms 8e-9, weights 5.6e-7 apart; before each Adam state had its
    # own step (open_sft.training.universal), weights were 6e-5 apart two steps on
    assert_continues_within(out, zero3["base"], STEPS, atol=1e-5)


def test_a_zero2_checkpoint_resumes_under_fsdp2_on_four_ranks(zero2, tiny_model_dir, tmp_path) -> None:
    """The 2 ranks' ZeRO-2 partitions made whole per parameter (DeepSpeed's universal format) and sent to FSDP2's
    4 ranks by name through torch's state-dict API (accumulation 2 -> 1): steps 7-8 train what ZeRO-2 trained."""
    out = tmp_path / "out"
    log = resume_elsewhere(zero2["base"], STEPS - 2, out, fsdp_command(processes=4),
                           finetune_args(tiny_model_dir, out, "zero2"))
    assert "resuming a 2-rank checkpoint on 4 ranks: gradient accumulation 2 -> 1" in log
    assert "resuming a DeepSpeed ZeRO-1/2 checkpoint of 2 rank(s) under FSDP2" in log
    assert not list((out / "checkpoints").glob("*.tmp"))
    # measured by hand (6 steps, resumed at 2 on 4 ranks): losses 4.8e-8 relative, gradient norms 1.8e-6, weights
    # 1.8e-7 apart
    assert_continues_within(out, zero2["base"], STEPS, atol=1e-5)


def test_a_two_rank_zero3_checkpoint_resumes_as_one_plain_process(zero3, tiny_model_dir, tmp_path) -> None:
    """Another engine and another number of ranks at once: ZeRO-3's flat universal files reshaped to the model's
    parameters, loaded into one process's torch AdamW; accumulation 2 -> 4 keeps the global batch of 8."""
    out = tmp_path / "out"
    log = resume_elsewhere(zero3["base"], STEPS - 2, out, launch_command(1, None),
                           finetune_args(tiny_model_dir, out, "zero3"))
    assert ("resuming a 2-rank checkpoint on 1 rank: gradient accumulation 2 -> 4 keeps the global batch of 8 "
            "sequences") in log
    assert "resuming a DeepSpeed ZeRO-3 checkpoint of 2 rank(s) under one process or DDP" in log
    # measured (6 steps, resumed at 4): losses equal, gradient norms 7.7e-6 relative, weights 1.6e-7 apart (before
    # each parameter had its own Adam step tensor: losses 6e-4 off one step on)
    assert_continues_within(out, zero3["base"], STEPS, atol=1e-5)
