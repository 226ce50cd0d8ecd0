"""The measured CPU peak behind MFU is cached per CPU kind, not per architecture name."""

import json

import torch

from open_sft.model import precision
from open_sft.monitor import metrics


def test_peak_is_cached_per_cpu_kind(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    kinds = {"amx": ("Intel Xeon", {"avx2", "amx_bf16"}), "avx2": ("Intel Xeon", {"avx2"})}
    monkeypatch.setattr(precision, "cpu_flags", lambda: kinds[current])
    current = "amx"
    first = metrics.measure_cpu_peak(torch.float32, sizes=(32,), seconds=0.01)
    assert first > 0
    cache = tmp_path / "open_sft" / "cpu_peak.json"
    entries = json.loads(cache.read_text())
    assert len(entries) == 1
    # A planted value for this kind is what comes back: the cache is read, not re-measured.
    entries[next(iter(entries))] = 123.0
    cache.write_text(json.dumps(entries))
    assert metrics.measure_cpu_peak(torch.float32, sizes=(32,), seconds=0.01) == 123.0
    # The same home on a CPU of another kind (same model name, other flags) measures its own peak.
    current = "avx2"
    assert metrics.measure_cpu_peak(torch.float32, sizes=(32,), seconds=0.01) != 123.0
    assert len(json.loads(cache.read_text())) == 2


def test_peak_under_limited_kernels_is_its_own(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(precision, "cpu_flags", lambda: ("AMD EPYC", {"avx2", "avx512_bf16"}))
    for name in precision.KERNEL_LIMITS:
        monkeypatch.delenv(name, raising=False)
    metrics.measure_cpu_peak(torch.float32, sizes=(32,), seconds=0.01)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    metrics.measure_cpu_peak(torch.float32, sizes=(32,), seconds=0.01)
    keys = list(json.loads((tmp_path / "open_sft" / "cpu_peak.json").read_text()))
    assert len(keys) == 2 and keys[0] != keys[1]


def test_bf16_on_fp32_kernels_is_measured_against_the_fp32_peak(monkeypatch):
    monkeypatch.setattr(metrics.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(metrics, "measure_cpu_peak", lambda dtype: {torch.float32: 200e9, torch.bfloat16: 20e9}[dtype])
    assert metrics.device_peak_flops(torch.bfloat16) == 20e9
    assert metrics.device_peak_flops(torch.bfloat16, on_fp32_kernels=True) == 200e9
