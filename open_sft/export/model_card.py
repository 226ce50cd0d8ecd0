"""The model card (README.md of the export): base model, data sources and proportions,
hyperparameters, final metrics and how the model was trained, built from the files the run wrote
(run.json, data_report.json, metrics.jsonl) so it can be regenerated: `python -m open_sft.export.model_card DIR`.

It never contains the Hub token: run.json holds the arguments with the token already redacted, and only
an allow-list of them is printed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional

HYPERPARAMETERS = (
    ("train", "learning_rate"), ("train", "lr_scheduler_type"), ("train", "warmup_ratio"),
    ("train", "weight_decay"), ("train", "num_train_epochs"), ("train", "max_train_steps"),
    ("train", "per_device_train_batch_size"), ("train", "gradient_accumulation_steps"),
    ("train", "clip_grad_norm"), ("train", "loss_normalization"), ("train", "seed"),
    ("data", "max_seq_length"), ("data", "train_on"), ("data", "truncation"),
    ("model", "torch_dtype"), ("lora", "use_lora"), ("lora", "use_qlora"), ("lora", "lora_rank"),
    ("lora", "lora_alpha"),
)
FINAL_METRICS = ("step", "epoch", "loss", "learning_rate", "grad_norm", "train_tokens", "total_tokens")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _last_train_record(path: Path) -> Optional[dict[str, Any]]:
    last = None
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if "loss" in record:
                last = record
    return last


def _looks_like_hub_id(name: str) -> bool:
    return bool(name) and not name.startswith((".", "/", "~")) and not Path(name).exists() and name.count("/") <= 1


def _front_matter(base_model: str) -> str:
    lines = ["---", "library_name: transformers", "tags:", "- open_sft", "- sft"]
    if _looks_like_hub_id(base_model):
        lines.append(f"base_model: {base_model}")
    return "\n".join(lines + ["---", ""])


def _data_section(report: dict[str, Any]) -> list[str]:
    sources = report.get("sources", [])
    total = sum(s.get("trained_tokens", 0) for s in sources) or 1
    lines = ["## Data", "", "| source | format | rows kept | tokens | trained tokens | share of trained tokens |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for s in sources:
        lines.append(f"| {s.get('name')} | {s.get('format')} | {s.get('rows_kept')} | {s.get('tokens')} | "
                     f"{s.get('trained_tokens')} | {100 * s.get('trained_tokens', 0) / total:.1f}% |")
    return lines + [""]


def _hyperparameter_section(args: dict[str, Any]) -> list[str]:
    lines = ["## Hyperparameters", "", "| setting | value |", "| --- | --- |"]
    for section, name in HYPERPARAMETERS:
        if name in args.get(section, {}):
            lines.append(f"| {name} | {args[section][name]} |")
    return lines + [""]


def _training_section(info: dict[str, Any]) -> list[str]:
    schedule = info.get("schedule", {})
    stage = (info.get("deepspeed_config") or {}).get("zero_optimization", {}).get("stage")
    versions = info.get("versions", {})
    how = [f"- {info.get('world_size', 1)} process(es), {info.get('distributed_type', 'NO')}"
           + (f" (ZeRO stage {stage})" if stage is not None else "") + f", compute dtype {info.get('compute_dtype')}",
           f"- global batch {schedule.get('global_batch_size')} examples, {schedule.get('total_steps')} optimizer "
           f"steps ({schedule.get('warmup_steps')} warmup)",
           f"- loss: {info.get('loss_normalization')}-normalised cross-entropy on the trained tokens",
           "- libraries: " + ", ".join(f"{k} {v}" for k, v in versions.items() if v),
           f"- open_sft git revision {info.get('git_revision')}, tokenized data {info.get('dataset_cache_key')}"]
    return ["## How it was trained", "", "Fine-tuned with open_sft (Accelerate/DeepSpeed supervised fine-tuning).",
            ""] + how + [""]


def _metrics_section(record: Optional[dict[str, Any]]) -> list[str]:
    if record is None:
        return ["## Final metrics", "", "No metrics were logged.", ""]
    lines = ["## Final metrics", "", "| metric | value |", "| --- | --- |"]
    lines += [f"| {k} | {record[k]:.6g} |" if isinstance(record[k], float) else f"| {k} | {record[k]} |"
              for k in FINAL_METRICS if k in record]
    return lines + [""]


def render_model_card(output_dir: Path) -> str:
    info = _read_json(output_dir / "run.json")
    args = info.get("args", {})
    base_model = args.get("model", {}).get("model_name_or_path") or "unknown"
    name = args.get("hub", {}).get("hub_model_id") or output_dir.name
    body = [f"# {name}", "", f"A fine-tune of `{base_model}`.", ""]
    body += _data_section(_read_json(output_dir / "data_report.json"))
    body += _hyperparameter_section(args)
    body += _metrics_section(_last_train_record(output_dir / "metrics.jsonl"))
    body += _training_section(info)
    return _front_matter(base_model) + "\n".join(body)


def write_model_card(output_dir: Path) -> Path:
    path = output_dir / "README.md"
    tmp = path.with_suffix(".md.tmp")
    tmp.write_text(render_model_card(output_dir))
    tmp.replace(path)
    return path


def main(argv: Optional[list[str]] = None, prog: str = "open_sft model-card") -> int:
    parser = argparse.ArgumentParser(prog=prog, description="(re)write README.md, the model card, of a run's export")
    parser.add_argument("output_dir", type=Path, help="a run's --output_dir (holds run.json)")
    args = parser.parse_args(argv)
    if not (args.output_dir / "run.json").is_file():
        print(f"error: {args.output_dir / 'run.json'} not found; pass the --output_dir of a finished run", file=sys.stderr)
        return 2
    print(write_model_card(args.output_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
