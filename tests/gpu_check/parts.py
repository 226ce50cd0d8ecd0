"""The parts of a GPU check, each a function of the check's context returning its figures and "pass":
correctness (batch layouts, packed rows, the fused LM-head loss, the attention candidates, kill and resume),
features (each a run held to a falling loss and an export that reloads, some to more), and speed."""

from __future__ import annotations

import signal
from typing import Optional

from tests.gpu_check import runs, speed
from tests.gpu_check.context import Context, RunResult
from tests.gpu_check.runs import falling, finetune, reload_export

CORRECTNESS = ["batch_layouts", "packed", "fused_ce", "attention", "kill_resume"]
FEATURES = ["dtype_auto", "liger", "qlora", "zero2", "zero3", "fsdp2", "gradient_checkpointing",
            "auto_micro_batch_size", "torch_compile"]
SPEED = ["speed", "fp8", "speed_8b"]


# ------------------------------------------------------------------------------------------------------------
# correctness
# ------------------------------------------------------------------------------------------------------------
def part_batch_layouts(ctx: Context) -> dict:
    """Per-step losses of one global batch of 8 as bs 8 x GA 1 and as bs 2 x GA 4."""
    figures, ok = {}, True
    layouts = ctx.dtypes_with_tolerance()
    shapes = {"bs8": [], "bs2ga4": ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "4"]}
    jobs = [(dtype, shape) for dtype, _ in layouts for shape in shapes]
    done = dict(zip(jobs, runs.together(ctx, *[
        lambda d=d, s=s: finetune(ctx, f"layout_{d}_{s}", ["--torch_dtype", d, *shapes[s]]) for d, s in jobs])))
    for dtype, tolerance in layouts:
        one, four = done[dtype, "bs8"], done[dtype, "bs2ga4"]
        diff = max(abs(a - b) / abs(a) for a, b in zip(one.losses, four.losses))
        figures[dtype] = {"max_rel_diff": diff, "tolerance": tolerance, "steps": len(one.losses),
                          "losses_bs8": one.losses, "losses_bs2ga4": four.losses}
        ok = ok and len(one.losses) == len(four.losses) == ctx.steps and diff <= tolerance
    return {"pass": ok, **figures}


def part_kill_resume(ctx: Context) -> dict:
    """kill -9 at step 5 of 10 (checkpoints every 2 steps), relaunch; against the uninterrupted run, and two
    uninterrupted runs against each other (the device's run-to-run spread)."""
    extra = ["--max_train_steps", "10", "--checkpointing_steps", "2", "--torch_dtype", ctx.train_dtype]

    def killed_and_resumed() -> tuple[int, RunResult]:
        code = runs.interrupt(ctx, "resume_killed", extra, at_line=5)
        return code, finetune(ctx, "resume_killed", extra, fresh=False)

    chains = [lambda: finetune(ctx, "resume_base", extra), killed_and_resumed]
    if not ctx.smoke:
        chains.append(lambda: finetune(ctx, "resume_repeat", extra))
    base, (killed_code, resumed), *more = runs.together(ctx, *chains)
    repeat = more[0] if more else base
    spread = max(abs(a - b) / abs(a) for a, b in zip(base.losses, repeat.losses))
    diff = max(abs(a - b) / abs(a) for a, b in zip(base.losses, resumed.losses))
    tolerance = max(2 * spread, 1e-6)
    return {"pass": killed_code == -signal.SIGKILL and len(resumed.losses) == 10 and diff <= tolerance,
            "bitwise": base.losses == resumed.losses, "max_rel_diff": diff, "run_to_run_rel_diff": spread,
            "tolerance": tolerance, "killed_exit": killed_code, "resumed_from": resumed.resumed_from}


def part_probe(name: str):
    """A probe (tests/gpu_check/test_{name}.py) as a part."""
    def part(ctx: Context) -> dict:
        return runs.probe(ctx, name)

    part.__name__ = f"part_{name}"
    return part


