"""Kill the training process (SIGKILL, SIGTERM, two signals); the resumed run equals an uninterrupted one."""

import json
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from test_cli import spmd_train

from spmd.io import checkpoint as ckpt

ARGS = [
    "--config",
    "tiny",
    "--mesh",
    "fsdp=4,tensor=2",
    "--rules",
    "fsdp_tp",
    "--host-devices",
    "8",
    "--log-every",
    "1",
    "--eval-every",
    "0",
]


def start(run_dir, *extra):
    return subprocess.Popen(
        [sys.executable, "-m", "spmd.cli.train", *ARGS, "--run-dir", str(run_dir), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    )


def wait_for(predicate, proc, timeout=120, poll=0.005):
    end = time.time() + timeout
    while time.time() < end:
        if predicate():
            return True
        if proc.poll() is not None:
            raise AssertionError(f"training exited early ({proc.returncode}): {proc.stderr.read()[-2000:]}")
        time.sleep(poll)
    raise AssertionError("timed out")


def losses(run_dir):
    return [
        (r["step"], r["loss"]) for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    ]


def final_params(run_dir, step):
    from spmd.assembly.setup import assemble

    trainer = assemble("tiny", "", "dp", devices=jax.devices()[:1]).trainer
    state, _ = ckpt.restore(run_dir / ckpt.SUBDIR, step, trainer.abstract_state)
    return jax.tree.map(np.asarray, jax.device_get(state))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    result = spmd_train(*ARGS, "--run-dir", str(run_dir), "--steps", "24", "--checkpoint-every", "6")
    assert result.returncode == 0, result.stderr
    return run_dir


def assert_same_run(run_dir, reference, step=24):
    assert losses(run_dir) == losses(reference)  # bit for bit, every logged step
    jax.tree.map(np.testing.assert_array_equal, final_params(run_dir, step), final_params(reference, step))


@pytest.mark.slow
def test_sigkill_after_a_commit_then_resume(uninterrupted, tmp_path):
    run_dir = tmp_path / "run"
    proc = start(run_dir, "--steps", "24", "--checkpoint-every", "6")
    wait_for(lambda: 12 in ckpt.committed_steps(run_dir / ckpt.SUBDIR), proc)
    proc.kill()
    proc.wait()
    result = spmd_train(*ARGS, "--run-dir", str(run_dir), "--steps", "24", "--checkpoint-every", "6")
    assert result.returncode == 0, result.stderr
    assert "resumed from" in result.stderr
    assert_same_run(run_dir, uninterrupted)


@pytest.mark.slow
def test_sigkill_in_the_middle_of_a_save_then_resume(uninterrupted, tmp_path):
    for attempt in range(3):
        run_dir = tmp_path / f"run{attempt}"
        proc = start(run_dir, "--steps", "24", "--checkpoint-every", "1")
        wait_for(
            lambda: (
                bool(ckpt.committed_steps(run_dir / ckpt.SUBDIR))
                and bool(ckpt.uncommitted(run_dir / ckpt.SUBDIR))
            ),
            proc,
        )
        proc.kill()
        proc.wait()
        if ckpt.uncommitted(run_dir / ckpt.SUBDIR):
            break  # killed while a save was being written
    else:
        pytest.fail("never managed to kill the process during a save")
    last_committed = ckpt.committed_steps(run_dir / ckpt.SUBDIR)[-1]
    result = spmd_train(*ARGS, "--run-dir", str(run_dir), "--steps", "24", "--checkpoint-every", "1")
    assert result.returncode == 0, result.stderr
    assert f"resumed from {run_dir / ckpt.SUBDIR}/{last_committed}" in result.stderr
    assert not ckpt.uncommitted(run_dir / ckpt.SUBDIR)
    assert_same_run(run_dir, uninterrupted)


@pytest.mark.slow
def test_sigterm_saves_the_current_step_and_exits_0(tmp_path):
    run_dir = tmp_path / "run"
    proc = start(run_dir, "--steps", "100000")
    wait_for(lambda: (run_dir / "metrics.jsonl").exists() and len(losses(run_dir)) >= 3, proc)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    steps = ckpt.committed_steps(run_dir / ckpt.SUBDIR)
    assert len(steps) == 1 and 3 <= steps[0] < 100000
    assert losses(run_dir)[-1][0] == steps[0]  # the checkpoint is at the step the run had reached
    assert f"checkpoint for step {steps[0]} committed" in stderr


def test_second_signal_handler_exits_at_once(monkeypatch):
    from spmd.loop.train_loop import Preemption

    exits = []
    monkeypatch.setattr("os._exit", lambda code: exits.append(code))
    p = Preemption()
    p._handle(signal.SIGTERM, None)
    assert p.signal == signal.SIGTERM and exits == []
    p._handle(signal.SIGINT, None)
    assert exits == [128 + signal.SIGINT]


@pytest.mark.slow
def test_second_signal_aborts_without_touching_committed_checkpoints(tmp_path):
    run_dir = tmp_path / "run"
    # `small` so that the step and the save after the first signal take long enough to interrupt.
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "spmd.cli.train",
            "--config",
            "small",
            "--mesh",
            "fsdp=8",
            "--host-devices",
            "8",
            "--steps",
            "100000",
            "--checkpoint-every",
            "4",
            "--log-every",
            "1",
            "--run-dir",
            str(run_dir),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    wait_for(lambda: 4 in ckpt.committed_steps(run_dir / ckpt.SUBDIR), proc)
    proc.send_signal(signal.SIGTERM)
    for line in proc.stderr:
        if "finishing this step" in line:
            break
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM
    steps = ckpt.committed_steps(run_dir / ckpt.SUBDIR)
    assert 4 in steps
    verify = subprocess.run(
        [sys.executable, "-m", "spmd.cli.ckpt", "verify", str(run_dir)],
        capture_output=True,
        text=True,
    )
    assert verify.returncode == 0, verify.stderr
    assert verify.stdout.count("ok: ") == len(steps)
