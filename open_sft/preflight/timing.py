"""The run's wall time, from a probe of its own first optimizer steps (printed by --dry_run and logged at the
start of every run): steps are timed after a warm-up one and the rest estimated in proportion to the token
positions each step computes (open_sft.preflight.estimate.step_slots). Evaluations and checkpoint saves are
counted at their cadence (--eval_steps and the one at the end, --checkpointing_steps) and timed on the first of
each: until one has happened the estimate says it leaves them out, then it is logged again with them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional


@dataclass
class TimeProbe:
    """Times the optimizer steps after a warm-up one; estimates the rest in proportion to tokens computed
    (a step's time grows with the token positions it computes: padding included, since it is computed)."""

    total_steps: int
    step_slots: list[int]  # token positions computed (all ranks) at every step of the schedule
    warmup: int = 1
    probe_steps: int = 3
    seconds: list[float] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)

    def record(self, step_index: int, seconds: float) -> None:
        """`step_index` is 0-based within this launch (a resumed run starts again from its warm-up)."""
        if self.warmup <= step_index < self.warmup + self.probe_steps:
            self.seconds.append(seconds)

    @property
    def done(self) -> bool:
        return len(self.seconds) >= self.probe_steps

    def estimate_seconds(self, first_step: int, probed_from: int) -> float:
        """Training time of steps first_step..total from the probe steps (which began at probed_from)."""
        probed = self.step_slots[probed_from:probed_from + len(self.seconds)]
        rate = sum(self.seconds) / max(sum(probed), 1)
        return rate * sum(self.step_slots[first_step:self.total_steps])


@dataclass(frozen=True)
class Cadence:
    """The evaluations and checkpoint saves that steps first+1..total of a launch hold."""

    evals: int = 0
    saves: int = 0

    @classmethod
    def of(cls, first: int, total: int, eval_steps: Optional[int], evaluates: bool, checkpointing_steps: Any,
           ends_epoch: Callable[[int], bool]) -> "Cadence":
        """`evaluates`: there is eval data (then every --eval_steps steps and at the last step, once where the two
        meet); `checkpointing_steps`: None, N (as a string or int) or "epoch" (`ends_epoch(step)` says which)."""
        steps = range(first + 1, total + 1)
        evals = sum(1 for s in steps if s == total or (eval_steps and s % eval_steps == 0)) if evaluates else 0
        if checkpointing_steps is None:
            saves = 0
        elif checkpointing_steps == "epoch":
            saves = sum(1 for s in steps if ends_epoch(s))
        else:
            saves = total // int(checkpointing_steps) - first // int(checkpointing_steps)
        return cls(evals, saves)


def _overhead(count: int, what: str, times: list[float]) -> tuple[float, str]:
    """(seconds, words) of `count` evaluations or saves, timed on the first of `times` (this launch's)."""
    if not count:
        return 0.0, ""
    noun = what if count == 1 else what + "s"
    if not times:
        return 0.0, f"{count} {noun}, not yet measured"
    return count * times[0], f"{count} {noun} × {times[0]:.1f}s"


def format_seconds(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"



class StepTimer:
    """After-step hook: records the seconds of each optimizer step of this launch, and once the probe steps are
    done logs the run's time estimate (the probe is the run's own first steps: nothing is spent twice): training,
    plus the `cadence`'s evaluations and checkpoint saves at the time the first of each took (`eval_times` and
    `save_times`, the trainer's and the checkpointer's lists, filled as they happen: this hook runs after the
    checkpointer's). The estimate is logged again once the first evaluation, and the first save, is timed."""

    def __init__(self, probe: TimeProbe, start_step: int, log: Any = None, cadence: Cadence = Cadence(),
                 eval_times: Optional[list[float]] = None, save_times: Optional[list[float]] = None):
        self.probe, self.start_step, self.log, self.cadence = probe, start_step, log, cadence
        self.eval_times = [] if eval_times is None else eval_times
        self.save_times = [] if save_times is None else save_times
        self.index = 0
        self.elapsed = 0.0  # seconds of the steps recorded so far
        self.warmup_seconds = 0.0
        self.training: Optional[float] = None  # the optimizer steps' estimate
        self.estimate: Optional[float] = None  # with the evaluations and saves measured so far
        self.said: tuple[bool, bool] = (False, False)  # (an eval, a save) timed when the estimate was last logged

    def __call__(self, done: int, seconds: float) -> bool:
        self.probe.record(self.index, seconds)
        self.elapsed += seconds
        if self.index < self.probe.warmup:
            self.warmup_seconds += seconds
        self.index += 1
        if self.training is None and self.probe.done:
            probed_from = self.start_step + self.probe.warmup
            self.training = self.warmup_seconds + self.probe.estimate_seconds(probed_from, probed_from)
            self._say(done, f"(measured on steps {probed_from + 1}-{done})")
        elif self.training is not None and self.said != (bool(self.eval_times), bool(self.save_times)):
            self._say(done, "(refined)")
        return False

    def _say(self, done: int, measured: str) -> None:
        """Logs the estimate while steps remain: after the last one (a run as short as its probe) it tells nothing."""
        self.estimate, line = self.describe(self.training)
        self.said = (bool(self.eval_times), bool(self.save_times))
        if self.log is not None and done < self.probe.total_steps:
            self.log(f"time estimate: {line} for steps {self.start_step + 1}-{self.probe.total_steps} {measured}")

    def describe(self, training: float) -> tuple[float, str]:
        """(seconds, words) of `training` seconds of steps plus the evaluations and saves."""
        evals, eval_words = _overhead(self.cadence.evals, "evaluation", self.eval_times)
        saves, save_words = _overhead(self.cadence.saves, "checkpoint save", self.save_times)
        parts = [words for words in (eval_words, save_words) if words]
        if not parts:
            return training, format_seconds(training)
        return training + evals + saves, (f"{format_seconds(training + evals + saves)} (training "
                                          f"{format_seconds(training)} + {' + '.join(parts)})")


def run_timer(job: Any, trainer: Any, start_step: int, log: Any = None,
              save_times: Optional[list[float]] = None) -> StepTimer:
    """The StepTimer of a launch from `start_step`: its probe, its cadence of evaluations (the trainer's eval data,
    --eval_steps) and saves (--checkpointing_steps), the trainer's evaluation times and the checkpointer's saves'."""
    steps = trainer.steps
    cadence = Cadence.of(start_step, steps.total_steps, trainer.args.eval_steps, trainer.eval_data is not None,
                         job.config.checkpoint.checkpointing_steps, steps.ends_epoch)
    return StepTimer(TimeProbe(steps.total_steps, job.preflight.step_slots), start_step, log, cadence,
                     trainer.eval_seconds, save_times)
