"""The model card (README.md of the export): base model, data sources and proportions,
hyperparameters, the epochs actually trained, final metrics and how the model was trained, built from the files
the run wrote (run.json, data_report.json, metrics.jsonl, adapter_config.json) so it can be regenerated:
`open_sft model-card DIR`. The export of a step checkpoint (`open_sft export`) says which step it holds.

A LoRA/QLoRA run's card describes its adapter (base model, rank, alpha, dropout, target modules, from
adapter_config.json), and its merged/ directory (--merge_lora_on_save) gets a card of its own. The front
matter's `base_model` names the base by its Hub id: the id the run was given, or the one a Hub cache snapshot
path (`models--ORG--NAME/snapshots/...`) stands for. A base loaded from any other local directory has no Hub id,
and the Hub refuses a card whose `base_model` is not one, so the card names that directory in its text instead.

It never contains the Hub token: run.json holds the arguments with the token already redacted, and only
an allow-list of them is printed.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any, Optional

from open_sft.config.whole_flags import WholeFlagParser
from open_sft.export.names import MERGED_DIR
from open_sft.export.template_kwargs import card_section

HYPERPARAMETERS = (
    ("train", "learning_rate"), ("train", "lr_scheduler_type"), ("train", "warmup_ratio"),
    ("train", "weight_decay"), ("train", "adam_beta1"), ("train", "adam_beta2"), ("train", "adam_epsilon"),
    ("train", "num_train_epochs"), ("train", "max_train_steps"),
    ("train", "per_device_train_batch_size"), ("train", "gradient_accumulation_steps"),
    ("train", "clip_grad_norm"), ("train", "loss_normalization"), ("train", "seed"),
    ("data", "max_seq_length"), ("train", "packing"), ("data", "train_on"), ("data", "truncation"),
    ("model", "torch_dtype"), ("lora", "use_lora"), ("lora", "use_qlora"), ("lora", "lora_rank"),
    ("lora", "lora_alpha"),
)
FINAL_METRICS = ("step", "epoch", "loss", "learning_rate", "grad_norm", "train_tokens", "total_tokens")
EVAL_METRICS = ("eval_loss", "eval_tokens")  # and eval_loss/<source>, from the last evaluation
EXPORT_RECORD = "export.json"  # open_sft.export.from_checkpoint's record of the checkpoint it exported
SFT, CPT = "supervised fine-tuning", "continual pretraining"  # what a run trained, by its sources' formats
HOW_TRAINED = {
    (SFT,): "Fine-tuned with open_sft (Accelerate/DeepSpeed supervised fine-tuning).",
    (CPT,): "Trained with open_sft (Accelerate/DeepSpeed continual pretraining on text documents, every token "
            "trained).",
    (SFT, CPT): "Trained with open_sft (Accelerate/DeepSpeed): supervised fine-tuning on the chat/instruction sources "
                "and continual pretraining on the text sources, in one mixture.",
}
WHAT = {(SFT,): "A fine-tune of `{base}`.", (CPT,): "A continual pretraining of `{base}` on text documents.",
        (SFT, CPT): "A fine-tune of `{base}` on chat/instruction data, with continual pretraining on text documents "
                    "in the same mixture."}
TAGS = {SFT: "sft", CPT: "continual-pretraining"}
HUB_CACHE_SNAPSHOT = re.compile(r"models--(?P<id>[^/]+)/snapshots/[^/]+/?$")  # the cache writes ORG/NAME as ORG--NAME


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _records(path: Path) -> list[dict[str, Any]]:
    records = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
    return records


def _last_record(path: Path, key: str) -> Optional[dict[str, Any]]:
    """The last metrics.jsonl line with `key`: "loss" for a training step, "eval_loss" for an evaluation."""
    return next((r for r in reversed(_records(path)) if key in r), None)


def epochs_trained(output_dir: Path, info: dict[str, Any]) -> tuple[Optional[float], Optional[int]]:
    """(epochs, optimizer steps) the run actually trained: metrics.jsonl's last `epoch` and `step`, else the
    schedule in run.json (total steps / steps per epoch); None where neither says."""
    last = next((r for r in reversed(_records(output_dir / "metrics.jsonl")) if "epoch" in r), None)
    if last is not None:
        return float(last["epoch"]), last.get("step")
    schedule = info.get("schedule", {})
    steps, per_epoch = schedule.get("total_steps"), schedule.get("steps_per_epoch")
    return (round(steps / per_epoch, 4) if steps and per_epoch else None), steps


def trained_kinds(report: dict[str, Any]) -> tuple[str, ...]:
    """What the run trained, by its sources' formats (data_report.json): ("continual pretraining",) for text
    documents only, ("supervised fine-tuning",) for chat/instruction data only (or no report), both for a mix."""
    formats = {s.get("format") for s in report.get("sources", [])}
    return ((SFT,) if formats - {"text"} or not formats else ()) + ((CPT,) if "text" in formats else ())


def _plural(count: float, noun: str) -> str:
    return f"{count:g} {noun}" + ("" if count == 1 else "s")


def _looks_like_hub_id(name: str) -> bool:
    # a run records a local base as its absolute path (open_sft.model.base_record); nothing here asks
    # the current directory
    return bool(name) and not name.startswith((".", "/", "~")) and name.count("/") <= 1


def hub_id(name: str) -> Optional[str]:
    """The Hub id a base model name stands for: itself when it is one, ORG/NAME for a Hub cache snapshot path,
    else None (a local directory)."""
    if _looks_like_hub_id(name):
        return name
    match = HUB_CACHE_SNAPSHOT.search(name)
    return match["id"].replace("--", "/") if match else None


def _front_matter(base_model: str, library: str = "transformers", lora: bool = False,
                  datasets: tuple[str, ...] = (), kinds: tuple[str, ...] = (SFT,)) -> str:
    """The card's metadata: `datasets` are the Hub datasets the run read (the Hub links the model to them;
    local files are named in the card's text only); a tag per kind of training (`sft`, `continual-pretraining`)."""
    lines = (["---", f"library_name: {library}", "tags:", "- open_sft"] + [f"- {TAGS[kind]}" for kind in kinds]
             + (["- lora"] if lora else []))
    if hub_id(base_model):
        lines.append(f"base_model: {hub_id(base_model)}")
    if datasets:
        lines += ["datasets:"] + [f"- {name}" for name in dict.fromkeys(datasets)]
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


