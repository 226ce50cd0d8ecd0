"""The context of one GPU check: its options, where it works, the shapes of its models, the tolerance of two runs
that should agree, and the header of its report (device, versions, commit)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "open_sft" / "embedded" / "data" / "sample.jsonl"
PACKAGES = ["torch", "transformers", "accelerate", "deepspeed", "peft", "datasets", "pyarrow", "bitsandbytes",
            "liger-kernel", "trl", "triton", "tokenizers", "huggingface-hub", "torchao"]
SMALL_GPU = {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2}
SMALL_CPU = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}
# what the check tells a probe (tests/gpu_check/test_*.py, a pytest process of its own): see measure.py
FIGURES = "OPEN_SFT_GPU_CHECK_FIGURES"  # where the probe writes its figures (a JSON file)
SMOKE = "OPEN_SFT_GPU_CHECK_SMOKE"  # "1": CPU-sized shapes, "0": the GPU's; unset: CPU-sized without CUDA
MODEL = "OPEN_SFT_GPU_CHECK_MODEL"  # the model directory the packed probe loads (the check's small model)
# Llama-3.2-1B's backbone (untied head, the given tokenizer's vocabulary)
BIG = {"hidden_size": 2048, "num_layers": 16, "num_heads": 32, "num_kv_heads": 8, "intermediate_size": 8192,
       "max_position_embeddings": 4096}
# Llama-3.1-8B's (the LoRA and QLoRA shape users run most on one GPU; random init, the given tokenizer's vocabulary)
HUGE = {"hidden_size": 4096, "num_layers": 32, "num_heads": 32, "num_kv_heads": 8, "intermediate_size": 14336,
        "max_position_embeddings": 8192}


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
    speed_repeats: int = 1  # each speed configuration's runs, alternating (median and spread reported)
    lock: threading.RLock = field(default_factory=threading.RLock)  # RLock: the signal handler takes it too
    data: str = ""
    data_amount: str = "1.0"
    speed_data: str = ""
    tokenizer_file: Optional[str] = None
    small_model: Optional[Path] = None
    big_model: Optional[Path] = None
    huge_model: Optional[Path] = None
    steps: int = 8
    compare_trl: bool = True
    running: dict[str, float] = field(default_factory=dict)  # parts in progress: name -> start (monotonic)
    threads: Optional[int] = None  # CPU threads each process may use, while parts share the cores (cli.main)

    @classmethod
    def create(cls, args) -> "Context":
        import torch

        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        gpu = torch.cuda.is_available() and not args.smoke
        ctx = cls(out=out, work=Path(tempfile.mkdtemp(prefix="gpu_check_")), smoke=args.smoke, gpu=gpu,
                  workers=args.workers or (6 if gpu else 2), deadline=time.monotonic() + args.budget_s,
                  speed_steps=args.speed_steps, commit=args.commit or _commit(), speed_repeats=args.speed_repeats)
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
        if self.threads:  # finetune.py takes OPEN_SFT_NUM_THREADS over any launcher's; the rest take OMP's
            env["OPEN_SFT_NUM_THREADS"] = env["OMP_NUM_THREADS"] = str(self.threads)
        return env

    def describe_models(self) -> dict:
        return {"small": {**(SMALL_GPU if self.gpu else SMALL_CPU), "tokenizer": self.tokenizer_file or "embedded"},
                **({"speed": {**BIG, "tokenizer": self.tokenizer_file or "embedded"}} if self.big_model else {}),
                **({"speed_8b": {**HUGE, "tokenizer": self.tokenizer_file or "embedded"}} if self.huge_model else {})}


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

