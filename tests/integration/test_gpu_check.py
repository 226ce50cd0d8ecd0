"""scripts/gpu_check.py's CPU smoke mode, as the suite runs it on every change: the parts a CPU can run pass on
the tiny embedded model with their figures, the GPU-only parts are reported as skipped with the reason, the
report is written as JSON and Markdown, and a part that fails is reported without hiding the others."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from conftest import ROOT, load_script

CPU_PARTS = ["batch_layouts", "packed", "fused_ce", "attention", "kill_resume", "dtype_auto", "zero2", "zero3",
             "fsdp2", "gradient_checkpointing", "auto_micro_batch_size", "torch_compile", "speed"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), str(out), "--smoke",
                           "--commit", "abc123"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    return out, proc


def test_smoke_parts_pass_with_their_figures(smoke) -> None:
    out, proc = smoke
    report = json.loads((out / "gpu_report.json").read_text())
    parts = report["parts"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert {name: parts[name]["verdict"] for name in CPU_PARTS} == {name: "pass" for name in CPU_PARTS}
    assert parts["liger"]["verdict"] == parts["qlora"]["verdict"] == "skip" and parts["liger"]["why"]
    assert parts["fp8"]["verdict"] == parts["speed_8b"]["verdict"] == "skip" and "8.9" in parts["fp8"]["why"]
    assert report["verdict"] == "pass" and report["header"]["commit"] == "abc123"
    assert report["header"]["mode"] == "smoke (CPU)" and report["header"]["versions"]["torch"]
    # the numbers behind the verdicts
    assert parts["batch_layouts"]["float32"]["max_rel_diff"] <= 1e-5
    assert len(parts["batch_layouts"]["float32"]["losses_bs8"]) == 8
    resume = parts["kill_resume"]
    assert resume["killed_exit"] == -signal.SIGKILL and resume["bitwise"] is True  # CPU kernels: bit for bit
    assert parts["packed"]["fp32"]["loss_rel_error"] < 1e-5 and parts["packed"]["wrong_positions_loss_rel_change"] > 1e-4
    # the varlen kernel's own figures (its CPU stand-in here): latent attention's layers each through it once in bf16
    assert parts["packed"]["kernel"].startswith("cpu_stand_in")
    assert {f: r["varlen_kernel_calls"] for f, r in parts["packed"]["latent_bf16"].items()} == {
        "deepseek_v3": 2, "deepseek_v2": 2, "glm4_moe_lite": 2}
    moves = parts["packed"]["first_layer_moves"]
    assert max(moves[f] for f in ("llama", "qwen3_moe", "mixtral", "phimoe")) < 2e-2 < moves["llama_acausal"], moves
    assert all(parts["attention"][c]["cross_example_change"] == 0.0 for c in ("sdpa_block_mask", "per_example_sdpa"))
    for name in ("dtype_auto", "zero2", "zero3", "fsdp2", "gradient_checkpointing", "auto_micro_batch_size",
                 "torch_compile"):
        assert parts[name]["export_reloads"] is True and parts[name]["falling"] is True, name
    compiled = parts["torch_compile"]
    # bf16 where this CPU has it (fused kernels round once where eager rounds per op: 5.7e-5 measured), else fp32
    assert compiled["max_rel_diff_to_eager"] <= compiled["tolerance"] <= 2e-2 and len(compiled["losses_eager"]) == 8
    assert any("decoder layers compiled" in line for line in compiled["compiled"])
    speed = parts["speed"]
    assert speed["runs"][0]["tokens_per_second"] > 0 and speed["runs"][0]["estimate_gib"] > 0
    assert speed["runs"][0]["mfu_palm"] > speed["runs"][0]["mfu"] > 0 and speed["runs"][0]["repeats"]
    assert sum(speed["profile"]["shares"].values()) == pytest.approx(1.0, abs=1e-3)


def test_smoke_report_markdown_and_logs(smoke) -> None:
    out, _ = smoke
    table = (out / "gpu_report.md").read_text()
    assert table.startswith("# open_sft GPU check: pass")
    for name in CPU_PARTS + ["liger", "qlora"]:
        assert f"| {name} |" in table
    assert "| open_sft float32 |" in table  # the speed table
    assert "first_layer_moves: {llama: " in table and "latent_bf16: {deepseek_v3: {" in table
    assert (out / "gpu_check_logs.tar.gz").stat().st_size > 0


def test_a_failing_part_is_reported_without_hiding_the_others(tmp_path, monkeypatch) -> None:
    gpu_check = load_script("gpu_check")

    def broken(ctx):
        raise RuntimeError("planted failure")

    monkeypatch.setitem(gpu_check.PARTS, "fused_ce", broken)
    # the check installs its SIGTERM/SIGINT handlers (a stopped check still reports): this worker's are put back
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = gpu_check.main([str(tmp_path), "--smoke", "--parts", "fused_ce,attention"])
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)
    report = json.loads((tmp_path / "gpu_report.json").read_text())
    assert code == 1 and report["verdict"] == "FAIL"
    assert report["parts"]["fused_ce"]["verdict"] == "FAIL" and "planted failure" in report["parts"]["fused_ce"]["error"]
    assert report["parts"]["attention"]["verdict"] == "pass"


def test_unknown_part_is_refused_with_the_choices() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "/tmp/x", "--parts", "fast"],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown ['fast']" in proc.stderr and "batch_layouts" in proc.stderr


def test_a_check_stopped_by_its_time_limit_reports_what_it_found(tmp_path) -> None:
    """SIGTERM (a job's time limit) while a part runs: the finished part keeps its verdict, the running one is
    reported as stopped, the logs are archived, and the check exits 124."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), str(tmp_path), "--smoke",
                             "--parts", "packed,batch_layouts"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    report_file = tmp_path / "gpu_report.json"
    deadline = time.monotonic() + 300
    while not report_file.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)  # packed (seconds) writes the first report while batch_layouts (minutes) still runs
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    report = json.loads(report_file.read_text())
    assert proc.returncode == 124, output[-3000:]
    assert report["parts"]["packed"]["verdict"] == "pass"
    stopped = report["parts"]["batch_layouts"]
    assert stopped["verdict"] == "FAIL" and "stopped by SIGTERM" in stopped["error"] and report["verdict"] == "FAIL"
    assert "| batch_layouts | correctness | FAIL |" in (tmp_path / "gpu_report.md").read_text()
    assert (tmp_path / "gpu_check_logs.tar.gz").stat().st_size > 0