def target_modules(adapter: dict[str, Any]) -> str:
    """adapter_config.json's target_modules in a line: a pattern as it is, a list of module paths as the
    sorted module names they end in, with how many modules there are."""
    targets = adapter.get("target_modules")
    if not targets:
        return "none"
    if isinstance(targets, str):
        return targets
    names = sorted({t.rsplit(".", 1)[-1] for t in targets})
    return ", ".join(names) + (f" ({len(targets)} modules)" if len(targets) > len(names) else "")


def _adapter_section(adapter: dict[str, Any], qlora: bool, base_model: str) -> list[str]:
    kind = "QLoRA (LoRA on the base quantized to 4-bit NF4)" if qlora else "LoRA"
    rows = [("type", kind), ("base model", f"`{base_model}`"), ("rank (r)", adapter.get("r")),
            ("alpha", adapter.get("lora_alpha")), ("dropout", adapter.get("lora_dropout")),
            ("target modules", target_modules(adapter))]
    if adapter.get("trainable_token_indices"):  # rows of tokens the run added (a chat template's), trained too
        rows.append(("trained token rows", ", ".join(f"{module}: {len(ids)} tokens" for module, ids
                                                     in sorted(adapter["trainable_token_indices"].items()))))
    rows += [(name, adapter[name]) for name in ("use_rslora", "use_dora") if adapter.get(name)]
    if adapter.get("modules_to_save"):
        rows.append(("fully trained modules", ", ".join(adapter["modules_to_save"])))
    return ["## Adapter", "", "| setting | value |", "| --- | --- |"] + [f"| {k} | {v} |" for k, v in rows] + [""]


def _what(base_model: str, adapter: dict[str, Any], merged: bool, has_merged: bool,
          kinds: tuple[str, ...] = (SFT,)) -> str:
    """The card's first sentence: a full fine-tune (or continual pretraining on text), an adapter, or an adapter
    merged into its base."""
    if not adapter:
        return WHAT[kinds].format(base=base_model)
    if merged:
        return (f"`{base_model}` fine-tuned with LoRA, the adapter merged into its weights: a full model (the "
                "adapter itself is in the directory above).")
    return (f"A LoRA adapter for `{base_model}`: load it with peft on that base (its adapter_config.json names it)"
            + (", or use `merged/`, the full model with the adapter merged in." if has_merged else "."))


