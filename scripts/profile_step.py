#!/usr/bin/env python
"""Where one training step's time goes, by kind of work, and the MFU that its matmul and attention kernels allow.

    python scripts/profile_step.py [--step 4] [--top 12] -- <finetune.py arguments>

Runs finetune.py in this process (one rank, no launcher) with the given arguments, profiles training step --step
(later steps than the first, so allocations and kernel caches are warm) with torch.profiler, and prints one JSON
line per kind of work: its share of the step's operator time and the seconds it took:

  lm_head_matmul      matmuls with a vocabulary-sized dimension (logits, hidden-state and weight gradients)
  lm_head_other       every other op over vocabulary-sized tensors (the loss's softmax passes, weight casts)
  backbone_matmul     the decoder's other matmuls
  attention           the attention kernels, forward and backward
  optimizer           the optimizer's kernels
  casts_copies        copies and dtype casts of activations
  elementwise_other   everything else: norms, rotary, SiLU, residual adds, reductions, collation

on a GPU, where the device waited on the host (`device_waited_before`: the host op that launched the work
ending each idle gap, summed), then a summary: the step's model FLOPs (the trainer's own count), the peak it
measures MFU against, the step's MFU under the profiler, and `mfu_ceiling_kernels`: the MFU the step would reach if only its matmul and attention
kernels took time, at the speed they ran here. That ceiling is what no change outside those kernels can
beat. torch.profiler has no grouping by kind of work (its tables group by op name and shape), hence this file.
The profiler adds a little time to every op: shares are sound, absolute seconds a little high. A figure holds for
the CPU kind it was measured on (the first line names it).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Iterable, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from benchmark import cpu_line  # noqa: E402  (the CPU line every benchmark prints)
from open_sft.config.whole_flags import WholeFlagParser  # noqa: E402

KINDS = ("lm_head_matmul", "lm_head_other", "backbone_matmul", "attention", "optimizer", "casts_copies",
         "elementwise_other")
MATMULS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addmm_", "aten::_addmm_activation",
           "aten::addbmm", "aten::_int_mm", "aten::mkldnn_linear", "aten::_mkldnn_linear"}
COPIES = {"aten::copy_", "aten::_to_copy", "aten::clone", "aten::contiguous", "aten::cat", "aten::constant_pad_nd",
          "aten::index_select", "aten::split_with_sizes_copy"}


def kind_of(name: str, shapes: Sequence[Sequence[int]], vocab: int) -> str:
    """The kind of work of one op, from its name and its inputs' shapes (pure: unit-tested)."""
    lowered = name.lower()
    over_vocab = any(vocab in tuple(shape) for shape in shapes if shape)
    if name in MATMULS:
        return "lm_head_matmul" if over_vocab else "backbone_matmul"
    if any(k in lowered for k in ("scaled_dot_product", "flash_attention", "efficient_attention", "varlen_attn",
                                  "flash_attn")):
        return "attention"
    if "adam" in lowered or "sgd" in lowered or lowered.startswith("aten::_foreach") or "optimizer" in lowered:
        return "optimizer"
    if over_vocab:
        return "lm_head_other"
    if name in COPIES:
        return "casts_copies"
    return "elementwise_other"


def breakdown(ops: Iterable[tuple[str, Sequence[Sequence[int]], float]], vocab: int) -> dict[str, float]:
    """Seconds per kind of work from (op name, input shapes, self seconds) triples."""
    seconds = Counter({kind: 0.0 for kind in KINDS})
    for name, shapes, self_seconds in ops:
        seconds[kind_of(name, shapes, vocab)] += self_seconds
    return dict(seconds)


def ceiling(flops: float, peak: float, seconds: dict[str, float]) -> float:
    """MFU if only the matmul and attention kernels took time, at the speed they ran."""
    kernels = seconds["lm_head_matmul"] + seconds["backbone_matmul"] + seconds["attention"]
    return flops / (peak * kernels) if kernels > 0 else float("nan")


# CUPTI's overhead records (its CUpti_ActivityOverheadKind names): kineto lists them beside the ops with a
# "device" time that is the profiler's or the host's wait, not a kernel's. "Command Buffer Full" is the host
# blocked on a full launch queue while the GPU works: counted, it put 0.12 s of device time into a 0.35 s H200
# step (device busy 120 %).
CUPTI_OVERHEAD = {"Unknown", "Driver Compiler", "Buffer Flush", "Instrumentation", "Resource",
                  "Runtime Triggered Module Loading", "Lazy Function Loading", "Command Buffer Full",
                  "Activity Buffer Request", "UVM Activity Init"}


def op_seconds(events, gpu: bool) -> list[tuple[str, list, float]]:
    """(op, input shapes, seconds) of the profiled ops: on CPU their own time; on a GPU the device time of the
    kernels each op launched, read off the op (host-side) events alone: the kernels' own events carry the same
    time again (counting both doubled it: the first H200 profile summed 0.61 s of device time in a 0.34 s step),
    and CUPTI's overhead records are no op's."""
    from torch.autograd import DeviceType

    def took(e) -> float:
        return getattr(e, "self_device_time_total", 0.0) if gpu else e.self_cpu_time_total

    chosen = [e for e in events if took(e) > 0 and (not gpu or (getattr(e, "device_type", None) == DeviceType.CPU
                                                                 and e.key not in CUPTI_OVERHEAD))]
    return [(e.key, e.input_shapes or [], took(e) / 1e6) for e in chosen]


DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCHES = ("cuda_runtime", "cuda_driver")


