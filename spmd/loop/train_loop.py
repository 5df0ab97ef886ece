"""The train loop and its side jobs.

The loop only runs steps. Everything else is a hook that decides for itself when it runs
(`should_run(step, last)`), as in torchtitan's `Trainer.train` and Levanter's `add_hook(cb, every=N)`:
evaluation, the metrics record (metrics.jsonl and TensorBoard), the progress display, checkpoints.
Preemption is the loop's stop condition; the checkpoint hook saves and waits when it fires.

Hooks run in the order given, after the step's metrics have been fetched (which waits for the
step). Time spent in hooks is not training time: the throughput clock stops while they run.
"""

import abc
import dataclasses
import os
import pathlib
import signal
import sys
import time

import jax
import numpy as np

from spmd.core.errors import UserError, log
from spmd.loop.spikes import Rollback


@dataclasses.dataclass
class StepInfo:
    """What hooks see after a step: `step` optimizer steps are done."""

    step: int
    state: dict
    metrics: dict  # this step's metrics, on the host
    train_seconds: float  # training time since the loop started, hook time excluded
    final: bool  # the run's planned last step
    stopping: bool  # stopping early, after this step (preemption)
    extra: dict = dataclasses.field(default_factory=dict)  # fields hooks add to the step's record
    record: dict | None = None  # the metrics record, once MetricsHook has made it


class Hook(abc.ABC):
    """A side job of the loop. Runs every `every` steps (0: never on a schedule), at the final step
    when `at_end`, and at the step the run stops at when `on_stop`; subclasses may add more."""

    every: int = 0
    at_end: bool = True
    on_stop: bool = True
    bucket: str = "other"  # where its time goes in the goodput ledger (spmd.loop.goodput.BUCKETS)

    def should_run(self, step: int, final: bool, stopping: bool) -> bool:
        return (
            bool(self.every and step % self.every == 0)
            or (final and self.at_end)
            or (stopping and self.on_stop)
        )

    @abc.abstractmethod
    def __call__(self, info: StepInfo) -> None: ...

    def poll(self) -> None:
        """Called after every step, due or not: a cheap check that may raise to stop the run."""

    def rewind(self, step: int, train_seconds: float) -> None:
        """The run went back to `step` (a rollback after a loss spike)."""

    def close(self) -> None:
        """Called once when the loop ends, also when it fails."""


class Diverged(UserError):
    """Too many consecutive steps with a non-finite loss or gradient norm (exit code 2)."""


