"""--torch_dtype auto: bf16 only where the hardware runs it faster, decided by a cached probe."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from open_sft.model import precision
from open_sft.config.args import ModelArguments
from open_sft.model.precision import choose_dtype


@pytest.fixture(autouse=True)
def probe_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(precision.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    return tmp_path / "dtype_probe.json"


def on_cpu(monkeypatch, flags: set[str]) -> None:
    monkeypatch.setattr(precision, "cpu_flags", lambda: ("Test CPU", flags))


def fake_measure(bf16: float, fp32: float, calls: list | None = None):
    def measure(shapes, dtype):
        if calls is not None:
            calls.append(dtype)
        return bf16 if dtype == torch.bfloat16 else fp32
    return measure


def args(dtype: str = "auto", model: str | None = None) -> ModelArguments:
    return ModelArguments(model_name_or_path=model, torch_dtype=dtype)


def test_slow_bf16_probe_selects_fp32_and_fast_selects_bf16(monkeypatch, tmp_path) -> None:
    on_cpu(monkeypatch, {"avx2", "avx512_bf16"})
    slow = choose_dtype(args(), measure=fake_measure(bf16=17.0, fp32=104.0))
    assert slow.dtype == torch.float32 and "bf16 17 vs fp32 104 GFLOP/s" in slow.reason
    monkeypatch.setenv(precision.CACHE_ENV, str(tmp_path / "other"))  # a fresh cache: another machine
    fast = choose_dtype(args(), measure=fake_measure(bf16=700.0, fp32=180.0))
    assert fast.dtype == torch.bfloat16 and fast.measured["bf16_gflops"] == 700.0
    # A near tie is not worth bf16: it must win by the margin.
    monkeypatch.setenv(precision.CACHE_ENV, str(tmp_path / "third"))
    assert choose_dtype(args(), measure=fake_measure(bf16=110.0, fp32=100.0)).dtype == torch.float32


def test_no_native_bf16_means_fp32_without_a_probe(monkeypatch) -> None:
    on_cpu(monkeypatch, {"avx2", "fma"})
    calls: list = []
    choice = choose_dtype(args(), measure=fake_measure(1000.0, 1.0, calls))
    assert choice.dtype == torch.float32 and calls == [] and "no native bf16" in choice.reason


def test_explicit_flags_win_and_slow_bf16_warns_once(monkeypatch, caplog) -> None:
    on_cpu(monkeypatch, {"avx2"})
    assert choose_dtype(args("float32"), measure=fake_measure(1000.0, 1.0)).dtype == torch.float32
    with caplog.at_level(logging.WARNING, logger="open_sft.model.precision"):
        choice = choose_dtype(args("bfloat16"), measure=fake_measure(bf16=20.0, fp32=100.0))
    assert choice.dtype == torch.bfloat16
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "measured 5.0× slower than fp32 (20 vs 100 GFLOP/s" in warnings[0]
    assert choice.bf16_via_fp32 and "fp32 kernels" in choice.reason  # bf16 numerics on the fast kernels
    assert choose_dtype(args(), qlora=True).dtype == torch.bfloat16  # QLoRA's base computes in bf16


def test_probe_is_cached_and_a_damaged_cache_is_measured_again(monkeypatch, probe_cache) -> None:
    on_cpu(monkeypatch, {"amx_bf16"})
    calls: list = []
    first = choose_dtype(args(), measure=fake_measure(300.0, 100.0, calls))
    second = choose_dtype(args(), measure=fake_measure(1.0, 1000.0, calls))  # would flip it, were it measured
    assert calls == [torch.bfloat16, torch.float32] * precision.PROBE_ROUNDS  # measured once, alternating
    assert first.dtype == second.dtype == torch.bfloat16
    assert first.measured["cached"] is False and second.measured["cached"] is True
    probe_cache.write_text("{not json")
    third = choose_dtype(args(), measure=fake_measure(1.0, 1000.0, calls))
    assert third.dtype == torch.float32 and len(calls) == 4 * precision.PROBE_ROUNDS
    assert json.loads(json.dumps(third.to_dict()))["dtype"] == "float32"


def test_probe_uses_the_models_shapes(tiny_model_dir) -> None:
    shapes = precision.probe_shapes(args(model=str(tiny_model_dir)))
    assert shapes == [(64, 64), (64, 176), (64, 1024)] or shapes[0] == (64, 64)
    real = precision.measure_gflops(shapes, torch.float32)  # the real kernel runs and gives a positive rate
    assert real > 0


def test_kernels_held_below_the_cpu_are_probed_apart(monkeypatch, probe_cache) -> None:
    """ONEDNN_MAX_CPU_ISA=AVX2 & co. make this CPU run like an older kind: the cached native result must not
    answer for it, nor its result for the native kernels afterwards."""
    on_cpu(monkeypatch, {"avx512_bf16"})
    for name in precision.KERNEL_LIMITS:
        monkeypatch.delenv(name, raising=False)
    native = choose_dtype(args(), measure=fake_measure(300.0, 100.0))
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    limited = choose_dtype(args(), measure=fake_measure(10.0, 100.0))
    assert (native.dtype, limited.dtype) == (torch.bfloat16, torch.float32)
    assert limited.measured["cached"] is False
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    again = choose_dtype(args(), measure=fake_measure(1.0, 1000.0))
    assert again.dtype == torch.bfloat16 and again.measured["cached"] is True


def test_a_burst_of_load_on_one_dtype_does_not_decide(monkeypatch, probe_cache) -> None:
    """bf16 1.05x fp32 here (fp32 kept); the first fp32 measurement lands in a burst of load (10 GFLOP/s): with
    alternating rounds the best of each dtype decides, once two of its measurements agree (a third round here),
    and the burst is not cached as this CPU's rate."""
    on_cpu(monkeypatch, {"avx2", "avx512_bf16"})
    rates = {torch.bfloat16: [200.0, 200.0, 199.0], torch.float32: [10.0, 190.0, 185.0]}

    def measure(shapes, dtype):
        return rates[dtype].pop(0)

    choice = choose_dtype(args(), measure=measure)
    assert choice.dtype == torch.float32
    assert (choice.measured["bf16_gflops"], choice.measured["fp32_gflops"]) == (200.0, 190.0)
    assert rates == {torch.bfloat16: [], torch.float32: []} and choice.measured["cached"] is False
    again = choose_dtype(args(), measure=fake_measure(1000.0, 1.0))
    assert again.dtype == torch.float32 and again.measured["cached"] is True  # steady: cached


