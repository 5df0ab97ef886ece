"""The train loop's side jobs decide when they run: logged, evaluated and saved steps, preemption,
and training time that leaves hook time out. A counting step stands in for the model."""

import pathlib
import time

import numpy as np
import pytest

from spmd.loop import train_loop as loop


class Steps:
    def train_batch(self, step):
        return step


def step_fn(state, batch):
    metrics = {"loss": np.float32(1.0 / (batch + 1)), "learning_rate": np.float32(0.1), "grad_norm": np.float32(1),
               "z_loss": np.float32(0)}  # fmt: skip
    return {"params": state["params"] + 1}, metrics


class Recorder(loop.Hook):
    def __init__(self, every, name, calls, at_end=True, on_stop=True, sleep=0.0):
        self.every, self.name, self.calls, self.at_end, self.on_stop, self.sleep = (
            every, name, calls, at_end, on_stop, sleep,
        )  # fmt: skip
        self.closed = False

    def __call__(self, info):
        time.sleep(self.sleep)
        self.calls.append((self.name, info.step, info.stopping))

    def close(self):
        self.closed = True


class Writer:
    def __init__(self):
        self.history = []

    def write(self, record):
        self.history.append(record)

    def close(self):
        pass


def test_hooks_run_on_their_own_schedule():
    calls, writer = [], Writer()
    evaluated = []
    hooks = [
        loop.EvalHook(4, lambda state: evaluated.append(int(state["params"])) or 2.5),
        loop.MetricsHook(3, 4, tokens_per_step=10, flops_per_token=6.0, peak_flops=1e9, writer=writer),
        Recorder(5, "ckpt", calls),
    ]
    state = loop.TrainLoop(step_fn, Steps(), hooks).run({"params": 0}, 0, 10)
    assert state["params"] == 10
    assert [r["step"] for r in writer.history] == [3, 4, 6, 8, 9, 10]  # every 3, every eval (4), the end
    assert [r["step"] for r in writer.history if "eval_loss" in r] == [4, 8, 10]
    assert evaluated == [4, 8, 10] and all(r["eval_loss"] == 2.5 for r in writer.history if "eval_loss" in r)
    assert writer.history[0]["loss"] == np.float32(1 / 3) and "z_loss" not in writer.history[0]
    assert [c[1] for c in calls] == [5, 10] and hooks[2].closed


def test_a_stop_runs_the_save_but_not_the_eval():
    calls, writer = [], Writer()
    stop_after = iter([False, False, False, True])
    hooks = [
        loop.EvalHook(3, lambda state: 0.0),
        loop.MetricsHook(100, 3, 10, 6.0, 1e9, writer=writer),
        Recorder(0, "ckpt", calls),
    ]
    state = loop.TrainLoop(step_fn, Steps(), hooks, stop=lambda: next(stop_after)).run({"params": 0}, 0, 50)
    assert state["params"] == 4
    assert [(r["step"], "eval_loss" in r) for r in writer.history] == [(3, True), (4, False)]
    assert calls == [("ckpt", 4, True)]


def test_throughput_leaves_hook_time_out():
    writer = Writer()
    hooks = [loop.MetricsHook(1, 0, 10, 6.0, 1e9, writer=writer), Recorder(1, "slow", [], sleep=0.2)]
    loop.TrainLoop(step_fn, Steps(), hooks).run({"params": 0}, 0, 3)
    assert all(r["step_time"] < 0.05 for r in writer.history[1:])  # the 0.2 s hook is not a step


def test_consecutive_skipped_steps_stop_the_run_before_any_hook_sees_the_last():
    """Steps 4-8 skip (non-finite); with max_skipped 5 the run stops at step 8 with Diverged, the
    checkpoint-like hook never runs for it, and a single skip in between resets the streak."""
    import pytest

    skip = {2, 4, 5, 6, 7, 8}

    def skipping_step(state, batch):
        state, metrics = step_fn(state, batch)
        return state, {**metrics, "skipped": np.int32(batch + 1 in skip)}

    calls = []
    hooks = [Recorder(1, "save", calls)]
    with pytest.raises(loop.Diverged, match="steps 4-8 .5 in a row"):
        loop.TrainLoop(skipping_step, Steps(), hooks, max_skipped=5).run({"params": 0}, 0, 20)
    assert [step for _, step, _ in calls] == [1, 2, 3, 4, 5, 6, 7]

    class Extra(Recorder):
        def __call__(self, info):
            self.calls.append(info.extra["skipped_steps"])

    counts = []
    loop.TrainLoop(skipping_step, Steps(), [Extra(3, "log", counts)], max_skipped=0).run({"params": 0}, 0, 9)
    assert counts == [1, 4, 6]  # skipped steps so far at steps 3, 6, 9; 0: no limit


