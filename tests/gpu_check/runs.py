"""What a GPU check runs: finetune.py launches as a user types them (and one killed mid-run), runs side by side
on a GPU, the export reloaded in a fresh process, Liger's replacements, and the probes (pytest, one file each)."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from tests.gpu_check.context import FIGURES, MODEL, ROOT, SMOKE, Context, RunResult


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_prefix(launcher: str) -> list[str]:
    """`python finetune.py`, or `accelerate launch` with one process: a DeepSpeed JSON of configs/ds, or fsdp2."""
    if launcher == "python":
        return [sys.executable, str(ROOT / "finetune.py")]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1",
           "--dynamo_backend", "no", "--main_process_port", str(_port())]
    if launcher == "fsdp2":
        cmd += ["--config_file", str(ROOT / "configs" / "accelerate" / "fsdp2.yaml")]
    else:
        cmd += ["--use_deepspeed", "--deepspeed_config_file", str(ROOT / "configs" / "ds" / launcher)]
    return cmd + [str(ROOT / "finetune.py")]


def finetune_command(ctx: Context, name: str, extra: list[str], launcher: str = "python") -> list[str]:
    flags = {"--model_name_or_path": str(ctx.small_model), "--output_dir": str(ctx.work / "runs" / name),
             "--max_seq_length": "1024", "--per_device_train_batch_size": "8",
             "--gradient_accumulation_steps": "1", "--learning_rate": "1e-3", "--lr_scheduler_type": "constant",
             "--warmup_ratio": "0", "--max_train_steps": str(ctx.steps), "--logging_steps": "1", "--seed": "1",
             "--dataset_local_cache_dir": str(ctx.work / "cache")}
    rest, i = [], 0
    while i < len(extra):  # the part's flags replace the common ones of the same name
        if extra[i] in flags and i + 1 < len(extra) and not extra[i + 1].startswith("--"):
            flags[extra[i]] = extra[i + 1]
            i += 2
        else:
            rest.append(extra[i])
            i += 1
    args = [item for pair in flags.items() for item in pair]
    return launch_prefix(launcher) + args + ["--dataset_mixer_list", ctx.data, ctx.data_amount] + rest


def log_path(ctx: Context, name: str) -> Path:
    (ctx.work / "logs").mkdir(exist_ok=True)
    return ctx.work / "logs" / f"{name}.log"


def _result(ctx: Context, out: Path, log: Path) -> RunResult:
    by_step: dict[int, float] = {}
    peak = 0.0
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            by_step[record["step"]] = record["loss"]
            peak = max(peak, record.get("peak_memory_gib", 0.0))
    run = json.loads((out / "run.json").read_text())
    resumed = next((line.strip()[-160:] for line in log.read_text().splitlines() if "resum" in line.lower()), None)
    return RunResult(out, [by_step[s] for s in sorted(by_step)], run, peak, resumed)


def finetune(ctx: Context, name: str, extra: list[str], launcher: str = "python", fresh: bool = True,
             timeout: float = 300) -> RunResult:
    out = ctx.work / "runs" / name
    if fresh and out.exists():
        shutil.rmtree(out)
    log = log_path(ctx, name if fresh else f"{name}_relaunch")
    with log.open("w") as handle:
        proc = subprocess.run(finetune_command(ctx, name, extra, launcher), cwd=ROOT, env=ctx.env(),
                              stdout=handle, stderr=subprocess.STDOUT, timeout=timeout)
    if proc.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-25:])
        raise RuntimeError(f"{name}: exit code {proc.returncode}; last lines of its log:\n{tail}")
    return _result(ctx, out, log)


def interrupt(ctx: Context, name: str, extra: list[str], at_line: int, timeout: float = 300) -> int:
    """Launch, wait for `at_line` lines of metrics.jsonl, kill -9 the run's whole process group."""
    out = ctx.work / "runs" / name
    shutil.rmtree(out, ignore_errors=True)
    with log_path(ctx, name).open("w") as handle:
        proc = subprocess.Popen(finetune_command(ctx, name, extra), cwd=ROOT, env=ctx.env(), stdout=handle,
                                stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        metrics = out / "metrics.jsonl"
        while time.monotonic() < deadline and proc.poll() is None:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= at_line:
                os.killpg(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.05)
        if proc.poll() is None and time.monotonic() >= deadline:
            os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait(timeout=60)


def together(ctx: Context, *fns: Callable[[], Any]) -> list[Any]:
    """The values of `fns`: on a GPU called at the same time (threads; each run is a process of its own and the
    GPU has room for several small ones), on CPU one after the other."""
    if not ctx.gpu:
        return [fn() for fn in fns]
    with ThreadPoolExecutor(max_workers=len(fns)) as pool:
        return [future.result() for future in [pool.submit(fn) for fn in fns]]


def falling(losses: list[float]) -> bool:
    return (len(losses) >= 4 and all(math.isfinite(x) for x in losses)
            and sum(losses[-2:]) < sum(losses[:2]))


RELOAD = """
import json, sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
ids = torch.tensor([[5, 6, 7, 8, 9]])
print(json.dumps({"loss": float(model(input_ids=ids, labels=ids).loss)}))
"""


def reload_export(ctx: Context, out: Path) -> Any:
    """True when the export in `out` loads in a fresh process and gives a finite loss; else what went wrong."""
    proc = subprocess.run([sys.executable, "-c", RELOAD, str(out)], cwd=ROOT, env=ctx.env(), capture_output=True,
                          text=True, timeout=300)
    if proc.returncode != 0:
        return f"reload failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}"
    loss = json.loads(proc.stdout.strip().splitlines()[-1])["loss"]
    return True if math.isfinite(loss) else f"reloaded model's loss is {loss}"


LIGER = """
import json, sys, torch
from open_sft.config.args import ModelArguments
from open_sft.model.load import load_model
model = load_model(ModelArguments(model_name_or_path=sys.argv[1], use_liger_kernel=True))
# Liger binds its forwards to the model's own modules (renamed) and swaps the modeling module's rotary function
names = sorted({m._get_name() for m in model.modules() if "Liger" in m._get_name()})
rope = getattr(sys.modules[type(model).__module__], "apply_rotary_pos_emb", None)
print(json.dumps(names + (["liger rotary embedding"] if "liger" in getattr(rope, "__module__", "") else [])))
"""


def log_lines(ctx: Context, name: str, marker: str) -> list[str]:
    """The lines of a run's log that carry `marker` (what the run said it put in place), message part only."""
    lines = log_path(ctx, name).read_text().splitlines()
    return sorted({line.split(": ", 1)[-1][:300] for line in lines if marker in line})


def liger_replacements(ctx: Context, result: RunResult) -> tuple[dict, bool]:
    """Which modules Liger put in place, and what the run said of its LM-head loss (Liger's fused linear
    cross-entropy through open_sft.model.liger_loss on CUDA, or open_sft's chunked loss and why not)."""
    proc = subprocess.run([sys.executable, "-c", LIGER, str(ctx.small_model)], cwd=ROOT, env=ctx.env(),
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        return {"liger_modules": proc.stderr.strip()[-500:]}, False
    modules = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"liger_modules": modules, "lm_head_loss": log_lines(ctx, "liger", "--use_liger_kernel")}, \
        bool(modules)


def probe(ctx: Context, name: str, timeout: float = 300) -> dict:
    """tests/gpu_check/test_{name}.py in a pytest process of its own (its tolerances are its assertions): the
    figures it measured, and "pass" when every test passed or was skipped (a CUDA-only test on CPU)."""
    log, figures = log_path(ctx, f"probe_{name}"), ctx.work / f"probe_{name}.json"
    figures.unlink(missing_ok=True)
    env = {**ctx.env(), FIGURES: str(figures), SMOKE: "1" if ctx.smoke else "0", MODEL: str(ctx.small_model)}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(Path(__file__).parent / f"test_{name}.py")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode not in (0, 1) or not figures.exists():  # 1: a test failed; else pytest or the probe broke
        raise RuntimeError(f"probe {name}: pytest exit {proc.returncode}: {(proc.stdout + proc.stderr)[-1500:]}")
    result = {**json.loads(figures.read_text()), "pass": proc.returncode == 0}
    if proc.returncode == 1:
        failed = [line for line in proc.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
        result["error"] = "\n".join(failed)[-2000:]
    return result
