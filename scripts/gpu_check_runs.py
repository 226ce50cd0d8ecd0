"""What scripts/gpu_check.py runs: the context of one check, the models and data it prepares, finetune.py
launches as a user types them, the probes and the benchmark, and the report's Markdown."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "open_sft" / "embedded" / "data" / "sample.jsonl"
PACKAGES = ["torch", "transformers", "accelerate", "deepspeed", "peft", "datasets", "pyarrow", "bitsandbytes",
            "liger-kernel", "trl", "triton", "tokenizers", "huggingface-hub"]
SMALL_GPU = {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2}
SMALL_CPU = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}
# Llama-3.2-1B's backbone (untied head, the given tokenizer's vocabulary)
BIG = {"hidden_size": 2048, "num_layers": 16, "num_heads": 32, "num_kv_heads": 8, "intermediate_size": 8192,
       "max_position_embeddings": 4096}


@dataclass
class RunResult:
    out: Path
    losses: list[float]
    run: dict
    peak_memory_gib: float
    resumed_from: Optional[str]


@dataclass
class Context:
    out: Path
    work: Path
    smoke: bool
    gpu: bool
    workers: int
    deadline: float
    speed_steps: int
    commit: str
    lock: threading.RLock = field(default_factory=threading.RLock)  # RLock: the signal handler takes it too
    data: str = ""
    data_amount: str = "1.0"
    speed_data: str = ""
    tokenizer_file: Optional[str] = None
    small_model: Optional[Path] = None
    big_model: Optional[Path] = None
    steps: int = 8
    compare_trl: bool = True
    running: dict[str, float] = field(default_factory=dict)  # parts in progress: name -> start (monotonic)

    @property
    def speed_json(self) -> Path:
        return self.work / "speed.json"

    @classmethod
    def create(cls, args) -> "Context":
        import torch

        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        gpu = torch.cuda.is_available() and not args.smoke
        ctx = cls(out=out, work=Path(tempfile.mkdtemp(prefix="gpu_check_")), smoke=args.smoke, gpu=gpu,
                  workers=args.workers or (6 if gpu else 2), deadline=time.monotonic() + args.budget_s,
                  speed_steps=args.speed_steps, commit=args.commit or _commit())
        ctx.data = args.data or str(SAMPLE)
        ctx.data_amount = "256" if args.data else "1.0"
        ctx.tokenizer_file = args.tokenizer
        ctx.compare_trl = args.speed_compare == "trl"
        return ctx

    @property
    def train_dtype(self) -> str:
        return "bfloat16" if self.gpu else "float32"

    def tolerance(self, dtype: str) -> float:
        """How far two runs' losses that should be equal may be apart, relatively. bf16: their matmuls round
        differently and the difference grows over the steps; fp32 on a GPU (no TF32) and on CPU only by
        summation order."""
        return 2e-2 if dtype == "bfloat16" else 1e-4 if self.gpu else 1e-5

    def dtypes_with_tolerance(self) -> list[tuple[str, float]]:
        return [(dtype, self.tolerance(dtype)) for dtype in (("bfloat16", "float32") if self.gpu else ("float32",))]

    def env(self) -> dict[str, str]:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               "PYTHONUNBUFFERED": "1", "OPEN_SFT_CACHE": str(self.work / "cache")}
        if not self.gpu:
            env["DS_ACCELERATOR"] = "cpu"
            env["CUDA_VISIBLE_DEVICES"] = ""
        return env

    def describe_models(self) -> dict:
        return {"small": {**(SMALL_GPU if self.gpu else SMALL_CPU), "tokenizer": self.tokenizer_file or "embedded"},
                **({"speed": {**BIG, "tokenizer": self.tokenizer_file or "embedded"}} if self.big_model else {})}


def _commit() -> str:
    if os.environ.get("OPEN_SFT_COMMIT"):  # a copied tree's .git can be stale
        return os.environ["OPEN_SFT_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def importable(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def header(ctx: Context) -> dict:
    import torch

    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    gpu = {"name": None}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True)
        gpu = {"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
               "driver": smi.stdout.strip() or None, "cuda": torch.version.cuda,
               "capability": f"{props.major}.{props.minor}"}
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": ctx.commit,
            "mode": "smoke (CPU)" if ctx.smoke else "gpu" if ctx.gpu else "cpu", "gpu": gpu,
            "python": platform.python_version(), "cpu": platform.processor() or platform.machine(),
            "versions": versions}


# ------------------------------------------------------------------------------------------------------------
# models and data
# ------------------------------------------------------------------------------------------------------------
def _real_tokenizer(path: str):
    """A tokenizers JSON file as a transformers tokenizer with tulu's chat template (open-instruct's default)."""
    from transformers import PreTrainedTokenizerFast

    from open_sft.data.chat.templates import apply_chat_template_choice

    vocab = json.loads(Path(path).read_text())
    names = {t["content"] for t in vocab.get("added_tokens", [])} | set(vocab["model"].get("vocab", {}))
    eos = next(t for t in ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>") if t in names)
    pad = next((t for t in ("<|padding|>", "<pad>") if t in names), eos)
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=path, bos_token=eos, eos_token=eos, pad_token=pad)
    apply_chat_template_choice(tokenizer, "tulu", None)
    return tokenizer


def _save(model, tokenizer, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def prepare(ctx: Context, need_big: bool) -> None:
    from open_sft.embedded.factory import build_embedded_default, build_model

    if ctx.tokenizer_file:
        tokenizer = _real_tokenizer(ctx.tokenizer_file)
        ctx.small_model = _save(build_model(tokenizer, **SMALL_GPU), tokenizer, ctx.work / "small_model")
    else:
        shape = SMALL_GPU if ctx.gpu else SMALL_CPU
        ctx.small_model = build_embedded_default(ctx.work / "small_model", vocab_size=1024, **shape)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(ctx.small_model)
    ctx.speed_data = str(_messages_file(ctx.data, ctx.work / "speed_data.jsonl"))
    if need_big:
        import torch

        model = build_model(tokenizer, **BIG).to(torch.bfloat16)  # bf16 on disk: half the bytes to load
        ctx.big_model = _save(model, tokenizer, ctx.work / "big_model")


def _messages_file(data: str, out: Path) -> Path:
    """The rows as `messages` JSON Lines, the format both open_sft and TRL's SFTTrainer read."""
    from open_sft.data.formats import detect_format, to_messages

    path = Path(data)
    rows = json.loads(path.read_text()) if path.suffix == ".json" else [
        json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    fmt = detect_format(rows[0], str(path))
    with out.open("w") as handle:
        for row in rows:
            handle.write(json.dumps({"messages": list(to_messages(row, fmt))}) + "\n")
    return out


# ------------------------------------------------------------------------------------------------------------
# finetune.py launches
# ------------------------------------------------------------------------------------------------------------
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


def probe(ctx: Context, name: str, args: list[str], timeout: float = 300) -> dict:
    log = log_path(ctx, f"probe_{name}")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_probes.py"), name, *args], cwd=ROOT,
                          env=ctx.env(), capture_output=True, text=True, timeout=timeout)
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"probe {name}: exit {proc.returncode}: {proc.stderr.strip()[-1500:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