def test_an_error_waits_for_the_step_still_running():
    """The loop keeps one step in flight; when the step before it turns out to be the last of a
    diverged streak, that step is waited for before the error leaves the loop (a process exiting
    under a running oneDNN program aborts: spmd/platform/cpu_matmul.py)."""

    class Running:  # a step's output, as JAX returns it before the step is done
        def __init__(self, step):
            self.step, self.waited = step, False

        def block_until_ready(self):
            self.waited = True
            return self

    dispatched = []

    def step(state, batch):
        dispatched.append(Running(batch))
        return {"params": dispatched[-1]}, {"loss": np.float32(1), "skipped": np.int32(batch >= 2)}

    with pytest.raises(loop.Diverged, match="steps 3-5"):
        loop.TrainLoop(step, Steps(), [], max_skipped=3).run({"params": None}, 0, 20)
    assert [r.step for r in dispatched] == list(range(6))  # step 6 (batch 5) was in flight ...
    assert dispatched[-1].waited  # ... and was waited for


def test_goodput_ledger_puts_every_second_in_one_bucket():
    """Data waits, hook time by bucket (eval, checkpoint, other) and productive steps add up to the
    wall time since `started`; a carried ledger (a resumed checkpoint's) adds on; goodput =
    productive / all."""
    from spmd.loop import goodput

    class SlowData(Steps):
        def train_batch(self, step):
            time.sleep(0.03)
            return step

    class Save(Recorder):
        bucket = "checkpoint"

    def slow_step(state, batch):
        time.sleep(0.02)
        return step_fn(state, batch)

    started = time.perf_counter()
    ledger = goodput.Ledger(started, carried={"compile": 5.0, "lost": 1.0, "productive": 2.0})
    hooks = [
        loop.EvalHook(5, lambda state: time.sleep(0.1) or 1.0),
        Save(5, "save", [], sleep=0.05),
        Recorder(1, "log", [], sleep=0.01),
    ]
    loop.TrainLoop(slow_step, SlowData(), hooks, ledger=ledger).run({"params": 0}, 0, 10)
    wall = time.perf_counter() - started
    t = ledger.totals()
    assert t["data_wait"] == pytest.approx(0.3, abs=0.05)  # 10 x 0.03 s
    assert t["eval"] == pytest.approx(0.2, abs=0.05) and t["checkpoint"] == pytest.approx(0.1, abs=0.04)
    assert t["other"] == pytest.approx(0.1, abs=0.04)  # the log hook, 10 x 0.01 s
    assert t["productive"] - 2.0 == pytest.approx(0.2, abs=0.06)  # 10 x 0.02 s
    assert t["compile"] == 5.0 and t["lost"] == 1.0
    assert sum(t.values()) == pytest.approx(wall + 8.0, abs=0.02)
    record = ledger.record()
    assert record["goodput"] == pytest.approx(t["productive"] / sum(t.values()), rel=1e-3)
    assert goodput.summary(t).startswith("goodput ") and "compile 5.0s" in goodput.summary(t)
    # A hand-edited saved ledger cannot break a resume: what is not a time counts as 0.
    assert goodput.Ledger(0.0, {"init": "x", "eval": -1, "lost": float("nan")}).carried["init"] == 0.0


def test_lost_seconds_are_the_logged_steps_after_the_restored_checkpoint():
    from spmd.loop.goodput import lost_seconds

    records = [{"step": 2, "step_time": 1.0}, {"step": 5, "step_time": 2.0}, {"step": 7, "step_time": 3.0}]
    assert lost_seconds(records, 7) == 0.0
    assert lost_seconds(records, 4) == 2.0 * 1 + 3.0 * 2  # step 5 (one step past 4), steps 6-7
    assert lost_seconds(records, 0) == 1.0 * 2 + 2.0 * 3 + 3.0 * 2


def test_watchdog_deadline_follows_the_median_step_with_a_floor():
    from spmd.loop.watchdog import Watchdog

    auto = Watchdog(0, None, compile_seconds=40.0, floor=300.0)
    assert auto.deadline() == 400.0  # no step timed yet: 10x the compile time
    auto.start(0)
    auto.beat(1)  # the first step's time is not a step-to-step interval
    for step, seconds in enumerate([50, 60, 70, 1000], start=2):  # beat() times the intervals
        auto.last -= seconds
        auto.beat(step)
    assert auto.deadline() == pytest.approx(10 * 65, rel=0.01)  # the median, not the outlier
    auto.last -= 5
    auto.beat()  # a hook finishing is progress, but not a step time
    assert len(auto.durations) == 4 and auto.step == 5
    auto.stop()
    assert Watchdog(0, None, floor=300.0).deadline() == 300.0
    assert Watchdog(7.5, None).deadline() == 7.5 and not Watchdog(-1, None).enabled