def _intro(name: str, what: str, base_model: str, epochs: Optional[float], steps: Optional[int],
           exported: dict[str, Any]) -> list[str]:
    lines = [f"# {name}", "", what, ""]
    if exported:  # open_sft export of a step checkpoint (open_sft.export.from_checkpoint's record)
        total = f" of {exported['total_steps']}" if exported.get("total_steps") else ""
        lines += [f"Exported from the checkpoint of step {exported['step']}{total} (`{exported['checkpoint']}`, "
                  f"written by {exported['engine']}) with `open_sft export`.", ""]
    if epochs is not None:
        lines += [f"Trained for {_plural(epochs, 'epoch')}" + (f" ({_plural(steps, 'optimizer step')})."
                                                                  if steps else "."), ""]
    if not hub_id(base_model):
        lines += [f"The base model `{base_model}` is a local directory, not a Hugging Face Hub id, so the front "
                  "matter names no `base_model` (the Hub accepts only ids there); add `base_model: ORG/NAME` "
                  "before sharing if the base came from the Hub.", ""]
    return lines


def _hyperparameter_section(args: dict[str, Any], epochs: Optional[float]) -> list[str]:
    lines = ["## Hyperparameters", "", "| setting | value |", "| --- | --- |"]
    train = args.get("train", {})
    for section, name in HYPERPARAMETERS:
        if name not in args.get(section, {}):
            continue
        value = args[section][name]
        if name == "num_train_epochs" and epochs is not None and train.get("max_train_steps") and epochs < value:
            value = f"{value} (not reached: --max_train_steps {train['max_train_steps']} ended the run)"
        lines.append(f"| {name} | {value} |")
    if epochs is not None:
        lines.append(f"| epochs trained | {epochs:g} |")
    return lines + [""]


