"""The run's wall time, from a probe of its own first optimizer steps (printed by --dry_run and logged at the
start of every run): steps are timed after a warm-up one and the rest estimated in proportion to the token
positions each step computes (open_sft.preflight.estimate.step_slots)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


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


def format_seconds(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"



class StepTimer:
    """After-step hook: records the seconds of each optimizer step of this launch, and once the probe steps are
    done logs the training-time estimate (the probe is the run's own first steps: nothing is spent twice)."""

    def __init__(self, probe: TimeProbe, start_step: int, log: Any = None):
        self.probe, self.start_step, self.log = probe, start_step, log
        self.index = 0
        self.elapsed = 0.0  # seconds of the steps recorded so far
        self.warmup_seconds = 0.0
        self.estimate: Optional[float] = None

    def __call__(self, done: int, seconds: float) -> bool:
        self.probe.record(self.index, seconds)
        self.elapsed += seconds
        if self.index < self.probe.warmup:
            self.warmup_seconds += seconds
        self.index += 1
        if self.estimate is None and self.probe.done:
            probed_from = self.start_step + self.probe.warmup
            self.estimate = self.warmup_seconds + self.probe.estimate_seconds(probed_from, probed_from)
            if self.log is not None:
                self.log(f"time estimate: {format_seconds(self.estimate)} for steps {self.start_step + 1}-"
                         f"{self.probe.total_steps} (measured on steps {probed_from + 1}-{done})")
        return False
