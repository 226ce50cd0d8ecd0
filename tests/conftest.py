"""Shared fixtures: offline environment, the tiny embedded model, and a runner for finetune.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable

import pytest

# An accidental download must fail loudly, not hang or pass by luck.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Under pytest-xdist (scripts/test.sh runs the suite on one worker per core), this worker is one of
# WORKER_COUNT sharing the machine's cores: it and the processes it starts use its share of them, as a
# launched rank uses its share (a user's own OMP_NUM_THREADS is kept).
WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:])
WORKER_COUNT = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKER_COUNT > 1 and "OMP_NUM_THREADS" not in os.environ:
    from open_sft.distributed.env import usable_cpus

    os.environ["OMP_NUM_THREADS"] = str(max(1, usable_cpus() // WORKER_COUNT))

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
SAMPLE = ROOT / "open_sft" / "embedded" / "data" / "sample.jsonl"
FINETUNE = ROOT / "finetune.py"
DS_CONFIGS = ROOT / "configs" / "ds"
INTEGRATION = TESTS / "integration"


def pytest_collection_modifyitems(items) -> None:
    """Every test under tests/integration/ (the ones that launch real processes) carries the integration
    marker, so `./scripts/test.sh -m "not integration"` is the fast loop."""
    for item in items:
        if INTEGRATION in item.path.parents:
            item.add_marker(pytest.mark.integration)


def pytest_runtest_setup(item) -> None:
    """A test marked gpu runs where CUDA is, and is skipped, saying why, where it is not."""
    if item.get_closest_marker("gpu") is not None:
        import torch

        if not torch.cuda.is_available():
            pytest.skip("needs CUDA")


@pytest.fixture(scope="session", autouse=True)
def tokenization_cache(tmp_path_factory) -> Path:
    """One tokenization cache for the session (runs in subprocesses inherit it through the environment)."""
    path = tmp_path_factory.mktemp("tokenization_cache")
    os.environ["OPEN_SFT_CACHE"] = str(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The embedded default at test size, built once per session by the project's own factory."""
    from open_sft.embedded.factory import build_embedded_default

    out = tmp_path_factory.mktemp("tiny_model")
    return build_embedded_default(out, vocab_size=1024, hidden_size=64, num_layers=2, seed=0)


_PORTS_LOCK = threading.Lock()
_PORTS_BELOW = 32768  # Linux's default ephemeral range starts here: gloo's own sockets and bind(0) take ports above
_PORTS_FROM = 20000
_next_port = _PORTS_FROM + WORKER * ((_PORTS_BELOW - _PORTS_FROM) // WORKER_COUNT)


def load_script(name: str) -> Any:
    """scripts/<name>.py as a module (the scripts are not a package): its functions, for the tests of them."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    """A free port for a launch's rendezvous that no launch of this session was given before (launches may run
    side by side: see side_by_side), and that no other xdist worker can give: each worker scans its own block of
    the ports below the kernel's ephemeral range, so no socket the kernel numbers (a rank's gloo pair) takes it."""
    global _next_port
    with _PORTS_LOCK:
        while True:
            port, _next_port = _next_port, _next_port + 1
            with socket.socket() as sock:
                try:
                    sock.bind(("", port))
                except OSError:
                    continue
            return port


# torchao for the --fp8 tests: scripts/_venv.sh installs it beside the venv, not in it (transformers would import it
# in every process); only the processes of the FP8 tests see it, with the CPU stand-in of FP8 matmuls allowed.
FP8_SITE = Path(sys.prefix) / "fp8-site"


def fp8_env(**extra: str) -> dict[str, str]:
    """child_env for a process that trains with --fp8 on this CPU (torchao on its path, the stand-in allowed)."""
    if not (FP8_SITE / "torchao").is_dir():
        pytest.fail(f"torchao is not in {FP8_SITE}: ./scripts/test.sh installs it there (the FP8 tests need it)")
    path = os.pathsep.join(filter(None, [str(FP8_SITE), str(ROOT), os.environ.get("PYTHONPATH")]))
    return child_env(PYTHONPATH=path, OPEN_SFT_FP8_ON_CPU="1", **extra)


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a launched process: offline, on CPU, importing this checkout's open_sft first (a script
    run from tmp_path, or `python -m open_sft`, would otherwise import whatever copy the venv installed: another
    checkout's, where a venv is shared)."""
    env = dict(os.environ)
    env.update({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "DS_ACCELERATOR": "cpu",
                "OPEN_SFT_RECORD_DATA_ORDER": "1", "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join([str(ROOT)] + ([os.environ["PYTHONPATH"]]
                                                               if os.environ.get("PYTHONPATH") else []))})
    env.update(extra)
    return env


