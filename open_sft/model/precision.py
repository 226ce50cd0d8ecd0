"""`--torch_dtype auto`: the fast, correct compute dtype for the hardware the run lands on.

bf16 on a GPU that supports it. On a CPU, bf16 only where the CPU has native bf16 instructions
(avx512_bf16, AMX, Arm's bf16) *and* a short probe of the model's own matmul shapes measures it faster
than fp32: without them bf16 GEMMs are emulated (on AVX2, bf16 `F.linear` runs ~6× and bf16 `torch.mm`
~150× slower than fp32), and even with them the gain depends on the shapes. The probe times a forward
`F.linear` and the weight-gradient `torch.mm` of each shape (training runs both) and is cached per
machine, so the ranks of a node measure once and agree.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from open_sft.model import bf16_matmul

logger = logging.getLogger(__name__)

CACHE_ENV = "OPEN_SFT_DTYPE_CACHE_DIR"
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # x86 flags / Arm "Features"
# bf16 must beat fp32 by this much: a near tie is not worth bf16's rounding, and the margin keeps timing
# noise (these machines are shared) from flipping the choice between runs.
MARGIN = 1.15
PROBE_TOKENS = 128
MAX_DIM = 1024  # shapes capped: on one thread the probe takes 0.3 s, 0.8 s where bf16 is emulated (AVX2)
PROBE_VERSION = 3  # 2: alternating rounds (entries of single measurements may hold a burst of load); 3: only
#                     steady probes, measured on one thread, are cached (version 2 entries may hold a load that
#                     slowed every round of a dtype)


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str
    measured: Optional[dict[str, Any]] = None
    bf16_via_fp32: bool = False  # bf16 numerics on fp32 kernels (open_sft.model.bf16_matmul)

    def to_dict(self) -> dict[str, Any]:
        return {"dtype": str(self.dtype).removeprefix("torch."), "reason": self.reason, "measured": self.measured,
                "bf16_matmuls_via_fp32": self.bf16_via_fp32}


def cpu_flags() -> tuple[str, set[str]]:
    """(CPU model name, its feature flags) from /proc/cpuinfo; ("", set()) where there is none."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip().lower()
            if key in ("model name", "cpu model") and name in ("", platform.machine()):
                name = value.strip()
            elif key in ("flags", "features") and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return name, flags


# Settings that hold torch's and oneDNN's kernels below what the CPU offers: a measurement taken under
# them is for another machine kind, so they are part of every cached measurement's key.
KERNEL_LIMITS = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "DNNL_MAX_CPU_ISA")


def kernel_limits() -> dict[str, str]:
    return {k: os.environ[k] for k in KERNEL_LIMITS if k in os.environ}


def probe_shapes(args: Any) -> list[tuple[int, int]]:
    """(in, out) of the model's attention projection, MLP up projection and an LM-head chunk, capped."""
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(args.config_name or args.model_name_or_path, revision=args.model_revision,
                                            trust_remote_code=args.trust_remote_code)
        config = getattr(config, "text_config", config)
        hidden = int(config.hidden_size)
        inner = int(getattr(config, "intermediate_size", None) or 4 * hidden)
        vocab = int(config.vocab_size)
    except Exception:  # the loader reports a bad model path with its own error; probe generic shapes here
        hidden, inner, vocab = 1024, 4096, 32000
    hidden = min(hidden, MAX_DIM)
    return [(hidden, hidden), (hidden, min(inner, MAX_DIM)), (hidden, min(vocab, MAX_DIM))]


def measure_gflops(shapes: list[tuple[int, int]], dtype: torch.dtype) -> float:
    """Best of 3 timings of forward F.linear + weight-gradient mm over the shapes, in GFLOP/s."""
    gen = torch.Generator().manual_seed(0)
    ops = []
    for n_in, n_out in shapes:
        x = torch.randn(PROBE_TOKENS, n_in, generator=gen).to(dtype)
        w = torch.randn(n_out, n_in, generator=gen).to(dtype)
        g = torch.randn(PROBE_TOKENS, n_out, generator=gen).to(dtype)
        ops.append((x, w, g))

    def step() -> None:
        for x, w, g in ops:
            F.linear(x, w)
            torch.mm(g.t(), x)

    step()  # warm-up: kernel selection, page faults
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - started)
    flops = sum(2 * 2 * PROBE_TOKENS * n_in * n_out for n_in, n_out in shapes)
    return flops / max(best, 1e-9) / 1e9


