"""The accumulators of one logging window: global sums over ranks, saved with a checkpoint so that a resumed
run logs what the uninterrupted run logs."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field


@dataclass
class Window:
    """Accumulators of one logging window (global sums over ranks)."""

    loss_sum: float = 0.0
    trained_tokens: int = 0
    tokens: int = 0
    flops: float = 0.0  # the strict count's (mfu)
    flops_palm: float = 0.0  # the PaLM count's (mfu_palm); 0 in a window saved before it was counted
    padded_slots: int = 0  # token positions computed, padding included
    busiest_rank_slots: int = 0  # per step, the positions the busiest rank computed; summed over steps
    source_loss: list[float] = field(default_factory=list)  # per source of the mixture: loss sum
    source_tokens: list[int] = field(default_factory=list)  # and trained tokens
    aux_sum: float = 0.0  # --load_balancing_loss: the router aux loss × trained tokens of each pass
    started: float = 0.0  # perf_counter when it opened (a resumed window: moved back by its seconds so far)
    carried: float = 0.0  # a resumed window's seconds before the checkpoint (not saved: `seconds` is)

    def to_state(self, now: float | None = None) -> dict:
        """Every accumulator, and the training seconds it has run up to `now` (a perf_counter reading; None: now),
        for a checkpoint."""
        state = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                 if f.name not in ("started", "carried")}
        return {**state, "seconds": (time.perf_counter() if now is None else now) - self.started}

    @classmethod
    def from_state(cls, state: dict) -> "Window":
        """The window a checkpoint saved, continuing: its throughput counts the seconds it ran before
        the checkpoint, not the downtime. (Checkpoints before padded_slots was saved: no padding known.)"""
        state = dict(state)
        seconds = float(state.pop("seconds", 0.0))
        state.setdefault("padded_slots", state.get("tokens", 0))
        state.setdefault("busiest_rank_slots", 0)
        return cls(**state, started=time.perf_counter() - seconds, carried=seconds)

    def add(self, result: dict, n_sources: int) -> None:
        """One optimizer step's sums (Trainer.train_step's result)."""
        for name in ("loss_sum", "trained_tokens", "tokens", "flops", "flops_palm", "padded_slots",
                     "busiest_rank_slots", "aux_sum"):
            setattr(self, name, getattr(self, name) + result[name])
        self.source_loss = [a + b for a, b in zip(self.source_loss or [0.0] * n_sources, result["source_loss"])]
        self.source_tokens = [a + b for a, b in zip(self.source_tokens or [0] * n_sources, result["source_tokens"])]


class TrainingClock:
    """This launch's training seconds: the loop's wall time less its pauses (evaluation, checkpoint saves and the
    other after-step hooks), which neither elapsed_s nor a window's throughput counts (they did: a window with an
    evaluation in it logged 10 tokens/s against 6,000 in training, and the run's summary reported 8x too low)."""

    def __init__(self) -> None:
        self.started: float | None = None
        self.paused = 0.0
        self.paused_since: float | None = None  # when the pause under way began (None: training)

    def start(self, window: Window) -> None:
        """The loop starts: the open window (fresh, or resumed with its seconds before) counts from now."""
        self.started, self.paused, self.paused_since = time.perf_counter(), 0.0, None
        window.started = self.started - window.carried

    def stop(self) -> None:
        """The loop has ended: training time stands still from here (the export is not training: RUN_COMPLETE's
        elapsed_s counted it, seconds to minutes past metrics.jsonl's last)."""
        self.paused_since = time.perf_counter()

    def now(self) -> float:
        """The perf_counter reading training time stands at: within a pause, the pause's start. A checkpoint saved in
        one records the seconds before it (it recorded its own save too: the resumed run's elapsed_s and first
        window counted the minutes a large model's save takes)."""
        return time.perf_counter() if self.paused_since is None else self.paused_since

    def seconds(self) -> float:
        return 0.0 if self.started is None else self.now() - self.started - self.paused

    @contextlib.contextmanager
    def pause(self, window: Window):
        """What runs inside is not training time: this launch's seconds and the open window skip it."""
        began = self.paused_since = time.perf_counter()
        try:
            yield
        finally:
            took = time.perf_counter() - began
            self.paused += took
            window.started += took
            self.paused_since = None