def test_a_hooks_first_call_gets_the_first_deadline_once():
    """The first eval and the first save compile (the eval step, the checksum program): until the
    next beat the deadline is the first one (>= the floor) even under a fixed train.step_timeout;
    the loop asks for it once per hook, and a hook's later calls are held to step_timeout."""
    from spmd.loop import train_loop as loop
    from spmd.loop.watchdog import Watchdog

    dog = Watchdog(7.5, None, compile_seconds=40.0, floor=300.0)
    dog.hook_first_call()
    assert dog.deadline() == 400.0
    dog.beat()
    assert dog.deadline() == 7.5

    class Recording(Watchdog):
        def __init__(self):
            super().__init__(7.5, None)
            self.first_calls = []

        def start(self, step):  # no thread: the deadlines are not what this checks
            return self

        def hook_first_call(self):
            self.first_calls.append(self.step)
            super().hook_first_call()

    class Every(loop.Hook):
        def __init__(self, every):
            self.every, self.calls = every, []

        def __call__(self, info):
            self.calls.append(info.step)

    class Steps:
        def train_batch(self, step):
            return step

    dog, a, b = Recording(), Every(2), Every(3)
    loop.TrainLoop(lambda s, x: (s, {}), Steps(), [a, b], watchdog=dog).run(0, 0, 7)
    assert a.calls == [2, 4, 6, 7] and b.calls == [3, 6, 7]
    assert dog.first_calls == [2, 3]  # a's first call after step 2, b's after step 3; no more
    assert not dog.first_call  # the hook's return was a beat


def test_watchdog_dumps_every_stack_and_exits_4_on_a_hang(tmp_path):
    """A loop whose step never returns: the watchdog writes the stacks to stderr and the run dir and
    exits with its code; a loop that keeps stepping is left alone, also while a hook's first call
    runs past step_timeout (it compiles)."""
    import re
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import pathlib, threading, time
        import numpy as np
        from spmd.loop import train_loop as loop
        from spmd.loop.watchdog import Watchdog

        def step(state, batch):
            if batch == 3:
                threading.Event().wait()  # the hang
            time.sleep(0.01)
            return state, {{"loss": np.float32(1)}}

        class Steps:
            def train_batch(self, step):
                return step

        class Compiling(loop.Hook):  # its first call takes longer than step_timeout, as a compile does
            every, calls = 20, 0

            def __call__(self, info):
                self.calls += 1
                time.sleep(1.5 if self.calls == 1 else 0.01)

        ok = Watchdog(0.5, pathlib.Path({str(tmp_path / "ok")!r}))
        steps = lambda s, b: (time.sleep(0.01), (s, {{}}))[1]
        loop.TrainLoop(steps, Steps(), [Compiling()], watchdog=ok).run(0, 0, 60)
        print("first loop done", flush=True)
        dog = Watchdog(0.5, pathlib.Path({str(tmp_path / "hangs")!r}), process=1)
        loop.TrainLoop(step, Steps(), [], watchdog=dog).run(0, 0, 10)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 4, result.stderr[-2000:]
    assert "first loop done" in result.stdout and not (tmp_path / "ok").exists()
    pattern = (
        r"error: hang: no progress for 0\.\ds since step 2 finished \(deadline 0\.5s, train\.step_timeout\)"
    )
    assert re.search(pattern, result.stderr), result.stderr[:500]
    assert "in step" in result.stderr and "Thread 0x" in result.stderr  # all threads, the watchdog's too
    dump = (tmp_path / "hangs" / "step2.process1.txt").read_text()
    assert dump.startswith("error: hang:") and "in step" in dump


def test_metrics_that_cannot_be_written_stop_the_run_with_one_error(tmp_path):
    """metrics.jsonl on a full disk (/dev/full answers every write with ENOSPC): the write raises
    one MetricsWriteError (exit code 3) naming the file and the reason, and closing the writer
    afterwards (the loop closes every hook) raises nothing more."""
    from spmd.loop.metrics import MetricsWriteError, MetricsWriter

    if not pathlib.Path("/dev/full").exists():
        pytest.skip("no /dev/full here")
    writer = MetricsWriter(tmp_path)
    writer.jsonl.close()
    writer.jsonl = open("/dev/full", "a")
    with pytest.raises(
        MetricsWriteError,
        match=r"step 3's metrics could not be written to /dev/full: No space left on device; training stopped",
    ) as e:
        writer.write({"step": 3, "loss": 1.0})
    assert e.value.exit_code == 3
    writer.close()


def test_the_cpu_peak_is_measured_in_the_steps_matmul_library(tmp_path, monkeypatch):
    """MFU's ceiling on CPU is the rate of the library the steps run their matmuls in
    (cpu.matmul): each library's rate is measured and cached apart, and the log says which."""
    from spmd.loop import metrics

    monkeypatch.setenv("SPMD_CACHE_DIR", str(tmp_path))
    asked = []
    monkeypatch.setattr(metrics, "measure_matmul_flops", lambda dtype, library: asked.append(library) or 1e9)
    _, how = metrics.peak_flops("float32", "onednn")
    assert asked == ["onednn"] and "float32 matmul in onednn on cpu" in how and how.startswith("measured now")
    _, how = metrics.peak_flops("float32", "xla")
    assert asked == ["onednn", "xla"] and "matmul in xla" in how
    _, how = metrics.peak_flops("float32", "onednn")
    assert asked == ["onednn", "xla"] and how.startswith("measured earlier, cached")
