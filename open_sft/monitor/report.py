"""The end-of-run report: `report/` in the output dir with loss (per source too), learning-rate curves (PNG) and a
markdown summary, computed from the metrics.jsonl records alone.

    python -m open_sft report OUTPUT_DIR      # (re)build OUTPUT_DIR/report from OUTPUT_DIR/metrics.jsonl
"""

from __future__ import annotations

import json
import logging
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from open_sft.config.whole_flags import WholeFlagParser

logger = logging.getLogger(__name__)

REPORT_DIR = "report"
LOSS_PNG = "loss.png"
SOURCES_PNG = "loss_by_source.png"  # with two or more sources
LR_PNG = "learning_rate.png"
SUMMARY_MD = "summary.md"
SUMMARY_JSON = "summary.json"


@dataclass(frozen=True)
class Summary:
    """Whole-run numbers; each is defined from metrics.jsonl so anyone can recompute it."""

    steps: int  # last logged optimizer step
    elapsed_s: float  # elapsed_s of the last record
    train_tokens: int  # cumulative tokens with a label, last record
    total_tokens: int  # cumulative tokens without padding, last record
    tokens_per_second: float  # total_tokens / elapsed_s
    mfu: float  # per-window MFU averaged with the windows' durations (elapsed_s deltas) as weights
    mfu_palm: Optional[float]  # the same of mfu_palm (PaLM's count, published figures'); None: metrics without it
    peak_memory_gib: float  # max over records
    final_loss: Optional[float]  # loss of the last train record
    final_eval_loss: Optional[float]  # eval_loss of the last eval record, if any


def train_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if "loss" in r]


def eval_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if "eval_loss" in r]


def _time_weighted_mfu(train: list[dict[str, Any]], key: str = "mfu") -> float:
    weighted, seconds, previous = 0.0, 0.0, 0.0
    for record in train:
        window = max(record["elapsed_s"] - previous, 0.0)
        weighted += record[key] * window
        seconds += window
        previous = record["elapsed_s"]
    return weighted / seconds if seconds > 0 else 0.0


def summarize(records: list[dict[str, Any]]) -> Summary:
    train = train_records(records)
    if not train:
        raise ValueError("no training records (lines with 'loss') in the metrics")
    last = train[-1]
    evals = eval_records(records)
    elapsed = float(last["elapsed_s"])
    return Summary(
        steps=int(last["step"]), elapsed_s=elapsed, train_tokens=int(last["train_tokens"]),
        total_tokens=int(last["total_tokens"]),
        tokens_per_second=last["total_tokens"] / elapsed if elapsed > 0 else 0.0,
        mfu=_time_weighted_mfu(train),
        mfu_palm=_time_weighted_mfu(train, "mfu_palm") if all("mfu_palm" in r for r in train) else None,
        peak_memory_gib=max(float(r["peak_memory_gib"]) for r in train),
        final_loss=float(last["loss"]), final_eval_loss=float(evals[-1]["eval_loss"]) if evals else None,
    )


def source_series(records: list[dict[str, Any]], prefix: str) -> list[tuple[str, list[float], list[float], str]]:
    """One line per source of `<prefix>loss/<source>` (a window where a source trained nothing has no point)."""
    key = f"{prefix}loss/"
    names = list(dict.fromkeys(k[len(key):] for r in records for k in r if k.startswith(key)))
    return [(f"{prefix.rstrip('_') or 'train'} {name}", [r["step"] for r in records if key + name in r],
             [r[key + name] for r in records if key + name in r], "o--" if prefix else "-") for name in names]


def lone_points(steps: list[float], values: list[float]) -> list[tuple[float, float]]:
    """The points a line alone does not draw: finite values with no finite neighbour (a run that logged one step,
    a window between two whose steps were all skipped, whose loss is NaN)."""
    finite = [math.isfinite(value) for value in values]
    return [(step, value) for i, (step, value) in enumerate(zip(steps, values)) if finite[i]
            and not (i > 0 and finite[i - 1]) and not (i + 1 < len(values) and finite[i + 1])]


