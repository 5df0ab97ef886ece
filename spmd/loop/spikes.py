"""Loss spikes: a step whose loss is far above its recent history, and what the run does about it.

The test is robust to the noise of small batches and to a loss that is still falling: a step
spikes when its loss exceeds the median of the last `train.spike_window` finite, unspiked losses
by more than `train.spike_factor` times their spread (1.4826 x the median absolute deviation, a
standard deviation's estimate that one outlier does not move, and at least 1% of the median so a
flat loss does not make every wobble a spike). Fewer than SETTLE losses are not judged.

`train.on_spike`:
- `stop`: the run stops with one `error:` line (exit 2) before any hook sees the step.
- `skip`: the step takes the threshold as an input and leaves the state unchanged when its loss
  is above it (as for a non-finite loss), as MaxText skips spiking steps.
- `rollback`: as PaLM did, the state of the newest checkpoint before the spike is restored and the
  data moves on by `train.spike_skip_batches` batches past the ones that led to it; at most
  `train.max_rollbacks` times a run.

The history travels with every checkpoint (`SpikeGuard.to_meta`), so a resumed run judges as
the uninterrupted one would, and a rollback killed midway replays to the same losses.
"""

import collections
import dataclasses
import math
import statistics

from spmd.core.errors import UserError

ON_SPIKE = ("stop", "skip", "rollback")
SETTLE = 8  # losses seen before any step is judged


class Rollback(Exception):  # noqa: N818 — a control signal, not an error
    """A spike under on_spike = rollback: the loop restores a checkpoint before `step`."""

    def __init__(self, step: int, loss: float, threshold: float):
        super().__init__(step)
        self.step, self.loss, self.threshold = step, loss, threshold


class Spiked(UserError):
    """A spike under on_spike = stop (exit code 2)."""


@dataclasses.dataclass
class SpikeGuard:
    factor: float  # 0: no spike test
    window: int
    on_spike: str = "stop"
    losses: collections.deque = dataclasses.field(default_factory=collections.deque)  # recent finite ones
    spikes: int = 0  # spiking steps seen (skipped or rolled back)
    rollbacks: int = 0
    first_anomaly: int | None = None  # the first step with a spike or a non-finite loss

    @classmethod
    def for_config(cls, tcfg, meta: dict | None = None) -> "SpikeGuard":
        guard = cls(tcfg.spike_factor, tcfg.spike_window, tcfg.on_spike)
        saved = (meta or {}).get("spikes") or {}
        guard.losses = collections.deque(saved.get("losses", []), maxlen=tcfg.spike_window)
        guard.spikes, guard.rollbacks = int(saved.get("spikes", 0)), int(saved.get("rollbacks", 0))
        guard.first_anomaly = saved.get("first_anomaly")
        return guard

    def to_meta(self) -> dict:
        return {
            "losses": list(self.losses),
            "spikes": self.spikes,
            "rollbacks": self.rollbacks,
            "first_anomaly": self.first_anomaly,
        }

    def threshold(self) -> float:
        """The loss above which the next step spikes (inf while the test is off or unsettled)."""
        if not self.factor or len(self.losses) < min(SETTLE, self.window):
            return math.inf
        median = statistics.median(self.losses)
        spread = 1.4826 * statistics.median(abs(x - median) for x in self.losses)
        return median + self.factor * max(spread, 0.01 * abs(median))

    def observe(self, step: int, loss: float, skipped: bool, spiked: bool = False) -> None:
        """One finished step: `skipped` (its update was not applied: a non-finite loss, or above the
        threshold it was given, `spiked`). Raises Spiked or Rollback for a spike the step itself
        did not skip."""
        if skipped or not math.isfinite(loss):
            if self.first_anomaly is None:
                self.first_anomaly = step
            if spiked:
                self.spikes += 1
            return
        limit = self.threshold()
        if loss > limit:
            if self.first_anomaly is None:
                self.first_anomaly = step
            self.spikes += 1
            if self.on_spike == "rollback":
                raise Rollback(step, loss, limit)
            raise Spiked(
                f"loss spike at step {step}: loss {loss:.4f} is above {limit:.4f} (the median of the last "
                f"{len(self.losses)} steps' losses plus train.spike_factor={self.factor:g} times their spread), "
                f"and train.on_spike = stop. The checkpoints from before step {step} are kept: lower "
                f"optimizer.learning_rate or set train.on_spike = rollback or skip, then resume"
            )
        self.losses.append(loss)