PROBE_ROUNDS = 2
PROBE_MAX_ROUNDS = 5
STEADY_RATIO = 1.25


def _rate(gflops: float) -> str:
    """A probe rate for a message: whole GFLOP/s, a decimal below 10 (a tiny model's shapes, emulated bf16)."""
    return f"{gflops:.0f}" if gflops >= 10 else f"{gflops:.1f}"


def _steady(rates: list[float]) -> bool:
    """Two measurements of a dtype that agree: load only ever slows a measurement, so the best two within
    STEADY_RATIO of each other are this CPU's rate, not one lucky gap in someone else's work."""
    best, second = sorted(rates, reverse=True)[:2]
    return best <= STEADY_RATIO * max(second, 1e-9)


def _interleaved(measure: Callable[[list[tuple[int, int]], torch.dtype], float],
                 shapes: list[tuple[int, int]]) -> tuple[float, float, bool]:
    """The best bf16 and fp32 rates of alternating measurements, and whether they were steady: a burst of load
    from another process (a shared node, a data-loading worker, two OpenMP threads on a core another process
    holds: rates fall 100x) slows whichever dtype it lands on, and the result is cached, so one dtype measured
    under it and the other not would decide the run's dtype on the load, not the CPU. PROBE_ROUNDS rounds, more
    (up to PROBE_MAX_ROUNDS) until each dtype's best two agree. On one thread: the ratio of the two is the
    core's (its instructions), and OpenMP threads that wait for each other at every small matmul while another
    process holds a core measured the load instead (bf16 6 vs fp32 3 GFLOP/s where an idle core gives 180 vs 80)."""
    rates: dict[torch.dtype, list[float]] = {torch.bfloat16: [], torch.float32: []}
    steady, threads = False, torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for done in range(PROBE_MAX_ROUNDS):
            for dtype, seen in rates.items():
                seen.append(measure(shapes, dtype))
            steady = done + 1 >= PROBE_ROUNDS and all(_steady(seen) for seen in rates.values())
            if steady:
                break
    finally:
        torch.set_num_threads(threads)
    return max(rates[torch.bfloat16]), max(rates[torch.float32]), steady


def _cache_path() -> Path:
    root = os.environ.get(CACHE_ENV) or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "open_sft"
    return Path(root) / "dtype_probe.json"


@contextlib.contextmanager
def _locked(path: Path):
    """Yields whether the cache can be used. A home that is not writable (a container's user, a read-only
    home) costs the probe's fraction of a second per start, not the run."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path.with_suffix(".lock"), "a")
    except OSError as exc:
        logger.warning("the dtype probe cannot cache its result in %s (%s): measuring each start; set %s to a "
                       "writable directory", path.parent, exc.strerror or exc, CACHE_ENV)
        yield False
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # the ranks of a node probe one at a time: the first one measures
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _launch() -> Optional[str]:
    """This multi-process launch on this node (the launcher that started its ranks, its rendezvous port): its ranks
    share a probe that other load disturbed (each measuring alone could choose another dtype, which the ranks'
    check refuses); None for one process, which decides alone."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1:
        return None
    return f"{os.getppid()}:{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"