def idle_gaps(events: list[dict], top: int = 8) -> dict:
    """Where a GPU step's device waited on the host, from a Chrome trace of it (torch.profiler's export): the
    device's idle time between the first and the last kernel (the union of kernel, copy and set intervals),
    each gap put on the host op that launched the work ending it: the innermost CPU op around that launch (a
    kernel and its launch share a correlation id); and the host's time from the step's first op to its first
    kernel. Pure (unit-tested on a synthetic trace); trace times are µs."""
    work = sorted((e["ts"], e["ts"] + e.get("dur", 0), e.get("args", {}).get("correlation"))
                  for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_WORK)
    if not work:
        return {}
    launched = {e.get("args", {}).get("correlation"): e["ts"] for e in events
                if e.get("ph") == "X" and e.get("cat") in LAUNCHES}
    ops = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in events
                 if e.get("ph") == "X" and e.get("cat") == "cpu_op")

    def launcher(correlation) -> str:
        at = launched.get(correlation)
        around = [op for op in ops if at is not None and op[0] <= at <= op[1]]
        return min(around, key=lambda op: op[1] - op[0])[2] if around else "(not found)"

    waited: Counter = Counter()
    gaps: Counter = Counter()
    reach = work[0][1]
    for start, end, correlation in work[1:]:
        if start > reach:
            name = launcher(correlation)
            waited[name] += (start - reach) / 1e6
            gaps[name] += 1
        reach = max(reach, end)
    span = (reach - work[0][0]) / 1e6
    idle = sum(waited.values())
    lead = (work[0][0] - ops[0][0]) / 1e6 if ops and ops[0][0] < work[0][0] else 0.0
    return {"device_span_seconds": round(span, 6), "device_idle_seconds": round(idle, 6),
            "host_before_first_kernel_seconds": round(lead, 6),  # the step's start: collation, counts
            "idle_before": [{"op": name, "seconds": round(seconds, 6), "gaps": gaps[name]}
                            for name, seconds in waited.most_common(top)]}


class StepProfiler:
    """Wraps Trainer.train_step: step `at` runs under torch.profiler; the others as they are."""

    def __init__(self, at: int):
        self.at = at
        self.profile = None
        self.record: Optional[dict] = None
        self.trainer = None
        self.wall = 0.0

    def install(self) -> None:
        from open_sft.training.trainer import Trainer

        original = Trainer.train_step
        profiler = self

        def train_step(trainer, step: int) -> dict:
            if step != profiler.at:
                return original(trainer, step)
            import time

            import torch
            from torch.profiler import ProfilerActivity, profile

            gpu = torch.cuda.is_available()
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
            with profile(activities=activities, record_shapes=True) as prof:
                started = time.perf_counter()
                record = original(trainer, step)
                if gpu:
                    torch.cuda.synchronize()
                profiler.wall = time.perf_counter() - started
            profiler.profile, profiler.record, profiler.trainer = prof, record, trainer
            return record

        Trainer.train_step = train_step


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("usage: profile_step.py [--step N] [--top K] -- <finetune.py arguments>", file=sys.stderr)
        return 2
    split = argv.index("--")
    parser = WholeFlagParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--step", type=int, default=4, help="the step to profile (0-based; later ones are warm)")
    parser.add_argument("--top", type=int, default=12, help="also print the K ops that took longest")
    args = parser.parse_args(argv[:split])
    finetune_args = argv[split + 1:]

    from open_sft.run import main as finetune

    import torch

    gpu = torch.cuda.is_available()
    print(json.dumps({"gpu": torch.cuda.get_device_name()} if gpu else cpu_line()))
    profiler = StepProfiler(args.step)
    profiler.install()
    code = finetune(finetune_args)
    if code:
        return code
    if profiler.profile is None:
        print(f"error: the run ended before step {args.step}; give --max_train_steps above it", file=sys.stderr)
        return 2
    trainer = profiler.trainer
    vocab = trainer.flop_counter.vocab
    ops = op_seconds(profiler.profile.key_averages(group_by_input_shape=True), gpu)
    seconds = breakdown(ops, vocab)
    total = sum(seconds.values())
    for kind in KINDS:
        print(json.dumps({"kind": kind, "share": round(seconds[kind] / total, 4), "seconds": round(seconds[kind], 4)}))
    for op, shapes, took in sorted(ops, key=lambda o: -o[2])[: args.top]:
        print(json.dumps({"op": op, "shapes": shapes, "seconds": round(took, 4), "kind": kind_of(op, shapes, vocab)}))
    if gpu:  # where the device waited on the host, from the step's trace
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            trace = Path(tmp) / "trace.json"
            profiler.profile.export_chrome_trace(str(trace))
            waits = idle_gaps(json.loads(trace.read_text()).get("traceEvents", []), args.top)
        for wait in waits.pop("idle_before", []):
            print(json.dumps({"device_waited_before": wait["op"], "seconds": wait["seconds"], "gaps": wait["gaps"]}))
    flops, peak = profiler.record["flops"], trainer.peak_flops
    print(json.dumps({"step": args.step, "model_flops": flops, "peak_flops": peak, "op_seconds": round(total, 4),
                      "mfu_profiled": round(flops / (peak * total), 4),
                      "mfu_ceiling_kernels": round(ceiling(flops, peak, seconds), 4),
                      "step_wall_seconds": round(profiler.wall, 4),
                      # on a GPU: the share of the step's wall time the device was computing (the rest it waited
                      # for the host: launches, synchronisations, collation)
                      **({"device_busy": round(total / profiler.wall, 4)} if gpu and profiler.wall else {}),
                      **(waits if gpu else {})}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