def test_a_load_on_every_round_of_one_dtype_decides_one_start_only(monkeypatch, probe_cache, caplog) -> None:
    """Two OpenMP threads on a core another process holds measured bf16 0.9 GFLOP/s beside fp32 84 on this
    EPYC (a real entry of the suite's cache): rounds that never agree decide this start only, said, not cached;
    the next start measures again (here steady: bf16, as this CPU is)."""
    on_cpu(monkeypatch, {"avx2", "avx512_bf16"})
    disturbed = {torch.bfloat16: [0.9, 30.0, 0.8, 2.0, 0.9], torch.float32: [84.1] * 5}

    def measure(shapes, dtype):
        return disturbed[dtype].pop(0)

    with caplog.at_level(logging.WARNING, logger="open_sft"):
        first = choose_dtype(args(), measure=measure)
    assert first.dtype == torch.float32 and first.measured["steady"] is False
    assert disturbed == {torch.bfloat16: [], torch.float32: []}  # PROBE_MAX_ROUNDS rounds, no more
    assert "disturbed by other load" in caplog.text and "not cached" in caplog.text
    assert not probe_cache.exists() or json.loads(probe_cache.read_text()) == {}
    second = choose_dtype(args(), measure=fake_measure(160.0, 84.0))
    assert second.dtype == torch.bfloat16 and second.measured["cached"] is False


def test_the_ranks_of_a_launch_share_a_disturbed_probe(monkeypatch, probe_cache) -> None:
    """Measuring alone, each rank of a launch would decide on its own disturbed rates, and ranks that chose apart
    stop the run (collectives.check_ranks_agree_on_dtype): a disturbed probe is kept for its launch's ranks (the
    same launcher process and rendezvous), and measured again by the next launch."""
    on_cpu(monkeypatch, {"avx2", "avx512_bf16"})
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_PORT", "29500")
    disturbed = {torch.bfloat16: [0.9, 30.0, 0.8, 2.0, 0.9], torch.float32: [84.1] * 5}
    first = choose_dtype(args(), measure=lambda shapes, dtype: disturbed[dtype].pop(0))
    rank_1 = choose_dtype(args(), measure=fake_measure(160.0, 84.0))  # steady now: it would choose bf16
    assert (first.dtype, rank_1.dtype) == (torch.float32, torch.float32) and rank_1.measured["cached"] is True
    monkeypatch.setenv("MASTER_PORT", "29501")  # the next launch
    again = choose_dtype(args(), measure=fake_measure(160.0, 84.0))
    assert again.dtype == torch.bfloat16 and again.measured["cached"] is False
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert choose_dtype(args(), measure=fake_measure(1.0, 84.0)).dtype == torch.bfloat16  # steady: cached for all
    assert (precision._rate(0.94), precision._rate(84.1)) == ("0.9", "84")  # "bf16 1 vs fp32 0" said nothing


