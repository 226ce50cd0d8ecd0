"""scripts/profile_step.py's sorting of profiled ops into kinds of work, and the MFU ceiling it derives."""

from __future__ import annotations

import math

import pytest

from conftest import load_script

profile_step = load_script("profile_step")

V = 50304


@pytest.mark.parametrize("name,shapes,kind", [
    ("aten::mm", [[256, 256], [256, V], [256, V]], "lm_head_matmul"),  # logits
    ("aten::mm", [[V, 1334], [1334, 256]], "lm_head_matmul"),  # weight gradient
    ("aten::addmm", [[V], [256, 256], [256, V]], "lm_head_matmul"),  # logits with a bias
    ("aten::mm", [[8192, 256], [256, 688]], "backbone_matmul"),
    ("aten::bmm", [[4, 160, 64], [4, 64, 160]], "backbone_matmul"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", [[1, 4, 160, 64]], "attention"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", [[1, 4, 160, 64]], "attention"),
    ("aten::_fused_adamw_", [[], []], "optimizer"),
    ("aten::_foreach_mul_", [[], []], "optimizer"),
    ("aten::_softmax", [[20, V], [], []], "lm_head_other"),
    ("aten::copy_", [[V, 256], [V, 256], []], "lm_head_other"),  # the head weight's cast
    ("aten::copy_", [[8, 1024, 256], [8, 1024, 256], []], "casts_copies"),
    ("aten::cat", [[]], "casts_copies"),
    ("aten::mul", [[8, 1024, 256], [8, 1024, 256]], "elementwise_other"),
    ("aten::rsqrt", [[8, 1024, 1]], "elementwise_other"),
    ("aten::mm", [], "backbone_matmul"),  # no shapes recorded
])
def test_kind_of(name, shapes, kind) -> None:
    assert profile_step.kind_of(name, shapes, V) == kind


def test_breakdown_sums_every_op_into_one_kind() -> None:
    ops = [("aten::mm", [[256, 256], [256, V]], 0.5), ("aten::mm", [[8192, 256], [256, 688]], 0.25),
           ("aten::_scaled_dot_product_flash_attention_for_cpu", [[1, 4, 64, 64]], 0.125),
           ("aten::mul", [[8, 256]], 0.0625), ("aten::mm", [[256, V], [V, 256]], 0.5)]
    seconds = profile_step.breakdown(ops, V)
    assert set(seconds) == set(profile_step.KINDS)
    assert seconds["lm_head_matmul"] == 1.0 and seconds["backbone_matmul"] == 0.25
    assert seconds["attention"] == 0.125 and seconds["elementwise_other"] == 0.0625
    assert sum(seconds.values()) == pytest.approx(sum(o[2] for o in ops))


def test_ceiling_counts_only_matmul_and_attention_time() -> None:
    seconds = dict.fromkeys(profile_step.KINDS, 0.0)
    seconds.update(lm_head_matmul=1.0, backbone_matmul=0.5, attention=0.5, elementwise_other=3.0)
    # 2 s of kernels at a peak of 100 FLOP/s: 140 FLOPs are 70 % of what they could have done
    assert profile_step.ceiling(140.0, 100.0, seconds) == pytest.approx(0.7)
    assert math.isnan(profile_step.ceiling(1.0, 1.0, dict.fromkeys(profile_step.KINDS, 0.0)))  # no kernels seen


def test_gpu_device_time_is_read_off_the_op_events_alone() -> None:
    """A CUDA profile lists each kernel's time twice, on the op that launched it and on the kernel's own event:
    only the op events count (the H200 profile that summed both reported a device busy 181 % of the step)."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def event(key, device_type, device_us, cpu_us=5.0):
        return SimpleNamespace(key=key, device_type=device_type, self_device_time_total=device_us,
                               self_cpu_time_total=cpu_us, input_shapes=[[4, 8]])

    events = [event("aten::mm", DeviceType.CPU, 300.0), event("nvjet_sm90_tst_128x256", DeviceType.CUDA, 300.0),
              event("aten::add", DeviceType.CPU, 20.0), event("void elementwise_kernel<add>", DeviceType.CUDA, 20.0),
              event("aten::view", DeviceType.CPU, 0.0), event("Command Buffer Full", DeviceType.CPU, 115_500.0)]
    # CUPTI's "Command Buffer Full" (the host waiting on a full launch queue) is no op: the H200 step of 0.354 s
    # that counted it summed 0.425 s of device time
    assert profile_step.op_seconds(events, gpu=True) == [("aten::mm", [[4, 8]], 300e-6), ("aten::add", [[4, 8]], 20e-6)]
    assert [name for name, _, _ in profile_step.op_seconds(events, gpu=False)] == [e.key for e in events]


def test_idle_gaps_put_each_wait_of_the_device_on_the_host_op_that_ended_it() -> None:
    """A synthetic Chrome trace of a GPU step (µs): the host collates for 40 before the first kernel; kernels
    1-2 overlap, then the device idles 30 until aten::item's sync lets the host launch kernel 3 (from
    aten::add, inside the optimizer's op), and 5 more before a copy launched by aten::copy_ through the driver."""
    def op(name, ts, dur):
        return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur}

    def launch(ts, correlation, cat="cuda_runtime"):
        return {"ph": "X", "cat": cat, "name": "cudaLaunchKernel", "ts": ts, "dur": 2, "args": {"correlation": correlation}}

    def work(ts, dur, correlation, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": f"k{correlation}", "ts": ts, "dur": dur, "args": {"correlation": correlation}}

    events = [op("collate", 0, 40), op("aten::mm", 40, 10), launch(42, 1), work(45, 50, 1),
              launch(48, 2), work(60, 50, 2),  # overlaps the first: no gap
              op("aten::item", 60, 75), op("Optimizer.step", 136, 20), op("aten::add", 138, 5), launch(139, 3),
              work(140, 10, 3), op("aten::copy_", 152, 6), launch(153, 4, "cuda_driver"),
              work(155, 5, 4, "gpu_memcpy"), {"ph": "i", "cat": "kernel", "ts": 0}]
    waits = profile_step.idle_gaps(events)
    assert waits["device_span_seconds"] == pytest.approx(115e-6)
    assert waits["device_idle_seconds"] == pytest.approx(35e-6)
    assert waits["host_before_first_kernel_seconds"] == pytest.approx(45e-6)
    assert waits["idle_before"] == [{"op": "aten::add", "seconds": 3e-05, "gaps": 1},
                                    {"op": "aten::copy_", "seconds": 5e-06, "gaps": 1}]
    assert profile_step.idle_gaps([op("aten::mm", 0, 5)]) == {}  # a CPU profile: no device work