def _settings_by_steps_section(ranges: list[dict[str, Any]]) -> list[str]:
    """A run resumed with --allow_changed_settings: the steps each set of settings trained (run.json)."""
    if not ranges:
        return []
    names = list(ranges[0]["changed"])
    lines = ["## Settings by steps", "", "The run was resumed with changed settings (--allow_changed_settings); the "
             "hyperparameters above are the last range's.", "",
             "| steps | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
    lines += [f"| {r['steps'][0]}-{r['steps'][1]} | " + " | ".join(str(r["changed"][n]) for n in names) + " |"
              for r in ranges]
    return lines + [""]


def _how_spread(info: dict[str, Any]) -> str:
    """The run's layout as its log said it ("2 processes: DeepSpeed ZeRO-3, dp_replicate 1 × dp_shard 2"), from
    run.json's launch record; accelerate's DistributedType name ("NO") was all a card said before."""
    recorded = info.get("launch", {}).get("parallelism")
    if recorded:
        from dataclasses import fields

        from open_sft.distributed.parallelism import Parallelism

        return Parallelism(**{f.name: recorded[f.name] for f in fields(Parallelism) if f.name in recorded}).describe()
    world, stage = info.get("world_size", 1), (info.get("deepspeed_config") or {}).get("zero_optimization", {})
    kind = info.get("distributed_type", "NO")
    return (f"{world} process{'es' * (world != 1)}, {'not distributed' if kind == 'NO' else kind}"
            + (f" (ZeRO stage {stage['stage']})" if "stage" in stage else ""))


def _global_batch(schedule: dict[str, Any], args: dict[str, Any]) -> str:
    """A step's batch as the log says it: examples, or under --packing micro-batches of up to N packed tokens (the
    examples a step takes vary with their lengths; per_device_train_batch_size does not count them). A run.json
    written before the schedule named the budget gives it by the flags (open_sft.training.steps.plan_steps)."""
    train = args.get("train", {})
    tokens = schedule.get("packed_tokens_per_micro_batch") or (train.get("packing") and (
        train.get("max_tokens_per_batch")
        or train.get("per_device_train_batch_size", 0) * args.get("data", {}).get("max_seq_length", 0)))
    if not tokens:
        return f"{schedule.get('global_batch_size')} examples"
    return (f"up to {tokens * schedule.get('gradient_accumulation_steps', 1) * schedule.get('world_size', 1)} packed "
            f"tokens ({tokens} per micro-batch × {schedule.get('gradient_accumulation_steps')} accumulation × "
            f"{schedule.get('world_size')} rank(s))")


def _training_section(info: dict[str, Any], kinds: tuple[str, ...]) -> list[str]:
    schedule = info.get("schedule", {})
    versions = info.get("versions", {})
    how = [f"- {_how_spread(info)}; compute dtype {info.get('compute_dtype')}",
           f"- global batch {_global_batch(schedule, info.get('args', {}))}, {schedule.get('total_steps')} optimizer "
           f"steps ({schedule.get('warmup_steps')} warmup)",
           f"- loss: {info.get('loss_normalization')}-normalised cross-entropy on the trained tokens",
           "- libraries: " + ", ".join(f"{k} {v}" for k, v in versions.items() if v),
           f"- open_sft git revision {info.get('git_revision')}, tokenized data {info.get('dataset_cache_key')}"]
    return ["## How it was trained", "", HOW_TRAINED[kinds], ""] + how + [""]


def _metrics_section(record: Optional[dict[str, Any]], evaluation: Optional[dict[str, Any]]) -> list[str]:
    """The last training step's metrics, then the last evaluation's (its step named where it is another)."""
    if record is None and evaluation is None:
        return ["## Final metrics", "", "No metrics were logged.", ""]
    rows = [(k, record[k]) for k in FINAL_METRICS if k in record] if record else []
    if evaluation:
        if not record or evaluation.get("step") != record.get("step"):
            rows.append(("eval step", evaluation.get("step")))
        rows += [(k, evaluation[k]) for k in EVAL_METRICS if k in evaluation]
        rows += [(k, v) for k, v in evaluation.items() if k.startswith("eval_loss/")]
    lines = ["## Final metrics", "", "| metric | value |", "| --- | --- |"]
    lines += [f"| {k} | {v:.6g} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in rows]
    return lines + [""]


def render_model_card(output_dir: Path, merged: bool = False) -> str:
    """The card of the export in `output_dir`, or (`merged`) of its merged/ model; the run's files are read
    from `output_dir` either way."""
    info = _read_json(output_dir / "run.json")
    args = info.get("args", {})
    adapter = _read_json(output_dir / "adapter_config.json")
    base_model = (adapter.get("base_model_name_or_path") or info.get("base_model")
                  or args.get("model", {}).get("model_name_or_path") or "unknown")
    name = args.get("hub", {}).get("hub_model_id") or output_dir.name
    epochs, steps = epochs_trained(output_dir, info)
    report = _read_json(output_dir / "data_report.json")
    kinds = trained_kinds(report)
    what = _what(base_model, adapter, merged, (output_dir / MERGED_DIR / "config.json").is_file(), kinds)
    body = _intro(f"{name}/{MERGED_DIR}" if merged else name, what, base_model, epochs, steps,
                  _read_json(output_dir / EXPORT_RECORD))
    if adapter:
        body += _adapter_section(adapter, bool(args.get("lora", {}).get("use_qlora")), base_model)
    body += _data_section(report)
    body += card_section(info)
    body += _hyperparameter_section(args, epochs)
    body += _settings_by_steps_section(info.get("settings_by_steps") or [])
    metrics = output_dir / "metrics.jsonl"
    body += _metrics_section(_last_record(metrics, "loss"), _last_record(metrics, "eval_loss"))
    body += _training_section(info, kinds)
    library = "peft" if adapter and not merged else "transformers"
    datasets = tuple(s["name"] for s in report.get("sources", []) if s.get("hub_dataset") and s.get("name"))
    return _front_matter(base_model, library, bool(adapter), datasets, kinds) + "\n".join(body)


def _write(path: Path, text: str) -> Path:
    tmp = path.with_suffix(".md.tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return path


def write_model_card(output_dir: Path) -> Path:
    """README.md of the export, and of its merged/ model when the run wrote one; returns the first."""
    if (output_dir / MERGED_DIR / "config.json").is_file():
        _write(output_dir / MERGED_DIR / "README.md", render_model_card(output_dir, merged=True))
    return _write(output_dir / "README.md", render_model_card(output_dir))


def main(argv: Optional[list[str]] = None, prog: str = "open_sft model-card") -> int:
    parser = WholeFlagParser(prog=prog, description="(re)write README.md, the model card, of a run's export")
    parser.add_argument("output_dir", type=Path, help="a run's --output_dir (holds run.json)")
    args = parser.parse_args(argv)
    if not (args.output_dir / "run.json").is_file():
        print(f"error: {args.output_dir / 'run.json'} not found; pass the --output_dir of a finished run", file=sys.stderr)
        return 2
    print(write_model_card(args.output_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
