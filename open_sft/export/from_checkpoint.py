"""`open_sft export CHECKPOINT_DIR OUT`: any complete step checkpoint as a Hugging Face model directory, on one
CPU process, while the run may still be going.

The run's own end export writes the model it holds in memory; this command writes the same files from a
checkpoint alone: the weights from the engine's files (open_sft.export.checkpoint_weights), everything else from
the checkpoint's model/ directory (config, tokenizer, generation config, adapter config: written by the run at
each checkpoint, open_sft.export.save.write_model_files). A full model is written shard by shard, each output shard
loaded, converted and written before the next (transformers' own save_pretrained needs the whole state dict in
memory, which is what this command must not need); its key names, tied weights and weight-format conversions
follow save_pretrained's (the same transformers helpers, run on an empty model). A LoRA run gives its adapter and,
with --merge_lora, the merged model (held whole while merging, as the run's own merge does).

The run's directory is only read: OUT is written through a staging directory inside OUT, so a failed export leaves
OUT as it was, and OUT may not be the run's output directory nor inside its checkpoints, nor a directory of files
these commands did not write (open_sft.export.target). Beside the model OUT gets export.json (which checkpoint,
which step, the engine that wrote it), a model card that names the step and, for a checkpoint in a run's live
checkpoints/ (`run_of`), the run's run.json and data_report.json and metrics.jsonl up to the checkpoint's step.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Optional

import torch

from open_sft.config.whole_flags import WholeFlagParser
from open_sft.durable import human_size, out_of_space
from open_sft.errors import UserError
from open_sft.export.checkpoint_weights import CheckpointWeights, describe, open_weights
from open_sft.export.model_card import EXPORT_RECORD
from open_sft.export.shard_size import shard_size_problem
from open_sft.export.target import check_target
from open_sft.file_modes import writable_dir_problem

logger = logging.getLogger(__name__)

RUN_FILES = ("run.json", "data_report.json")
# what each checkpoint's model/ directory holds that is not the model's configuration
ADAPTER_CONFIG = "adapter_config.json"


def _checkpoint_of(path: Path) -> tuple[Path, dict[str, Any]]:
    from open_sft.training.checkpoint import MODEL_FILES, STATE_FILE, problem_with

    problem = problem_with(path)
    if problem is not None:
        raise UserError(f"{path}: not a usable checkpoint ({problem}); pass a complete step checkpoint "
                        "(OUTPUT_DIR/checkpoints/step_N)")
    if not (path / MODEL_FILES / "config.json").is_file():
        raise UserError(f"{path} has no {MODEL_FILES}/config.json: it was written by an earlier open_sft, before "
                        "checkpoints kept their model's files; resume the run with this version (its next checkpoint "
                        "can be exported) or use the export the run writes at its end")
    return path / MODEL_FILES, json.loads((path / STATE_FILE).read_text())


def run_of(checkpoint: Path) -> Optional[Path]:
    """The output dir of the run whose live checkpoints/ holds `checkpoint` (its parent, as given, is named
    checkpoints, with the run's run.json beside it); None for a checkpoint copied elsewhere or moved aside
    (checkpoints.previous-K), where the files two levels up are no run's or another timeline's."""
    from open_sft.training.checkpoint import CHECKPOINTS

    parent = Path(os.path.abspath(checkpoint)).parent
    return parent.parent if parent.name == CHECKPOINTS and (parent.parent / "run.json").is_file() else None


def _refuse_run_paths(checkpoint: Path, run_dir: Optional[Path], out: Path) -> None:
    target = out.resolve()
    if run_dir is not None and target == run_dir.resolve():
        raise UserError(f"{out} is the run's own --output_dir: its export would be overwritten; pass another "
                        "directory for the checkpoint's model")
    if run_dir is not None and target.is_relative_to(checkpoint.parent.resolve()):
        raise UserError(f"{out} is inside the run's checkpoints ({checkpoint.parent}), which the run prunes; pass "
                        "a directory outside them")
    if target.is_relative_to(checkpoint.resolve()):
        raise UserError(f"{out} is inside the checkpoint {checkpoint}; pass a directory outside it")
    why = writable_dir_problem(out)
    if why:
        raise UserError(f"{out}: {why}; pass a directory for the checkpoint's model (it is created if missing)")


def write_full_weights(weights: CheckpointWeights, config: Any, directory: Path, dtype: torch.dtype,
                       max_shard_size: str | int) -> None:
    """The model's safetensors shards (and index) in `dtype`, one shard in memory at a time, with
    save_pretrained's key names: tied and ignored keys left out, weight conversions reverted."""
    from accelerate import init_empty_weights
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    with init_empty_weights():
        skeleton = AutoModelForCausalLM.from_config(config)
    skeleton.tie_weights()  # what from_config does outside init_empty_weights: the tied head is then found and left out
    order = {name: i for i, name in enumerate(skeleton.state_dict())}  # the model's order, so its shards are too
    meta = {name: torch.empty(w.shape, dtype=dtype if w.dtype.is_floating_point else w.dtype, device="meta")
            for name, w in sorted(weights.weights.items(), key=lambda item: order.get(item[0], len(order)))}
    for key in skeleton._keys_to_ignore_on_save or ():
        meta.pop(key, None)
    meta = remove_tied_weights_from_state_dict(meta, skeleton)
    split = split_torch_state_dict_into_shards(meta, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=max_shard_size)
    weight_map = {}
    for filename, names in split.filename_to_tensors.items():
        shard = {name: t.to(dtype) if t.is_floating_point() else t for name, t in weights.load(names).items()}
        shard = {name: t.contiguous() for name, t in revert_weight_conversion(skeleton, shard).items()}
        save_file(shard, str(directory / filename), metadata={"format": "pt"})
        weight_map.update({name: filename for name in shard})
        del shard
    if split.is_sharded:
        index = {"metadata": {"total_parameters": skeleton.num_parameters(), **split.metadata},
                 "weight_map": dict(sorted(weight_map.items()))}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _peft_skeleton(files: Path) -> Any:
    """The run's PeftModel without weights: the base from its config on the meta device, its LoRA layers from the
    adapter config; what peft's and our merge's code read (module types, scaling) without any tensor."""
    from accelerate import init_empty_weights
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from open_sft.model.lora_targets import linear_targets_kept

    config = AutoConfig.from_pretrained(files)
    if hasattr(config, "quantization_config"):  # QLoRA's: the skeleton holds no weights to quantize
        del config.quantization_config
    with init_empty_weights():
        base = AutoModelForCausalLM.from_config(config)
    adapter = LoraConfig.from_pretrained(files)
    base.name_or_path = adapter.base_model_name_or_path or ""  # the base it names (peft warned of a rename)
    with linear_targets_kept():  # an MoE's dense MLP and shared experts keep their adapters, as in training
        return get_peft_model(base, adapter)


def write_lora(weights: CheckpointWeights, files: Path, directory: Path, merge: bool,
               dtype: Optional[torch.dtype], max_shard_size: str | int) -> None:
    """The adapter as the run's end export writes it (peft's own save, from the checkpoint's tensors but the
    wrapped base layers'), and with `merge` the merged model in merged/."""
    from open_sft.export.lora_merge import merged_state_dict, write_merged_model
    from open_sft.export.save import MERGED_DIR, cast_floating, write_adapter

    model = _peft_skeleton(files)
    # the adapter's own tensors (LoRA factors, added tokens' rows): all but the wrapped layers' base weights (the
    # bulk of the model; a QLoRA checkpoint holds none: training.trained_state), which the adapter leaves out
    adapter = weights.load(n for n in weights.weights if ".base_layer." not in n)
    write_adapter(model, adapter, directory)
    shutil.copy2(files / ADAPTER_CONFIG, directory / ADAPTER_CONFIG)  # the run's, naming its base
    if merge:
        merged = merged_state_dict(model, {**adapter, **weights.load(n for n in weights.weights if n not in adapter)})
        write_merged_model(model, cast_floating(merged, dtype) if dtype else merged, directory / MERGED_DIR,
                           max_shard_size)


def _copy_model_files(files: Path, directory: Path, dtype: Optional[torch.dtype], adapter: bool) -> None:
    """Tokenizer, generation config and (a full model) config.json with its dtype as exported."""
    for item in files.iterdir():
        if item.name in ("config.json", ADAPTER_CONFIG):
            continue
        shutil.copy2(item, directory / item.name)
    if not adapter:
        config = json.loads((files / "config.json").read_text())
        config["dtype"] = str(dtype).removeprefix("torch.")
        (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _copy_run_files(checkpoint: Path, run_dir: Optional[Path], directory: Path, step: int) -> None:
    """run.json, data_report.json and metrics.jsonl up to `step` (the model card reads them), from the run whose
    live checkpoint it is (`run_of`); none, said, for another checkpoint."""
    from open_sft.training.resume import metrics_up_to

    if run_dir is None:
        logger.info("%s is not in a run's checkpoints/ (its parent is not named checkpoints with the run's run.json "
                    "beside it): %s and metrics.jsonl are left out of the export", checkpoint, ", ".join(RUN_FILES))
        return
    for name in RUN_FILES:
        if (run_dir / name).is_file():
            shutil.copy2(run_dir / name, directory / name)
    if (run_dir / "metrics.jsonl").is_file():
        (directory / "metrics.jsonl").write_text(metrics_up_to(run_dir / "metrics.jsonl", step))


def export_checkpoint(checkpoint: Path, out: Path, dtype_flag: str = "auto",
                      max_shard_size: Optional[str | int] = None, merge: Optional[bool] = None) -> Path:
    """Write the model of `checkpoint` to `out` (see the module's docstring); returns `out`. `max_shard_size` and
    `merge` (merge a LoRA adapter): None is what the run's --max_shard_size and --merge_lora_on_save said."""
    from transformers import AutoConfig

    from open_sft.export.model_card import write_model_card
    from open_sft.export.save import PLACED, save_dtype, staged_export

    files, state = _checkpoint_of(checkpoint)
    run_dir = run_of(checkpoint)
    _refuse_run_paths(checkpoint, run_dir, out)
    check_target(out, "open_sft export", {})
    config = AutoConfig.from_pretrained(files)
    dtype = save_dtype(dtype_flag, config)
    weights = open_weights(checkpoint, fp32=dtype == torch.float32)
    logger.info("checkpoint %s (step %d): %s", checkpoint, state["step"], describe(weights))
    adapter = (files / ADAPTER_CONFIG).is_file()
    lora_flags = state.get("config", {}).get("lora", {})
    if max_shard_size is None:
        max_shard_size = state.get("config", {}).get("checkpoint", {}).get("max_shard_size") or "5GB"
        if shard_size_problem(max_shard_size):
            raise UserError(f"the run's --max_shard_size {shard_size_problem(max_shard_size)} (pass --max_shard_size)")
    merge = bool(lora_flags.get("merge_lora_on_save")) if merge is None else merge
    qlora = bool(lora_flags.get("use_qlora"))
    if adapter and merge and qlora:
        raise UserError(f"{checkpoint}: a QLoRA checkpoint holds the adapter, not the base it trained on (4-bit, "
                        "made again from the base model at each start: open_sft.training.trained_state; the run's "
                        "--merge_lora_on_save merged from its live modules); export the adapter with "
                        "--no_merge_lora, then merge it into the base in bf16 with `open_sft merge-lora OUT MERGED`")
    created = not out.exists()
    try:
        with staged_export(out, written_by="open_sft export") as staging:
            if adapter:
                write_lora(weights, files, staging, merge, dtype, max_shard_size)
            else:
                write_full_weights(weights, config, staging, dtype, max_shard_size)
            _copy_model_files(files, staging, dtype, adapter)
            if adapter and merge:
                _copy_model_files(files, staging / "merged", None, adapter=True)
            _copy_run_files(checkpoint, run_dir, staging, int(state["step"]))
            record = {"checkpoint": str(checkpoint.resolve()), "step": int(state["step"]),
                      "total_steps": state.get("schedule", {}).get("total_steps"), "engine": weights.engine,
                      "dtype": str(dtype).removeprefix("torch."), "lora": adapter, "merged": adapter and merge}
            (staging / EXPORT_RECORD).write_text(json.dumps(record, indent=1) + "\n")
        write_model_card(out)
    except BaseException as exc:
        full = None if isinstance(exc, (KeyboardInterrupt, SystemExit)) else out_of_space(exc, out)
        if created:
            shutil.rmtree(out, ignore_errors=True)
        if isinstance(exc, FileNotFoundError) and not checkpoint.is_dir():
            raise UserError(f"{checkpoint} was deleted while it was being exported (the run prunes old checkpoints: "
                            "--keep_last_n_checkpoints); export a newer one") from exc
        if full is not None:
            size = None if adapter and merge else _weight_bytes(weights, dtype)
            raise UserError(_full_disk(full, checkpoint, out, created, getattr(exc, PLACED, False), size)) from exc
        raise
    return out


def _full_disk(full: str, checkpoint: Path, out: Path, created: bool, placed: bool, size: Optional[int]) -> str:
    """The error line of an export the disk filled: what OUT holds now and (`size`) about what the export needs."""
    left = ("it was removed again" if created else "it holds some of the new export's files: rerun before using it"
            if placed else "it holds what it held before")
    needs = f" (the export needs about {human_size(size)})" if size is not None else ""
    return (f"{full}: {checkpoint} could not be exported to {out} ({left}); free space there{needs} and rerun the "
            "same command")


def _weight_bytes(weights: CheckpointWeights, dtype: torch.dtype) -> int:
    """About what the exported weights take on disk (a full disk's message says it): the checkpoint's tensors (a
    LoRA checkpoint's: its adapter) in the export's dtype. With a merge, the base's size is not known here."""
    return sum(w.shape.numel() * (dtype.itemsize if w.dtype.is_floating_point else w.dtype.itemsize)
               for w in weights.weights.values())


def main(argv: Optional[list[str]] = None, prog: str = "open_sft export") -> int:
    parser = WholeFlagParser(prog=prog, description="write a step checkpoint of a run (any engine: one "
                             "process, DDP, DeepSpeed ZeRO-1/2/3, FSDP2, pipeline stages; full or LoRA) as "
                             "a Hugging Face model directory, on one CPU process; the run may be going on")
    parser.add_argument("checkpoint", type=Path, help="a complete checkpoint: OUTPUT_DIR/checkpoints/step_N")
    parser.add_argument("output_dir", type=Path, help="where the model goes (not the run's --output_dir)")
    parser.add_argument("--save_dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                        help="dtype of the exported weights; auto: the run's (its --save_dtype, else the base model's)")
    parser.add_argument("--max_shard_size", default=None, help="largest safetensors file, e.g. 5GB or 500MB "
                        "(default: the run's --max_shard_size)")
    parser.add_argument("--merge_lora", action="store_true", default=None,
                        help="LoRA checkpoints: also write the merged model in merged/ (default: as the run's "
                             "--merge_lora_on_save)")
    parser.add_argument("--no_merge_lora", dest="merge_lora", action="store_false",
                        help="LoRA checkpoints: the adapter alone, whatever the run's --merge_lora_on_save said")
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    try:
        if args.max_shard_size is not None and shard_size_problem(args.max_shard_size):
            raise UserError(f"--max_shard_size {shard_size_problem(args.max_shard_size)}")
        out = export_checkpoint(args.checkpoint, args.output_dir, args.save_dtype, args.max_shard_size,
                                args.merge_lora)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