# ------------------------------------------------------------------------------------------------------------
# features
# ------------------------------------------------------------------------------------------------------------
def feature(name: str, extra: list[str], launcher: str = "python", check=None, beside: Optional[list[str]] = None):
    """A feature's run, held to `check(ctx, result, other)`; `other` is the run of the flags `beside` (made at
    the same time on a GPU), or None."""

    def part(ctx: Context) -> dict:
        def run():
            return finetune(ctx, name, extra, launcher=launcher)

        result, other = (run(), None) if beside is None else runs.together(
            ctx, run, lambda: finetune(ctx, f"{name}_eager", beside))
        figures = {"losses": result.losses, "compute_dtype": result.run.get("compute_dtype"),
                   "peak_memory_gib": result.peak_memory_gib, "falling": falling(result.losses)}
        figures["export_reloads"] = reload_export(ctx, result.out)
        ok = figures["falling"] and figures["export_reloads"] is True
        if check is not None:
            more, fine = check(ctx, result, other)
            figures.update(more)
            ok = ok and fine
        return {"pass": bool(ok), **figures}

    part.__name__ = f"part_{name}"
    return part


def _auto_dtype(ctx: Context, result, _other) -> tuple[dict, bool]:
    want = "torch.bfloat16" if ctx.gpu else result.run.get("compute_dtype")
    return {"expected_dtype": want}, result.run.get("compute_dtype") == want


def _micro_batch(ctx: Context, result, _other) -> tuple[dict, bool]:
    schedule = result.run.get("schedule", {})
    chosen = schedule.get("micro_batch_size")
    return {"micro_batch_chosen": f"{chosen} x GA {schedule.get('gradient_accumulation_steps')}"}, \
        isinstance(chosen, int) and chosen >= 1


def _liger_modules(ctx: Context, result, _other) -> tuple[dict, bool]:
    return runs.liger_replacements(ctx, result)


def _same_as_eager(ctx: Context, result, eager) -> tuple[dict, bool]:
    """The compiled layers' losses against the same run uncompiled (inductor's fused kernels round bf16 once
    where eager rounds after every op, so the bf16 tolerance is batch_layouts')."""
    half = "bfloat16" in str(result.run.get("compute_dtype"))  # --torch_dtype auto: bf16 on GPUs and some CPUs
    tolerance = ctx.tolerance("bfloat16" if half else "float32")
    diff = max(abs(a - b) / abs(a) for a, b in zip(eager.losses, result.losses))
    return {"max_rel_diff_to_eager": diff, "tolerance": tolerance, "losses_eager": eager.losses,
            "compiled": runs.log_lines(ctx, "torch_compile", "--torch_compile")}, \
        len(eager.losses) == len(result.losses) and diff <= tolerance


PARTS = {
    "batch_layouts": part_batch_layouts,
    "packed": part_probe("packed"),
    "fused_ce": part_probe("fused_ce"),
    "attention": part_probe("attention"),
    "kill_resume": part_kill_resume,
    "dtype_auto": feature("dtype_auto", [], check=_auto_dtype),
    "liger": feature("liger", ["--use_liger_kernel"], check=_liger_modules),
    "qlora": feature("qlora", ["--use_qlora", "--lora_rank", "16", "--merge_lora_on_save", "--learning_rate",
                               "1e-3"]),
    "zero2": feature("zero2", [], launcher="zero2.json"),
    "zero3": feature("zero3", [], launcher="zero3.json"),
    "fsdp2": feature("fsdp2", [], launcher="fsdp2"),
    "gradient_checkpointing": feature("gradient_checkpointing", ["--gradient_checkpointing"]),
    "auto_micro_batch_size": feature("auto_micro_batch_size", ["--auto_micro_batch_size"], check=_micro_batch),
    "torch_compile": feature("torch_compile", ["--torch_compile"], check=_same_as_eager, beside=[]),
    "speed": speed.speed,
    "fp8": speed.fp8,
    "speed_8b": speed.speed_8b,
}


def group_of(name: str) -> str:
    return "correctness" if name in CORRECTNESS else "feature" if name in FEATURES else "speed"