def probe(shapes: list[tuple[int, int]], cpu: str, flags: set[str],
          measure: Callable[[list[tuple[int, int]], torch.dtype], float] = measure_gflops) -> dict[str, Any]:
    """The bf16 and fp32 throughput of the shapes on this machine, from the cache or measured once."""
    limits = kernel_limits()
    key_text = json.dumps([PROBE_VERSION, cpu, sorted(flags), torch.__version__, shapes,
                           *([limits] if limits else [])])  # without limits, the keys entries already have
    key = hashlib.sha256(key_text.encode()).hexdigest()[:16]
    path = _cache_path()
    with _locked(path) as cached:
        try:
            entries = json.loads(path.read_text()) if cached else {}
            if not isinstance(entries, dict):
                raise ValueError("not a mapping")
        except (OSError, ValueError):  # absent, unreadable or damaged: measure again
            entries = {}
        entry, launch = entries.get(key), _launch()
        if isinstance(entry, dict) and {"bf16_gflops", "fp32_gflops"} <= set(entry) and (
                entry.get("steady", True) or (launch is not None and entry.get("launch") == launch)):
            return {**entry, "cached": True}
        started = time.perf_counter()
        bf16, fp32, steady = _interleaved(measure, shapes)
        result = {"bf16_gflops": round(bf16, 1), "fp32_gflops": round(fp32, 1),
                  "shapes": [list(s) for s in shapes], "threads": 1, "cpu": cpu}
        result["probe_seconds"] = round(time.perf_counter() - started, 3)
        if not steady:
            logger.warning("the bf16/fp32 probe was disturbed by other load on this machine (its %d rounds "
                           "disagree): this %s decides on the best rates measured (bf16 %s, fp32 %s GFLOP/s); "
                           "%s", PROBE_MAX_ROUNDS, "start" if launch is None else "launch", _rate(bf16), _rate(fp32),
                           "they are not cached, the next start measures again" if launch is None else
                           "they are kept for this launch's ranks only, the next launch measures again")
            result.update(steady=False, launch=launch)
        entries[key] = result
        if cached and (steady or launch is not None):
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(entries, indent=1))
            os.replace(tmp, path)
    return {**result, "cached": False}


def _requested_bf16(args: Any, cpu: str, flags: set[str],
                    measure: Callable[[list[tuple[int, int]], torch.dtype], float]) -> DtypeChoice:
    """--torch_dtype bfloat16 on a CPU: where the probe measures bf16 matmuls slower than fp32 (no native
    bf16), they run on fp32 kernels with bf16 rounding (OPEN_SFT_BF16_MATMULS=native|fp32 forces a side)."""
    mode = bf16_matmul.mode_from_env()
    measured = probe(probe_shapes(args), cpu, flags, measure)
    bf16, fp32 = measured["bf16_gflops"], measured["fp32_gflops"]
    via_fp32 = mode == "fp32" or (mode == "auto" and fp32 > bf16)
    if fp32 > bf16:
        logger.warning("--torch_dtype bfloat16: this CPU's bf16 matmul kernels measured %.1f× slower than fp32 (%s vs "
                       "%s GFLOP/s on the model's shapes)%s; --torch_dtype auto would train in float32",
                       fp32 / max(bf16, 1e-9), _rate(bf16), _rate(fp32),
                       "; they run as fp32 matmuls of bf16-rounded values (the same bf16 numerics)" if via_fp32
                       else f" and {bf16_matmul.ENV}=native keeps them")
    how = "bf16 matmuls on fp32 kernels" if via_fp32 else "native bf16 matmuls"
    probed = f"probe: bf16 {_rate(bf16)} vs fp32 {_rate(fp32)} GFLOP/s"
    why = f"{bf16_matmul.ENV}={mode}" if mode != "auto" else probed
    return DtypeChoice(torch.bfloat16, f"requested by --torch_dtype; {how} ({why})", measured, via_fp32)


def _requested_fp16() -> DtypeChoice:
    """--torch_dtype float16. It is meant for GPUs without bf16; a CPU without fp16 instructions (AVX512-FP16,
    AMX-FP16) emulates fp16 matmuls, so say that bf16 or fp32 would serve better there."""
    if not torch.cuda.is_available():
        _, flags = cpu_flags()
        if not flags & {"avx512_fp16", "amx_fp16"}:
            logger.warning("--torch_dtype float16 on a CPU without fp16 instructions (no avx512_fp16 or amx_fp16): "
                           "fp16 matmuls are emulated and slower than float32; --torch_dtype auto picks the fast "
                           "dtype here")
    return DtypeChoice(torch.float16, "requested by --torch_dtype; dynamic loss scaling, fp32 master weights")