class TrainLoop:
    def __init__(self, step_fn, batches, hooks: list[Hook], stop=None, max_skipped: int = 0, ledger=None,
                 watchdog=None, guard=None, on_rollback=None):  # fmt: skip
        """`step_fn(state, batch) -> (state, metrics)`; `stop()` is asked after every step whether to
        stop early (e.g. Preemption.requested). When the metrics carry `skipped` (the step left the
        state unchanged: non-finite loss or gradients), `max_skipped` consecutive ones (0: no limit)
        stop the run with Diverged, before any hook sees the last of them. `ledger`
        (spmd.loop.goodput.Ledger) gets the loop's time by bucket; `watchdog` (spmd.loop.watchdog.Watchdog)
        hears of every finished step and hook. `guard` (spmd.loop.spikes.SpikeGuard) judges each step's
        loss before any hook sees it; under spikes.action = skip `step_fn` takes its threshold as a third
        argument, and under rollback `on_rollback(Rollback) -> (state, step)` gives the state and
        step to go on from."""
        self.step_fn, self.batches, self.hooks, self.stop = step_fn, batches, hooks, stop
        self.max_skipped = max_skipped
        self.ledger, self.watchdog = ledger, watchdog
        self.guard, self.on_rollback = guard, on_rollback
        self.skipped = 0  # skipped steps in this run
        self.streak: list[int] = []  # the current run of consecutive skipped steps
        self._mark = time.perf_counter()

    def _spend(self, bucket: str) -> None:
        """The time since the last call goes to `bucket`."""
        now = time.perf_counter()
        if self.ledger is not None:
            self.ledger.add(bucket, now - self._mark)
        self._mark = now

    def _beat(self, step: int | None = None) -> None:
        if self.watchdog is not None:
            self.watchdog.beat(step)

    def _count(self, step: int, metrics: dict) -> None:
        self._beat(step)
        skipped = metrics.get("skipped")
        if skipped is None:
            return
        if self.guard is not None:
            self.guard.observe(
                step, float(metrics["loss"]), bool(int(skipped)), bool(int(metrics.get("spiked", 0)))
            )
        if not int(skipped):
            self.streak = []
            return
        self.skipped += 1
        self.streak.append(step)
        if self.max_skipped and len(self.streak) >= self.max_skipped:
            spike = (
                " or a loss spike (spikes.action = skip)"
                if self.guard and self.guard.on_spike == "skip"
                else ""
            )
            raise Diverged(
                f"training diverged: steps {self.streak[0]}-{self.streak[-1]} ({len(self.streak)} in a row, "
                f"train.max_skipped_steps) had a non-finite loss or gradient norm{spike} and were skipped, so "
                f"parameters and optimizer state are still those of step {self.streak[0] - 1} (as is every "
                f"checkpoint since); lower optimizer.learning_rate, raise optimizer.warmup_steps or set "
                f"optimizer.grad_clip, then resume"
            )

    def run(self, state, start_step: int, end_step: int):
        """Steps start_step..end_step-1; returns the last state."""
        self._mark, self.train_seconds = time.perf_counter(), 0.0
        if self.watchdog is not None:
            self.watchdog.start(start_step)
        called = set()  # hooks that ran: a first call may compile (spmd.loop.watchdog)
        step = start_step
        skip_spikes = self.guard is not None and self.guard.on_spike == "skip"
        try:
            while step < end_step:
                try:
                    step, state, stopping = self._run(state, step, end_step, called, skip_spikes)
                    if stopping:
                        break
                except Rollback as r:
                    if self.on_rollback is None:
                        raise
                    state, step = self.on_rollback(r)
                    for hook in self.hooks:
                        hook.rewind(step, self.train_seconds)
            self._spend("productive")
        finally:
            for hook in self.hooks:
                self._spend("productive")
                hook.close()
                self._spend(hook.bucket)
                self._beat()
            if self.watchdog is not None:
                self.watchdog.stop()
        return state

    def _run(self, state, step: int, end_step: int, called: set, skip_spikes: bool):
        """Steps from `step` until the end, a stop, or a rollback (raised): (step, state, stopping)."""
        clock, stopping = time.perf_counter(), False
        train_seconds = self.train_seconds
        pending = None  # (step, its metrics), read once the next step is dispatched
        try:
            while step < end_step:
                self._spend("productive")
                batch = self.batches.train_batch(step)
                self._spend("data_wait")
                if skip_spikes:
                    state, metrics = self.step_fn(state, batch, np.float32(self.guard.threshold()))
                else:
                    state, metrics = self.step_fn(state, batch)
                for hook in self.hooks:
                    hook.poll()
                if pending is not None:
                    self._count(*pending)  # waits for the previous step only: one step stays in flight
                    pending = None
                done = step + 1
                step = done
                final, stopping = done == end_step, self.stop is not None and self.stop()
                due = [hook for hook in self.hooks if hook.should_run(done, final, stopping)]
                if due:
                    metrics = jax.device_get(metrics)  # waits for the step
                    self._count(done, metrics)
                    train_seconds += time.perf_counter() - clock
                    self._spend("productive")
                    info = StepInfo(done, state, metrics, train_seconds, final, stopping)
                    if "skipped" in metrics:
                        info.extra["skipped_steps"] = self.skipped
                    if self.guard is not None and (self.guard.spikes or self.guard.rollbacks):
                        info.extra.update(spikes=self.guard.spikes, rollbacks=self.guard.rollbacks)
                    for hook in due:
                        if self.watchdog is not None and id(hook) not in called:
                            self.watchdog.hook_first_call()
                        called.add(id(hook))
                        hook(info)
                        self._spend(hook.bucket)
                        self._beat()
                    clock = time.perf_counter()
                else:
                    pending = (done, metrics)
                if stopping:
                    break
            if pending is not None:
                self._count(*pending)
        except BaseException:
            # A diverged run, a spike, a failed hook or Ctrl-C can leave the last step running:
            # wait for it, so that the process does not exit and free the step's program under it
            # (XLA then aborts with oneDNN programs, turning exit code 2 into 134:
            # spmd/platform/cpu_matmul.py), and a rollback does not restore beside it.
            _wait_quietly(state)
            raise
        finally:
            self.train_seconds = train_seconds
        return step, state, stopping


