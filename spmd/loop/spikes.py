"""Loss spikes: a step whose loss is far above its recent history, and what the run does about it.

The test is robust to the noise of small batches and to a loss that is still falling: a step
spikes when its loss exceeds the median of the last `spikes.window` finite, unspiked losses
by more than `spikes.factor` times their spread (1.4826 x the median absolute deviation, a
standard deviation's estimate that one outlier does not move, and at least 1% of the median so a
flat loss does not make every wobble a spike), or the same bound over the newer half of them
(at least 2 x SETTLE), whichever is lower: early in a run the window still holds the steep first fall,
whose median and spread would let a jump back to the starting loss pass; the newer half holds the
phase the run is in. Fewer than SETTLE losses are not judged.

A step's loss is `healthy` when it is within HEALTHY (3) spreads of that median: retention keeps the
newest checkpoint written at a healthy step (spmd.io.checkpoint.Checkpointer), so a loss that
climbs without a single spike never rotates the last good checkpoint away.

`spikes.action` (the `[spikes]` table):
- `stop`: the run stops with one `error:` line (exit 2) before any hook sees the step.
- `skip`: the step takes the threshold as an input and leaves the state unchanged when its loss
  is above it (as for a non-finite loss), as MaxText skips spiking steps.
- `rollback`: as PaLM did, the state of the newest checkpoint before the spike is restored and the
  data moves on by `spikes.skip_batches` batches past the ones that led to it; at most
  `spikes.max_rollbacks` times a run (`roll_back`).

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
HEALTHY = 3  # spreads above the median a healthy loss stays within


@dataclasses.dataclass(frozen=True)
class SpikesConfig:
    """The `[spikes]` table (module doc)."""

    # a loss this many robust spreads above the median of the last `window` losses; 0: no test
    factor: float = 6.0
    window: int = 64
    action: str = "stop"  # stop | skip | rollback
    skip_batches: int = 0  # rollback: batches skipped past the ones that led to the spike
    max_rollbacks: int = 3  # rollback: a run stops at the next spike after this many

    def check(self) -> list[str]:
        problems = []
        if not 0 <= self.factor < float("inf"):
            problems.append(f"spikes.factor must be >= 0 (0: no spike test), got {self.factor}")
        if self.window < 2:
            problems.append(f"spikes.window must be at least 2, got {self.window}")
        if self.action not in ON_SPIKE:
            problems.append(f"spikes.action must be one of {', '.join(ON_SPIKE)}, got {self.action!r}")
        if self.skip_batches < 0 or self.max_rollbacks < 0:
            problems.append("spikes.skip_batches and spikes.max_rollbacks must be >= 0")
        return problems


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
    last_healthy: bool = True  # whether the newest observed loss was healthy (module doc)

    @classmethod
    def for_config(cls, settings: SpikesConfig, meta: dict | None = None) -> "SpikeGuard":
        guard = cls(settings.factor, settings.window, settings.action)
        saved = (meta or {}).get("spikes") or {}
        guard.losses = collections.deque(saved.get("losses", []), maxlen=settings.window)
        guard.spikes, guard.rollbacks = int(saved.get("spikes", 0)), int(saved.get("rollbacks", 0))
        guard.first_anomaly = saved.get("first_anomaly")
        return guard

    def to_meta(self) -> dict:
        return {
            "losses": list(self.losses),
            "spikes": self.spikes,
            "rollbacks": self.rollbacks,
            "first_anomaly": self.first_anomaly,
            "healthy": self.last_healthy,
        }

    def _bounds(self) -> list[tuple[float, float]]:
        """(median, spread) of the whole history and of its newer half (module doc)."""
        history = list(self.losses)
        out = []
        for part in (history, history[-max(2 * SETTLE, len(history) // 2) :]):
            median = statistics.median(part)
            spread = 1.4826 * statistics.median(abs(x - median) for x in part)
            out.append((median, max(spread, 0.01 * abs(median))))
        return out

    def threshold(self) -> float:
        """The loss above which the next step spikes (inf while the test is off or unsettled)."""
        if not self.factor or len(self.losses) < min(SETTLE, self.window):
            return math.inf
        return min(median + self.factor * spread for median, spread in self._bounds())

    def healthy(self, loss: float) -> bool:
        """Whether `loss` is within HEALTHY spreads of the recent losses (True while unsettled)."""
        if len(self.losses) < min(SETTLE, self.window):
            return True
        return any(loss <= median + HEALTHY * spread for median, spread in self._bounds())

    def observe(self, step: int, loss: float, skipped: bool, spiked: bool = False) -> None:
        """One finished step: `skipped` (its update was not applied: a non-finite loss, or above the
        threshold it was given, `spiked`). Raises Spiked or Rollback for a spike the step itself
        did not skip."""
        if skipped or not math.isfinite(loss):
            self.last_healthy = False
            if self.first_anomaly is None:
                self.first_anomaly = step
            if spiked:
                self.spikes += 1
            return
        limit = self.threshold()
        self.last_healthy = self.healthy(loss)
        if loss > limit:
            if self.first_anomaly is None:
                self.first_anomaly = step
            self.spikes += 1
            if self.on_spike == "rollback":
                raise Rollback(step, loss, limit)
            raise Spiked(
                f"loss spike at step {step}: loss {loss:.4f} is above {limit:.4f} (the median of the last "
                f"{len(self.losses)} steps' losses, or of their newer half, plus spikes.factor={self.factor:g} "
                f"times their spread), "
                f"and spikes.action = stop. The checkpoints from before step {step} are kept: lower "
                f"optimizer.learning_rate or set spikes.action = rollback or skip, then resume"
            )
        self.losses.append(loss)


def roll_back(spike: Rollback, guard: SpikeGuard, settings: SpikesConfig, batch_size: int, batches,
              committed: list[int], restore) -> tuple[dict, dict, int, int]:  # fmt: skip
    """Under action = rollback: (the state as saved, its meta, the step restored, the batches
    skipped) of the newest committed checkpoint before the spike (`committed`: the steps;
    `restore(step)` reads one), with the data (`batches`) moved past the batches that led to the
    spike and `settings.skip_batches` more, and the guard's loss history as of that checkpoint (its
    counts as of now). Raises Spiked where there is nothing to go back to or the run has rolled
    back `max_rollbacks` times."""
    before = [s for s in committed if s < spike.step]
    what = f"loss spike at step {spike.step} (loss {spike.loss:.4f}, above {spike.threshold:.4f})"
    if not before:
        raise Spiked(
            f"{what}, and no checkpoint before it to roll back to; set checkpoint.every so that one is "
            f"written, or lower optimizer.learning_rate"
        )
    if guard.rollbacks >= settings.max_rollbacks:
        raise Spiked(
            f"{what} after {guard.rollbacks} rollbacks (spikes.max_rollbacks): the run stops; the "
            f"checkpoints from before the first spike are kept"
        )
    target = before[-1]
    # past the batch of the spiking step (and those of earlier rollbacks) and N more
    position = batches.consumed_samples(spike.step) + settings.skip_batches * batch_size
    state, meta = restore(target)
    skip = (position - int(meta["consumed_samples"])) // batch_size
    batches.resume_at(target, position)
    counts = (guard.spikes, guard.rollbacks + 1, guard.first_anomaly)
    guard.losses = SpikeGuard.for_config(settings, meta).losses  # the history as of the checkpoint
    guard.spikes, guard.rollbacks, guard.first_anomaly = counts
    return state, meta, target, skip