def test_a_resume_keeps_the_dtype_auto_resolved_for_its_checkpoint(monkeypatch, tmp_path, tiny_model_dir) -> None:
    """The probe of a requeue (another node, or other threads per rank) said float32 where the checkpoint's run
    trained in bfloat16: auto keeps bfloat16, said in the launch's line; an explicit --torch_dtype is the flag's
    (a changed setting, which the resume refuses unless --allow_changed_settings)."""
    from open_sft.config.parse import parse_config
    from open_sft.run import plan_launch
    from open_sft.training.checkpoint import publish

    monkeypatch.setattr(precision, "choose_dtype", lambda model, qlora=False: precision.DtypeChoice(
        precision.FLAG_DTYPES.get(model.torch_dtype, torch.float32), "the probe"))
    tmp = tmp_path / "out" / "checkpoints" / "step_2.tmp"
    tmp.mkdir(parents=True)
    (tmp / "trainer_state.json").write_text(json.dumps({"step": 2, "config": {"compute_dtype": "bfloat16"}}))
    publish(tmp, tmp.with_name("step_2"), 2)

    def launch(*flags):
        return plan_launch(parse_config(["--model_name_or_path", str(tiny_model_dir), "--dataset_mixer_list",
                                         "d.jsonl", "1.0", "--output_dir", str(tmp_path / "out"), *flags])).launch

    resumed = launch().dtype_choice
    assert resumed.dtype == torch.bfloat16 and "as the run resumed here resolved it" in resumed.reason
    assert launch("--torch_dtype", "float32").dtype == torch.float32
    assert launch("--resume_from_checkpoint", "none").dtype == torch.float32


def test_the_probe_measures_one_thread_and_gives_the_threads_back(monkeypatch) -> None:
    """Two OpenMP threads that wait for each other at every small matmul measured the load of a shared machine
    (bf16 6 vs fp32 3 GFLOP/s, then 11 vs 34, on a core idle at 180 vs 80): the ratio is the core's, on one thread;
    the run keeps its own thread count."""
    on_cpu(monkeypatch, {"avx512_bf16"})
    threads = torch.get_num_threads()
    seen: list[int] = []

    def measure(shapes, dtype):
        seen.append(torch.get_num_threads())
        return 180.0 if dtype == torch.bfloat16 else 80.0

    torch.set_num_threads(2)
    try:
        assert choose_dtype(args(), measure=measure).dtype == torch.bfloat16
        assert seen == [1] * 2 * precision.PROBE_ROUNDS and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("capability, expected", [((7, 5), torch.float16), ((7, 0), torch.float16),
                                                  ((8, 0), torch.bfloat16), ((9, 0), torch.bfloat16)])
def test_auto_takes_fp16_on_a_gpu_that_only_emulates_bf16(monkeypatch, capability, expected) -> None:
    """A T4 (7.5) or V100 (7.0) has no bf16 units; torch.cuda.is_bf16_supported() counts its emulation by default
    (True there), so `auto` took the slow emulated bf16 instead of fp16. Native bf16 only: Ampere (8.0) and later.
    An explicit bfloat16 there runs as asked, the reason saying it is emulated."""
    def is_bf16_supported(including_emulation: bool = True) -> bool:  # torch's answer on such a GPU
        return capability >= (8, 0) or including_emulation

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
    choice = choose_dtype(args())
    assert choice.dtype == expected
    if expected == torch.float16:
        assert choice.reason == ("auto: float16 with dynamic loss scaling (this GPU has no bf16 units; torch would "
                                 "emulate bf16, slowly)")
        assert "torch emulates it, slowly; float16 runs natively" in choose_dtype(args("bfloat16")).reason
    else:
        assert choice.reason == "auto: bfloat16 (the GPU supports it)"
        assert choose_dtype(args("bfloat16")).reason == "requested by --torch_dtype"
