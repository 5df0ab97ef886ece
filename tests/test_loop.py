"""The train loop's side jobs decide when they run: logged, evaluated and saved steps, preemption,
and training time that leaves hook time out. A counting step stands in for the model."""

import time

import numpy as np

from spmd import loop


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
        loop.EvalHook(4, lambda params: evaluated.append(int(params)) or 2.5),
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
        loop.EvalHook(3, lambda params: 0.0),
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
