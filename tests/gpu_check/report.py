"""The report of scripts/gpu_check.py: its Markdown table and the archive of every run's log."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tests.gpu_check.context import Context


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_short(v)}" for k, v in value.items() if not isinstance(v, list)) + "}"
    return str(value)


KEY_FIGURES = ("max_rel_diff", "tolerance", "bitwise", "run_to_run_rel_diff", "compute_dtype", "peak_memory_gib",
               "export_reloads", "micro_batch_chosen", "fastest_correct", "attention", "liger_modules", "why",
               "error", "targets", "failed", "profile", "bfloat16", "float32", "fp32", "bf16", "wrong_positions_loss_rel_change",
               "lm_head_loss", "max_rel_diff_to_eager", "compiled", "skipped", "profile_fastest", "fp8_over_bf16",
               "fp8_over_bf16_compiled", "loss", "plot", "kernel", "latent_bf16", "first_layer_moves", "kernel_error")


def runs_table(runs: list[dict]) -> list[str]:
    """A speed part's runs: tokens/s (the median of the repeats' median steps, and their spread), MFU in both counts
    against the datasheet, peak memory allocated and reserved, the estimate, the ratio to TRL's fastest run of the
    same kind (full, LoRA, QLoRA) and of the same mode (eager or compiled)."""
    lines = ["| run | tokens/s | spread | repeats | MFU | MFU, PaLM count | peak GiB | reserved GiB | estimate GiB | "
             "x TRL best | x TRL same mode |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r['label']} | {r['tokens_per_second']:,.0f} | {r.get('spread', 0):.1%} | "
                     f"{len(r.get('repeats', [1]))} | {r.get('mfu', 0):.1%} | {r.get('mfu_palm', 0):.1%} | "
                     f"{r.get('peak_gib', 0):.2f} | {_short(r.get('peak_reserved_gib'))} | "
                     f"{_short(r.get('estimate_gib'))} | {_short(r.get('over_trl_best'))} | "
                     f"{_short(r.get('over_trl_same_mode'))} |")
    return lines


def markdown(report: dict) -> str:
    head = report["header"]
    gpu = head["gpu"]
    versions = ", ".join(f"{k} {v}" for k, v in head["versions"].items() if v)
    lines = [f"# open_sft GPU check: {report.get('verdict', '')}", "",
             f"- device: {gpu.get('name') or 'no GPU (' + head['mode'] + ')'}"
             + (f", driver {gpu['driver']}, CUDA {gpu['cuda']}, {gpu['memory_gib']} GiB" if gpu.get("name") else ""),
             f"- date: {head['date']}; commit: {head['commit']}", f"- versions: {versions}", "",
             "| part | group | verdict | seconds | figures |", "|---|---|---|---|---|"]
    for name, part in report["parts"].items():
        figures = "; ".join(f"{k}: {_short(part[k])}" for k in KEY_FIGURES if k in part)
        lines.append(f"| {name} | {part['group']} | {part['verdict']} | {part['seconds']} | {figures} |")
    for name in ("speed", "fp8", "speed_8b"):
        runs = report["parts"].get(name, {}).get("runs")
        if runs:
            lines += ["", f"{name}:", ""] + runs_table(runs)
    return "\n".join(lines) + "\n"


def pack_logs(out: Path, work: Path) -> Path:
    """Every run's and probe's log (under work/logs) in one archive beside the report, in `out`."""
    archive = out / "gpu_check_logs.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        if (work / "logs").exists():
            tar.add(work / "logs", arcname="logs")
    return archive


def write_report(ctx: Context, report: dict) -> None:
    verdicts = [p["verdict"] for p in report["parts"].values()]
    report["verdict"] = "FAIL" if "FAIL" in verdicts else "pass" if verdicts else "nothing run"
    (ctx.out / "gpu_report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (ctx.out / "gpu_report.md").write_text(markdown(report))