# --torch_dtype's explicit values (auto is resolved by choose_dtype).
FLAG_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
               "float32": torch.float32, "fp32": torch.float32}


def stored_dtype(config: Any) -> torch.dtype:
    """The dtype a checkpoint's config says its weights are stored in (`dtype`, or the older `torch_dtype`);
    float32 where it names none."""
    named = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(named, str):
        named = FLAG_DTYPES.get(named.removeprefix("torch."))
    return named if named in (torch.bfloat16, torch.float16, torch.float32) else torch.float32


COMPUTE_DTYPE_KEY = "compute_dtype"  # in the config a checkpoint saves: the dtype the run resolved


def resumed_choice(state: Optional[dict[str, Any]]) -> Optional[DtypeChoice]:
    """--torch_dtype auto on a resume: the compute dtype the checkpoint's run resolved (the probe, rerun on
    another node or with other threads per rank, could pick another one mid-run); None for a fresh start or a
    checkpoint that predates the record."""
    saved = ((state or {}).get("config") or {}).get(COMPUTE_DTYPE_KEY)
    if saved not in FLAG_DTYPES:
        return None
    return DtypeChoice(FLAG_DTYPES[saved], f"auto: {saved}, as the run resumed here resolved it (its checkpoint "
                                           "records it; a run keeps its compute dtype)")


def choose_dtype(args: Any, qlora: bool = False,
                 measure: Callable[[list[tuple[int, int]], torch.dtype], float] = measure_gflops) -> DtypeChoice:
    """--torch_dtype resolved, with the reason (and the probe's numbers on a CPU)."""
    wanted = args.torch_dtype
    requested = FLAG_DTYPES.get(wanted)
    if requested == torch.float32:
        return DtypeChoice(torch.float32, "requested by --torch_dtype")
    # torch counts bf16 that a GPU only emulates (T4, V100: no bf16 units before Ampere, compute capability 8.0) as
    # supported by default: those run bf16 slowly, and fp16 natively
    gpu_without_bf16 = torch.cuda.is_available() and not torch.cuda.is_bf16_supported(including_emulation=False)
    if requested == torch.float16:
        return _requested_fp16()
    if gpu_without_bf16 and wanted == "auto":
        return DtypeChoice(torch.float16, "auto: float16 with dynamic loss scaling (this GPU has no bf16 units; "
                                          "torch would emulate bf16, slowly)")
    if qlora and wanted == "auto":
        return DtypeChoice(torch.bfloat16, "auto: bfloat16 — QLoRA's 4-bit base computes in bf16")
    if torch.cuda.is_available():
        emulated = " (this GPU has no bf16 units: torch emulates it, slowly; float16 runs natively)" \
            if gpu_without_bf16 else ""
        return DtypeChoice(torch.bfloat16, f"requested by --torch_dtype{emulated}" if wanted != "auto" else
                           "auto: bfloat16 (the GPU supports it)")
    cpu, flags = cpu_flags()
    native = bool(flags & set(NATIVE_BF16_FLAGS))
    if requested == torch.bfloat16:
        return _requested_bf16(args, cpu, flags, measure)
    if not native and flags:
        return DtypeChoice(torch.float32, "auto: float32 — this CPU has no native bf16 (no avx512_bf16, amx_bf16 "
                                          "or bf16 flag): bf16 matmuls would be emulated")
    measured = probe(probe_shapes(args), cpu, flags, measure)
    bf16, fp32 = measured["bf16_gflops"], measured["fp32_gflops"]
    faster = bf16 >= MARGIN * fp32
    return DtypeChoice(torch.bfloat16 if faster else torch.float32,
                       f"auto: {'bfloat16' if faster else 'float32'} — probe of the model's matmul shapes: bf16 "
                       f"{_rate(bf16)} vs fp32 {_rate(fp32)} GFLOP/s (bf16 chosen at ≥ {MARGIN}× fp32)", measured)
