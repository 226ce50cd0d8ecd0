"""Step metrics: the metrics.jsonl writer, model FLOPs for MFU, peak compute, peak memory."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import resource
import time
from pathlib import Path
from typing import Any, Optional

import torch

from open_sft.durable import refused_write
from open_sft.errors import UserError
from open_sft.model.anatomy import layer_values, text_config

logger = logging.getLogger(__name__)

# Dense 16-bit tensor-core peaks (FLOP/s) of common training GPUs, from the vendors' data sheets: bf16 (= fp16 on
# these), and fp16 for the V100 and T4, which have no bf16.
GPU_PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12,
                 "L4": 121e12, "B200": 2250e12, "MI300X": 1307e12, "V100": 125e12, "T4": 65e12}


def attention_width(config: Any) -> float:
    """Query heads × head size, the width of the attention scores' matmuls (the hidden size in most models; Qwen3's
    and Gemma's head size makes it another), averaged over the layers where they differ (Gemma 4's full-attention
    layers have twice its sliding layers' head size); 0 for a model without attention heads (Mamba, RWKV, xLSTM)."""
    latent = _latent_head_width(config)
    widths = [heads * (latent or head_dim or config.hidden_size // heads) if heads else 0 for heads, head_dim in
              zip(layer_values(config, "num_attention_heads"), layer_values(config, "head_dim"))]
    return sum(widths) / len(widths)


def _latent_head_width(config: Any) -> Optional[float]:
    """Multi-head latent attention's (DeepSeek-V2/V3, Kimi-K2, GLM-4.7-Flash, MiniCPM3): its scores are over
    qk_nope_head_dim + qk_rope_head_dim per head and its values v_head_dim wide (DeepSeek-V3: 192 and 128), while
    config.head_dim is the rope part alone (64); the mean of the two matmuls' widths. None for other attention."""
    sizes = [getattr(config, key, None) for key in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")]
    if all(isinstance(size, int) and size > 0 for size in sizes):
        return (sizes[0] + sizes[1] + sizes[2]) / 2
    return None


class FlopCounter:
    """Model FLOPs of a training step (forward + backward = 3 × forward), in two counts.

    `step_flops`, open_sft's strict count (`mfu`): what the step computes and no more: the decoder's matmuls on
    every token, attention scores per example and causal (half the square), the LM head on trained tokens only
    (the fused loss computes no other logits).

    `palm_flops`, the count of PaLM's MFU definition (Chowdhery et al. 2022, appendix B), which torchtitan,
    OLMo-core and nanochat report (`mfu_palm`): 6 × every matmul parameter (LM head included) on every token, and
    12 · layers · attention width · T per token for attention over the whole row of T tokens, non-causal. It is
    the count published MFU figures use, so a figure of ours can stand beside theirs; on a packed row of several
    examples it counts the attention the examples do not compute, so it reads higher than the strict one.
    Tokens are real tokens in both (padding excluded); LoRA's frozen weights count 6 per parameter as in peers'
    counts (their weight gradients are not computed: 4 would be strict). An MoE's routed experts count in both as
    the top-k a token runs (`backbone_params` from open_sft.model.anatomy.matmul_params), as torchtitan counts."""

    def __init__(self, config: Any, backbone_params: int, head_params: Optional[int] = None):
        config = text_config(config)  # a multimodal model's sizes are its text model's
        self.hidden = config.hidden_size
        self.layers = config.num_hidden_layers
        self.vocab = config.vocab_size
        self.attention = attention_width(config)
        self.backbone_params = backbone_params
        self.head_params = self.vocab * self.hidden if head_params is None else head_params

    def step_flops(self, tokens: int, trained_tokens: int, sum_squared_lengths: int) -> float:
        dense = 6 * self.backbone_params * tokens
        attention = 12 * self.layers * self.attention * sum_squared_lengths / 2  # causal: half the scores
        head = 6 * self.head_params * trained_tokens
        return float(dense + attention + head)

    def palm_flops(self, tokens: int, sum_squared_row_lengths: int) -> float:
        """Σ over tokens of 6N + 12·L·A·T, T the length of the token's row: Σ rows of 12·L·A·T²."""
        dense = 6 * (self.backbone_params + self.head_params) * tokens
        return float(dense + 12 * self.layers * self.attention * sum_squared_row_lengths)


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "open_sft"


def measure_cpu_peak(dtype: torch.dtype, sizes: tuple[int, ...] = (256, 512, 1024), seconds: float = 0.3) -> float:
    """Best FLOP/s of a linear layer (the op training spends its time in) this process reaches with its
    threads, over a few square sizes; cached per CPU kind (its model name and flags: a home directory can
    outlive the machine under it) and setting. `torch.mm` is not used: on CPUs without native bf16 its bf16
    path can be 10× slower than `F.linear`'s, which would put MFU over 100 %."""
    from open_sft.model.precision import cpu_flags, kernel_limits

    name, flags = cpu_flags()
    kind = hashlib.sha256(json.dumps([name, sorted(flags), kernel_limits()]).encode()).hexdigest()[:12]
    key = f"linear|{name}|{kind}|{torch.__version__}|{dtype}|{torch.get_num_threads()}"
    cache = _cache_dir() / "cpu_peak.json"
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    if key in known:
        return float(known[key])
    best = 0.0
    for size in sizes:
        x = torch.randn(size, size, dtype=dtype)
        weight = torch.randn(size, size, dtype=dtype)
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            torch.nn.functional.linear(x, weight)
            best = max(best, 2 * size**3 / (time.perf_counter() - start))
    known[key] = best
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(known))
    except OSError:
        pass  # a read-only home only costs a re-measure next time
    return best


def device_peak_flops(dtype: torch.dtype, on_fp32_kernels: bool = False) -> float:
    """The peak MFU is measured against: of the kernels that run, so fp32's for bf16 numerics on fp32 kernels
    (open_sft.model.bf16_matmul; the emulated bf16 peak would put MFU at several hundred per cent)."""
    if on_fp32_kernels:
        dtype = torch.float32
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        for model, peak in GPU_PEAK_BF16.items():
            if model in name:
                return peak if dtype != torch.float32 else peak / 2
        logger.warning("unknown GPU %r: MFU is reported against the A100 peak", name)
        return GPU_PEAK_BF16["A100"]
    return measure_cpu_peak(dtype)


def peak_memory_gib() -> float:
    """Peak device memory on CUDA (allocated); peak resident set size of this process on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is in KiB on Linux


def reserved_memory() -> dict[str, float]:
    """On CUDA, `peak_memory_reserved_gib`: the caching allocator's peak, what the device really held (allocated
    plus its cached blocks; what another process on the GPU could not have). Nothing on CPU."""
    if torch.cuda.is_available():
        return {"peak_memory_reserved_gib": torch.cuda.max_memory_reserved() / 2**30}
    return {}


class MetricsWriter:
    """Appends one JSON object per logging step to metrics.jsonl and forwards it to the trackers
    (main process only)."""

    def __init__(self, path: Path, tensorboard_dir: Optional[Path] = None, trackers: Optional[list] = None):
        from open_sft.monitor.tracking import TensorBoardTracker

        self.path = path
        self.trackers = list(trackers or [])
        if tensorboard_dir is not None:
            self.trackers.append(TensorBoardTracker(tensorboard_dir))

    @classmethod
    def for_run(cls, output_dir: Path, with_tracking: bool, report_to: Any,
                run_config: Optional[dict[str, Any]] = None, resume_step: int = 0,
                **wandb_options: Optional[str]) -> "MetricsWriter":
        """metrics.jsonl in output_dir, plus the --report_to trackers when --with_tracking is set."""
        from open_sft.monitor.tracking import build_trackers

        trackers = build_trackers(report_to, output_dir, run_config, resume_step,
                                  **wandb_options) if with_tracking else []
        return cls(output_dir / "metrics.jsonl", trackers=trackers)

    @classmethod
    def for_job(cls, job: Any, resume_step: int) -> "MetricsWriter":
        """A run's writer (an open_sft.run.Job); resuming from step N, the trackers continue the run after step N."""
        from open_sft.monitor.tracking import ignored_trackers

        t = job.config.train
        warning = ignored_trackers(t.with_tracking, t.report_to, job.config.explicit)
        if warning:
            logger.warning("%s", warning)
        return cls.for_run(job.output_dir, t.with_tracking, t.report_to, job.config.to_dict(), resume_step=resume_step,
                           name=t.exp_name, project=t.wandb_project_name, entity=t.wandb_entity)

    def write(self, record: dict[str, Any]) -> None:
        from open_sft.monitor.tracking import scalars_of

        whole = self.path.stat().st_size if self.path.exists() else 0
        try:
            with self.path.open("a", encoding="utf-8") as handle:
                handle.write(json.dumps(record) + "\n")
        except OSError as exc:  # a full disk, a mount gone read-only mid-run: the way out, not a traceback
            _cut_to(self.path, whole)
            refused = refused_write(exc, self.path)
            if refused is None:
                raise
            raise UserError(f"{refused[0]}: the metrics of step {record.get('step')} could not be appended to "
                            f"{self.path}; {refused[1]} and rerun the same command: it resumes from the newest "
                            "complete checkpoint (or step 0), dropping the lines logged after it") from exc
        if self.trackers:
            scalars = scalars_of(record)
            for tracker in self.trackers:
                tracker.log(scalars, step=record["step"])

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []


def _cut_to(path: Path, size: int) -> None:
    """Drops what a failed append wrote (the disk filled within the line): a torn last line broke every reader of the
    file (pandas, jq, `open_sft report`) until a resume rewrote it. Best effort: a read-only mount keeps it."""
    try:
        if path.exists() and path.stat().st_size > size:
            os.truncate(path, size)
    except OSError:
        pass


def per_source(names: list[str], loss_sums: list[float], tokens: list[int], prefix: str = "") -> dict[str, float]:
    """`loss/<source>` (token-weighted over the window; absent when the source trained no token in it) and
    `tokens/<source>` (its trained tokens), with `prefix` ("eval_") for evaluation."""
    record: dict[str, float] = {}
    for name, loss_sum, count in zip(names, loss_sums, tokens):
        if count:
            record[f"{prefix}loss/{name}"] = loss_sum / count
        record[f"{prefix}tokens/{name}"] = int(count)
    return record