def _wait_quietly(tree) -> None:
    """Wait for `tree`'s arrays; one that failed or was deleted raised its error already."""
    try:
        jax.block_until_ready(tree)
    except Exception:
        pass


class EvalHook(Hook):
    """Held-out loss every `every` steps and at the end (not when preempted: the save comes first),
    added to the step's record as eval_loss; `evaluate(train state)`."""

    on_stop = False
    bucket = "eval"

    def __init__(self, every: int, evaluate):
        self.every, self.at_end, self.evaluate = every, bool(every), evaluate

    def __call__(self, info: StepInfo) -> None:
        result = self.evaluate(info.state)  # a loss, or {"eval_loss": ..., "eval_loss/<source>": ...}
        info.extra.update(result if isinstance(result, dict) else {"eval_loss": result})


class LogSchedule(Hook):
    """Logged steps: every log_every, every eval step (its eval_loss is recorded), the last one."""

    def __init__(self, log_every: int, eval_every: int):
        self.every, self.eval_every = log_every, eval_every

    def should_run(self, step: int, final: bool, stopping: bool) -> bool:
        return super().should_run(step, final, stopping) or bool(
            self.eval_every and step % self.eval_every == 0
        )


class MetricsHook(LogSchedule):
    """Makes each logged step's record (loss, throughput, MFU, ...) and writes it through `writer`
    (spmd.loop.metrics.MetricsWriter: metrics.jsonl and TensorBoard)."""

    def __init__(self, log_every: int, eval_every: int, tokens_per_step: int, flops_per_token: float, peak_flops: float,
                 z_loss: bool = False, writer=None, start_step: int = 0, ledger=None):  # fmt: skip
        """`ledger` (spmd.loop.goodput.Ledger): its goodput and time_<bucket> fields join every record."""
        super().__init__(log_every, eval_every)
        self.ledger = ledger
        self.tokens_per_step, self.flops_per_token, self.peak = tokens_per_step, flops_per_token, peak_flops
        self.z_loss, self.writer = z_loss, writer
        self.last_step, self.last_seconds = start_step, 0.0

    def __call__(self, info: StepInfo) -> None:
        m, steps = info.metrics, info.step - self.last_step
        seconds = info.train_seconds - self.last_seconds
        tok_s = steps * self.tokens_per_step / seconds
        record = {
            "step": info.step,
            "loss": float(m["loss"]),
            "tokens_per_sec": tok_s,
            "mfu": tok_s * self.flops_per_token / self.peak,
            "learning_rate": float(m["learning_rate"]),
            "grad_norm": float(m["grad_norm"]),
            "step_time": seconds / steps,
        }
        if "tokens" in m:  # the targets the loss counted in the logged step (masks leave some out)
            record["trained_tokens"] = int(m["tokens"])
        if self.z_loss:
            record["z_loss"] = float(m["z_loss"])
        record.update({key: float(v) for key, v in m.get("aux", {}).items()})  # the model's own metrics
        record.update(info.extra)
        if self.ledger is not None:
            record.update(self.ledger.record())
        info.record = record
        self.last_step, self.last_seconds = info.step, info.train_seconds
        if self.writer is not None:
            self.writer.write(record)

    def rewind(self, step: int, train_seconds: float) -> None:
        self.last_step, self.last_seconds = step, train_seconds
        if self.writer is not None:
            self.writer.rewind(step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    @property
    def history(self) -> list[dict]:
        return self.writer.history if self.writer is not None else []


class ProgressHook(LogSchedule):
    """A progress bar (step, loss, tokens/s, MFU, ETA) and one line per logged step, on stderr."""

    def __init__(self, log_every: int, eval_every: int, total_steps: int, start_step: int):
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        super().__init__(log_every, eval_every)
        self.progress = Progress(
            TextColumn("step {task.completed}/{task.total}"),
            BarColumn(),
            TextColumn("loss {task.fields[loss]}  {task.fields[tok_s]} tok/s  MFU {task.fields[mfu]}  ETA"),
            TimeRemainingColumn(),
            console=Console(stderr=True),
        )
        self.task = self.progress.add_task(
            "train", total=total_steps, completed=start_step, loss="-", tok_s="-", mfu="-"
        )
        self.progress.start()

    def __call__(self, info: StepInfo) -> None:
        r = info.record
        self.progress.update(
            self.task, completed=info.step, loss=f"{r['loss']:.3f}", tok_s=f"{r['tokens_per_sec']:,.0f}",
            mfu=f"{r['mfu']:.1%}",
        )  # fmt: skip
        self.progress.console.print(
            f"step {info.step:>6}  loss {r['loss']:.4f}  lr {r['learning_rate']:.2e}  "
            f"grad_norm {r['grad_norm']:.3f}  {r['tokens_per_sec']:,.0f} tok/s  MFU {r['mfu']:.1%}"
            + (f"  skipped {r['skipped_steps']}" if r.get("skipped_steps") else "")
            + (f"  eval_loss {r['eval_loss']:.4f}" if "eval_loss" in r else ""),
            highlight=False,
            soft_wrap=True,
        )

    def rewind(self, step: int, train_seconds: float) -> None:
        self.progress.update(self.task, completed=step)

    def close(self) -> None:
        self.progress.stop()


class ProfileHook(Hook):
    """A jax.profiler trace of steps first..last (1-based, inclusive) into `directory`, for
    TensorBoard's profile plugin or xprof. The trace starts when step first-1 is done and stops
    when step `last` is done (or the loop ends)."""

    at_end = on_stop = False

    def __init__(self, directory, first: int, last: int, start_step: int):
        self.directory, self.first, self.last = directory, first, last
        self.tracing = False
        if first <= start_step + 1:
            self._start()

    def _start(self) -> None:
        jax.profiler.start_trace(str(self.directory))
        self.tracing = True

    def should_run(self, step: int, final: bool, stopping: bool) -> bool:
        return step == self.first - 1 or (self.tracing and (step >= self.last or final or stopping))

    def __call__(self, info: StepInfo) -> None:
        if not self.tracing and info.step == self.first - 1:
            self._start()
        elif self.tracing:
            jax.block_until_ready(info.state)
            self.close()

    def close(self) -> None:
        if self.tracing:
            jax.profiler.stop_trace()
            self.tracing = False


class CheckpointHook(Hook):
    """Saves every `every` steps (0: only at the end), at the last step and when stopping; on a stop
    it waits for the save to commit. `continuous`: also at every step after the previous save
    committed (every process agrees on it)."""

    bucket = "checkpoint"

    def __init__(self, checkpointer, every: int, meta, canonical=None, continuous: bool = False):
        """`meta(step) -> dict`: the metadata saved with the step (spmd.io.checkpoint.step_meta);
        `canonical(state)`: the state in canonical layer order (Trainer.to_canonical), which
        checkpoints hold whatever the pipeline schedule."""
        self.checkpointer, self.every, self.meta = checkpointer, every, meta
        self.canonical = canonical or (lambda state: state)
        self.continuous = continuous

    def should_run(self, step: int, final: bool, stopping: bool) -> bool:
        return super().should_run(step, final, stopping) or (self.continuous and self.checkpointer.idle())

    def __call__(self, info: StepInfo) -> None:
        meta = self.meta(info.step)
        if "eval_loss" in info.extra:  # retention keeps the best (checkpoint.keep_best)
            meta["eval_loss"] = float(info.extra["eval_loss"])
        self.checkpointer.save(info.step, self.canonical(info.state), meta)
        if info.stopping:
            self.checkpointer.wait()

    def poll(self) -> None:
        self.checkpointer.check()  # a failed background save stops training at the next step

    def close(self) -> None:
        self.checkpointer.close()


class LocalCheckpointHook(Hook):
    """Saves to the local tier (spmd.io.local_tier) every `checkpoint.local_every` steps, except at
    the steps a storage save takes (the end, a stop, `checkpoint.every`); when the loop ends, one
    line says what the saves cost."""

    at_end = on_stop = False
    bucket = "checkpoint"

    def __init__(self, tier, cfg, meta, canonical):
        self.tier, self.every, self.storage_every = tier, cfg.local_every, cfg.every
        self.meta, self.canonical = meta, canonical

    def should_run(self, step: int, final: bool, stopping: bool) -> bool:
        storage = final or stopping or bool(self.storage_every and step % self.storage_every == 0)
        return super().should_run(step, final, stopping) and not storage

    def __call__(self, info: StepInfo) -> None:
        self.tier.save(info.step, self.canonical(info.state), self.meta(info.step))

    def close(self) -> None:
        self.tier.close()
        if self.tier.blocking and jax.process_index() == 0:
            from spmd.parallel.sharding import fmt_bytes

            log(
                f"local checkpoints: {len(self.tier.blocking)} saves, {np.median(self.tier.blocking):.3f}s blocking "
                f"each (median), {fmt_bytes(self.tier.payload_bytes)} per process"
            )


class Preemption:
    """First SIGTERM/SIGINT: finish the step, save, wait for the commit, exit 0. Second: abort now.

    Aborting skips Python's shutdown, so an in-flight save stays uncommitted (a temporary directory
    that is never listed) and committed checkpoints are untouched.
    """

    def __init__(self):
        self.signal: int | None = None

    def install(self) -> "Preemption":
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)
        return self

    def requested(self) -> bool:
        """Whether to stop after this step. With several processes they must agree (a signal can
        reach them at different steps), so any process's request stops them all at the same step."""
        if jax.process_count() == 1:
            return self.signal is not None
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.int32(self.signal or 0))
        if self.signal is None and flags.any():
            self.signal = int(flags.max())
        return bool(flags.any())

    def _handle(self, signum, frame):
        if self.signal is not None:
            os._exit(128 + signum)
        self.signal = signum
        print(
            f"signal {signum}: finishing this step, then saving a checkpoint (send it again to abort at once)",
            file=sys.stderr,
            flush=True,
        )


def trim_metrics(path: pathlib.Path, last_step: int) -> list[dict]:
    """Drop logged steps after `last_step` from metrics.jsonl (a run killed after its last
    checkpoint logged them), so that a resumed run continues the file without duplicates. A line a
    kill cut short (not JSON) is dropped too. Returns the records of the file (as the earlier run
    wrote them), for spmd.loop.goodput.lost_seconds."""
    import json

    if not path.exists():
        return []

    def parse(line: str) -> dict | None:
        try:
            record = json.loads(line)
            return record if isinstance(record, dict) and isinstance(record.get("step"), int) else None
        except ValueError:
            return None  # unreadable: dropped

    lines = [(line, parse(line)) for line in path.read_text(errors="replace").splitlines() if line]
    keep = [line for line, record in lines if record is not None and record["step"] <= last_step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, path)
    return [record for _, record in lines if record is not None]
