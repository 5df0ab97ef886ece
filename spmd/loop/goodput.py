"""Goodput: where a run's wall time went, and which part of it trained the model.

Every second of a run falls in one bucket:

  init        process start to the first compile: imports, mesh, restore or init
  compile     compiling the train step
  data_wait   building and transferring batches on the host
  productive  training steps (dispatch and wait), less data_wait
  checkpoint  the blocking part of saves (the copy to host, the final commit wait)
  eval        held-out evaluation (including its compile)
  lost        steps trained and then lost to a restart: the steps an earlier attempt logged after the
              checkpoint this attempt resumed from (their time as that attempt measured it)
  other       the rest: metrics, progress display, profiler

`goodput` = productive / all of them. The ledger is cumulative over restarts: each checkpoint
saves it, and a resumed run carries on from the ledger of the step it restored (what the dead
attempt spent after that checkpoint shows up as `lost`). What no process saw is not counted: a
killed attempt's time after its last log line, and the gap before the restart.

Beside the buckets, the run directory's `restores.jsonl` lists every restore: the step and tier
it came from (storage, local or peer: spmd.io.local_tier), the steps an earlier attempt had logged
past it (trained again), and the seconds the restore took (inside `init`). It is appended to, never
rolled back with a checkpoint: a restore to a checkpoint older than an earlier restore keeps both.
"""

import json
import pathlib
import time

RESTORES = "restores.jsonl"

BUCKETS = ("init", "compile", "data_wait", "productive", "checkpoint", "eval", "lost", "other")


class Ledger:
    """Seconds per bucket for this run, over all its attempts."""

    def __init__(self, started: float, carried: dict | None = None):
        """`started`: time.perf_counter() when this process started its work; `carried`: the ledger
        a resumed checkpoint saved (`totals()` of an earlier attempt)."""
        self.started = started
        carried = carried or {}
        self.carried = {b: _seconds(carried.get(b)) for b in BUCKETS}
        self.spent = dict.fromkeys(BUCKETS, 0.0)  # this attempt's, measured
        self.restores: list[dict] = []  # the run's restores (read_restores)

    def add(self, bucket: str, seconds: float) -> None:
        self.spent[bucket] += seconds

    def totals(self) -> dict:
        """Cumulative seconds per bucket; this attempt's wall time not measured into a bucket is
        `other` (so the buckets add up to the wall time)."""
        now = dict(self.spent)
        measured = sum(v for b, v in now.items() if b not in ("lost", "other"))
        now["other"] += max(0.0, time.perf_counter() - self.started - measured - now["other"])
        return {b: self.carried[b] + now[b] for b in BUCKETS}

    def record(self) -> dict:
        """Fields for a metrics record: `goodput` and `time_<bucket>` (cumulative seconds)."""
        totals = self.totals()
        wall = sum(totals.values())
        restores = {"restores": len(self.restores)} if self.restores else {}
        if self.restores:
            restores |= {
                "steps_lost": sum(r["steps_lost"] for r in self.restores),
                "restore_seconds": sum(r["seconds"] for r in self.restores),
            }
        return (
            {"goodput": totals["productive"] / wall if wall else 0.0}
            | {f"time_{b}": v for b, v in totals.items()}
            | restores
        )


def _seconds(value) -> float:
    """A saved ledger entry, or 0 for one that is missing or not a time (hand-edited metadata)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < float("inf")
    return float(value) if ok else 0.0


def record_restore(
    run_dir: pathlib.Path, step: int, tier: str, steps_lost: int, seconds: float
) -> list[dict]:
    """Append this attempt's restore (from `step` of `tier` in `seconds`; an earlier attempt had
    logged `steps_lost` steps past it) to the run's restores.jsonl; returns them all."""
    line = {"time": round(time.time(), 3), "step": step, "tier": tier, "steps_lost": steps_lost,
            "seconds": round(seconds, 3)}  # fmt: skip
    path = run_dir / RESTORES
    cut = path.is_file() and path.stat().st_size and not path.read_bytes().endswith(b"\n")
    with open(path, "a") as f:
        f.write(("\n" if cut else "") + json.dumps(line) + "\n")  # after a line a kill cut short
    return read_restores(run_dir)


def read_restores(run_dir: pathlib.Path) -> list[dict]:
    """The run's restores, oldest first; a line cut short by a kill, or edited into nonsense, is skipped."""
    path = run_dir / RESTORES
    out = []
    for line in path.read_text(errors="replace").splitlines() if path.is_file() else ():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if _restore_ok(r):
            out.append(r)
    return out


def _restore_ok(r) -> bool:
    return (
        isinstance(r, dict)
        and all(isinstance(r.get(k), int) and not isinstance(r.get(k), bool) for k in ("step", "steps_lost"))
        and isinstance(r.get("tier"), str)
        and _seconds(r.get("seconds")) == r.get("seconds")
    )


def summary(totals: dict, restores: list[dict] = ()) -> str:
    """'goodput 81.2% of 42.0s (compile 5.1s, init 2.0s, ...)': the non-productive buckets, largest
    first; then the restores ('; 2 restores: 3 steps lost, 1.2s reading (local 1, storage 1)')."""
    wall = sum(totals.values())
    rest = sorted(((v, b) for b, v in totals.items() if b != "productive" and v >= 0.05), reverse=True)
    parts = ", ".join(f"{b} {v:.1f}s" for v, b in rest)
    share = totals["productive"] / wall if wall else 0.0
    line = f"goodput {share:.1%} of {wall:.1f}s" + (f" ({parts})" if parts else "")
    if restores:
        tiers = {}
        for r in restores:
            tiers[r["tier"]] = tiers.get(r["tier"], 0) + 1
        line += (
            f"; {len(restores)} restore{'s' if len(restores) > 1 else ''}: "
            f"{sum(r['steps_lost'] for r in restores)} steps lost, {sum(r['seconds'] for r in restores):.1f}s reading "
            f"({', '.join(f'{t} {k}' for t, k in tiers.items())})"
        )
    return line


def lost_steps(records: list[dict], after_step: int) -> int:
    """The steps `records` (metrics.jsonl of earlier attempts) logged after `after_step`."""
    steps = [r["step"] for r in records if isinstance(r.get("step"), int)]
    return max(0, max(steps, default=after_step) - after_step)


def lost_seconds(records: list[dict], after_step: int) -> float:
    """Training time of the steps that `records` (metrics.jsonl, in order) logged after `after_step`:
    each record's step_time times the steps since the record before it."""
    lost, previous = 0.0, None
    for r in records:
        step, step_time = r.get("step"), r.get("step_time")
        if isinstance(step, int) and isinstance(step_time, (int, float)):
            if step > after_step:
                lost += step_time * (step - (after_step if previous is None else max(previous, after_step)))
            previous = step
    return lost