def launch_command(processes: int, deepspeed_config: str | None) -> list[str]:
    """`python finetune.py` for one process, else `accelerate launch` with real ranks."""
    if processes == 1 and deepspeed_config is None:
        return [sys.executable, str(FINETUNE)]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(processes),
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(free_port())]
    if deepspeed_config is not None:
        cmd += ["--use_deepspeed", "--deepspeed_config_file", str(DS_CONFIGS / deepspeed_config)]
    else:
        cmd += ["--multi_gpu"]
    return cmd + [str(FINETUNE)]


def fsdp_command(launch: list[str] | None = None, processes: int = 2) -> list[str]:
    """`accelerate launch` of FSDP2 ranks: `launch` (default: configs/accelerate/fsdp2.yaml) on `processes`."""
    launch = ["--config_file", str(ROOT / "configs" / "accelerate" / "fsdp2.yaml")] if launch is None else launch
    return [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(processes),
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(free_port()), *launch, str(FINETUNE)]


def run_finetune(args: list[str], processes: int = 1, deepspeed_config: str | None = None,
                 timeout: int = 600, check: bool = True, env: dict[str, str] | None = None,
                 launch: list[str] | None = None) -> subprocess.CompletedProcess:
    """finetune.py with `args`, launched by launch_command(processes, deepspeed_config) or `launch`."""
    command = launch_command(processes, deepspeed_config) if launch is None else launch
    result = subprocess.run(command + args, cwd=ROOT, env=child_env() if env is None else env,
                            capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"finetune failed ({result.returncode}):\n{result.stdout[-4000:]}\n{result.stderr[-6000:]}")
    return result


GIB_PER_RANK = 1.0  # what side_by_side keeps free per rank of the two launches (a tiny-model rank peaks ~0.6 GiB)


def one_thread_per_rank(processes: int) -> bool:
    """Whether each rank of a launch of `processes` runs on one thread (open_sft gives a launched rank its share
    of the usable cores, at least one): then the rank's numbers do not depend on what else runs beside it."""
    from open_sft.distributed.env import usable_cpus

    return processes > 1 and usable_cpus() // processes <= 1


def side_by_side(launches: dict[str, Callable[[], Any]], processes: int) -> dict[str, Any]:
    """name -> launch() for independent launches of `processes` ranks each: two at a time where every rank runs on
    one thread anyway (2 ranks on the suite's 2 cores), else one after the other. Each rank computes what it
    computes alone (the same threads, data and seeds: only the timings change); side by side, one launch's start-up (the
    launcher's and the ranks' imports, single-threaded) fills the cores the other leaves idle. Never with
    single-process launches: those use every core, and two of them spun against each other; nor where memory
    is short for both (GIB_PER_RANK)."""
    import psutil

    room = psutil.virtual_memory().available >= 2 * processes * GIB_PER_RANK * 2**30
    if not (one_thread_per_rank(processes) and room):
        return {name: launch() for name, launch in launches.items()}
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(launch) for name, launch in launches.items()}
        return {name: future.result() for name, future in futures.items()}


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


# The shape of the HF Trainer docs' ZeRO-3 example (optimizer and scheduler sections, "auto" everywhere).
TRAINER_JSON = {
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto", "warmup_min_lr": "auto",
                                                      "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                          "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto",
                          "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto", "steps_per_print": 1e5, "wall_clock_breakdown": False,
}


def assert_png(path: Path) -> None:
    """A real 700×400 chart: PNG signature, decodable, more than a blank canvas."""
    from PIL import Image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 5_000
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        assert image.size == (700, 400)
        assert len(image.convert("L").getcolors(maxcolors=1 << 16)) > 10  # a drawn chart, not a blank canvas