def figure_of(title: str, ylabel: str, series: list[tuple[str, list[float], list[float], str]]) -> Any:
    """A line chart (a matplotlib Figure, without pyplot: no global state, no display needed); a series drawn as a
    line alone gets a marker on each of its lone points (they were not drawn: a one-step run's loss.png was empty)."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4), dpi=100)
    axes = figure.add_subplot()
    for label, steps, values, style in series:
        (line,) = axes.plot(steps, values, style, label=label)
        lone = lone_points(steps, values)
        if lone and line.get_marker() in ("None", None, ""):
            axes.plot(*zip(*lone), "o", color=line.get_color())
    axes.set(title=title, xlabel="optimizer step", ylabel=ylabel)
    axes.grid(alpha=0.3)
    if len(series) > 1:
        axes.legend()
    figure.tight_layout()
    return figure


def _plot(path: Path, title: str, ylabel: str, series: list[tuple[str, list[float], list[float], str]]) -> None:
    """One PNG line chart."""
    figure_of(title, ylabel, series).savefig(path, format="png")


def _fmt(value: Optional[float], spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def summary_markdown(summary: Summary, title: str, per_source_plot: bool = False) -> str:
    rows = [
        ("Optimizer steps", str(summary.steps)),
        ("Training time (evaluations and checkpoint saves left out)", f"{summary.elapsed_s:.1f} s"),
        ("Trained tokens (with a label)", f"{summary.train_tokens:,}"),
        ("Tokens (padding excluded)", f"{summary.total_tokens:,}"),
        ("Throughput", f"{summary.tokens_per_second:.1f} tokens/s"),
        ("MFU (time-weighted; open_sft's strict count)", f"{100 * summary.mfu:.2f} %"),
        ("MFU, PaLM's count (torchtitan, OLMo-core, nanochat)",
         "n/a" if summary.mfu_palm is None else f"{100 * summary.mfu_palm:.2f} %"),
        ("Peak memory (rank 0)", f"{summary.peak_memory_gib:.3f} GiB"),
        ("Final train loss", _fmt(summary.final_loss, ".4f")),
        ("Final eval loss", _fmt(summary.final_eval_loss, ".4f")),
    ]
    table = "\n".join(f"| {name} | {value} |" for name, value in rows)
    return (f"# Training report: {title}\n\n| | |\n|---|---|\n{table}\n\n"
            f"![loss]({LOSS_PNG})\n\n" + (f"![loss per source]({SOURCES_PNG})\n\n" if per_source_plot else "") +
            f"![learning rate]({LR_PNG})\n\n"
            "Computed from `metrics.jsonl`; regenerate with `python -m open_sft report OUTPUT_DIR`.\n")


def write_report(records: list[dict[str, Any]], report_dir: Path, title: str = "open_sft run") -> Summary:
    """Write loss.png, learning_rate.png, summary.md and summary.json to report_dir from metrics records."""
    summary = summarize(records)
    train, evals = train_records(records), eval_records(records)
    report_dir.mkdir(parents=True, exist_ok=True)
    loss_series = [("train", [r["step"] for r in train], [r["loss"] for r in train], "-")]
    if evals:
        loss_series.append(("eval", [r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-"))
    _plot(report_dir / LOSS_PNG, "Loss", "loss (per trained token)", loss_series)
    _plot(report_dir / LR_PNG, "Learning rate", "learning rate",
          [("learning rate", [r["step"] for r in train], [r["learning_rate"] for r in train], "-")])
    by_source = source_series(train, "") + source_series(evals, "eval_")
    sources = {k.split("loss/", 1)[1] for r in records for k in r if k.startswith(("loss/", "eval_loss/"))}
    (report_dir / SOURCES_PNG).unlink(missing_ok=True)
    if len(sources) > 1:  # one source's train and eval lines are loss.png's
        _plot(report_dir / SOURCES_PNG, "Loss per source", "loss (per trained token)", by_source)
    (report_dir / SUMMARY_MD).write_text(summary_markdown(summary, title, len(sources) > 1), encoding="utf-8")
    (report_dir / SUMMARY_JSON).write_text(json.dumps(asdict(summary), indent=2) + "\n", encoding="utf-8")
    return summary


def read_records(metrics_path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in metrics_path.read_text(encoding="utf-8").splitlines() if line.strip()]


def write_run_report(output_dir: Path) -> Optional[Path]:
    """The report of a finished run (called by run() on the main process). A failure here is
    logged, not raised: the model is already saved and the report can be regenerated."""
    try:
        write_report(read_records(output_dir / "metrics.jsonl"), output_dir / REPORT_DIR, output_dir.name)
    except (OSError, ValueError, KeyError, ImportError) as exc:
        logger.warning("could not write the report in %s: %s (retry: python -m open_sft report %s)",
                       output_dir / REPORT_DIR, exc, output_dir)
        return None
    logger.info("report: %s", output_dir / REPORT_DIR / SUMMARY_MD)
    return output_dir / REPORT_DIR


def main(argv: Optional[list[str]] = None, prog: str = "open_sft report") -> int:
    parser = WholeFlagParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("output_dir", type=Path, help="a run's --output_dir (holds metrics.jsonl)")
    args = parser.parse_args(argv)
    metrics_path = args.output_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        print(f"error: {metrics_path} not found; pass the --output_dir of a run", file=sys.stderr)
        return 2
    try:
        summary = write_report(read_records(metrics_path), args.output_dir / REPORT_DIR, args.output_dir.name)
    except (ValueError, KeyError) as exc:
        print(f"error: {metrics_path}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(summary)))
    print(args.output_dir / REPORT_DIR / SUMMARY_MD)
    return 0


if __name__ == "__main__":
    sys.exit(main())