def test_benchmark_starts_no_run_after_its_deadline_and_keeps_the_logs(tiny_model_dir, tmp_path) -> None:
    """The first run always runs (something is measured); a run due after --deadline_unix is listed as not run;
    each run's log stays in --log_dir and the JSON holds what was measured."""
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "benchmark.py"), "--model_name_or_path",
                           str(tiny_model_dir), "--steps", "4", "--warmup_steps", "1", "--batch_size", "2",
                           "--max_seq_length", "128", "--dtypes", "float32", "--variants", "plain", "compile",
                           "--deadline_unix", str(time.time()), "--json_out", str(out), "--log_dir",
                           str(tmp_path / "logs")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [r["label"] for r in result["runs"]] == ["open_sft float32"] and result["runs"][0]["tokens_per_second"] > 0
    assert result["skipped"] == ["open_sft float32 compile"] and result["failed"] == []
    assert "step 4/4" in (tmp_path / "logs" / "open_sft_float32_plain.log").read_text()


def test_a_parts_runs_go_together_on_a_gpu_and_one_by_one_on_cpu() -> None:
    """runs.together: on a GPU the calls run at the same time (both reach a barrier of two), values in order,
    a failure re-raised; on CPU one after the other."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_check_runs

    barrier = threading.Barrier(2, timeout=30)

    def meet(value):
        barrier.wait()
        return value

    gpu, cpu = SimpleNamespace(gpu=True), SimpleNamespace(gpu=False)
    assert gpu_check_runs.together(gpu, lambda: meet(1), lambda: meet(2)) == [1, 2]
    order = []
    assert gpu_check_runs.together(cpu, lambda: order.append("a") or 1, lambda: order.append("b") or 2) == [1, 2]
    assert order == ["a", "b"]
    with pytest.raises(ValueError, match="planted"):
        gpu_check_runs.together(gpu, lambda: 1, lambda: (_ for _ in ()).throw(ValueError("planted")))
