"""Several processes on loopback (jax.distributed, gloo): same losses, checkpoints across process counts,
a killed process, bad coordinates, per-process data."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from test_cli import ROOT, spmd_train

from spmd.io import checkpoint as ckpt
from spmd.loop import goodput
from spmd.platform.launcher import free_port

pytestmark = pytest.mark.slow
# The schedule is fixed at 12 steps so that a run stopped at step 4 or 8 uses the same learning rates.
TRAIN = [
    "-m",
    "spmd.cli.train",
    "--config",
    "tiny",
    "--rules",
    "fsdp_tp",
    "--log-every",
    "1",
    "--eval-every",
    "4",
    "--set",
    "optimizer.schedule_steps=12",
]


def env():
    return {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}


def launch(processes, devices, *args, port=None, wait=True):
    cmd = (
        [
            sys.executable,
            "-m",
            "spmd.cli.launch",
            "--processes",
            str(processes),
            "--host-devices",
            str(devices),
        ]
        + (["--port", str(port)] if port else [])
        + ["--", sys.executable, *TRAIN, *args]
    )
    if not wait:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env())


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_close(a, b):
    assert [r["step"] for r in a] == [r["step"] for r in b]
    np.testing.assert_allclose([r["loss"] for r in a], [r["loss"] for r in b], rtol=1e-5)
    ea, eb = [r.get("eval_loss") for r in a], [r.get("eval_loss") for r in b]
    assert [x is None for x in ea] == [x is None for x in eb]
    np.testing.assert_allclose([x for x in ea if x], [x for x in eb if x], rtol=1e-5)


def assert_losses_of(run_dir, setup, steps):
    """The run's logged losses equal `setup` trained in this process for `steps` steps."""
    import jax

    state, batches, losses = setup.trainer.init_state(), setup.batches(), []
    for step in range(steps):
        state, m = setup.trainer.train_step(state, batches.train_batch(step))
        losses.append(float(jax.device_get(m["loss"])))
    np.testing.assert_allclose([r["loss"] for r in records(run_dir) if "loss" in r], losses, rtol=1e-5)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """1 process x 8 devices, 12 steps: what every multi-process layout must reproduce."""
    run_dir = tmp_path_factory.mktemp("mp") / "ref"
    result = spmd_train(
        *TRAIN[2:],
        "--mesh",
        "data=2,fsdp=2,tensor=2",
        "--host-devices",
        "8",
        "--steps",
        "12",
        "--run-dir",
        str(run_dir),
    )
    assert result.returncode == 0, result.stderr
    return run_dir


@pytest.fixture(scope="module")
def reference(reference_run):
    return records(reference_run)


HYBRID = ["--dcn-mesh", "data=2", "--mesh", "fsdp=2,tensor=2"]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """2 processes x 4 devices, data across them, 12 steps: (run dir, the launcher's result)."""
    run_dir = tmp_path_factory.mktemp("mp2") / "run"
    result = launch(2, 4, *HYBRID, "--steps", "12", "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir, result


def test_two_processes_match_one(reference, two_processes):
    """A hybrid mesh (data across processes); a global mesh over 2 processes is checked by
    test_checkpoint_moves_between_process_counts."""
    run_dir, result = two_processes
    assert "[0] mesh: data=2,fsdp=2,tensor=2 over 8 cpu devices (2 processes)" in result.stderr
    assert "[1] step" not in result.stderr  # only process 0 logs
    assert (
        "[Gloo]" not in result.stdout + result.stderr
    )  # the connection lines (spmd-launch --verbose shows them)
    assert_close(records(run_dir), reference)


def figures(run_dir):
    """What a run's records say of training (no timings): bit for bit equal between equal runs."""
    keys = ("step", "loss", "grad_norm", "learning_rate", "eval_loss", "trained_tokens")
    return [{k: r[k] for k in keys if k in r} for r in records(run_dir)]


def checksums_at(run_dir, step):
    return ckpt.read_meta(run_dir / "checkpoints", step)["checksums"]


def test_a_save_cut_short_falls_back_to_the_previous_local_step_and_lost_local_dirs_to_storage(
    reference_run, tmp_path
):
    """One process (run as the reference is, so that it can equal it bit for bit), started again
    after each kill: killed halfway through writing its local checkpoint of step 6 (storage every
    8, committed before the step after it), it resumes from local step 4; killed after step 10 with its local directory gone, from
    storage step 8; it ends as the uninterrupted run."""
    from spmd.io.local_tier import base_dir

    run_dir = tmp_path / "run"
    hang = str(ROOT / "tests" / "hang_train.py")
    cmd = [sys.executable, hang, *TRAIN[2:], "--mesh", "data=2,fsdp=2,tensor=2", "--host-devices", "8",
           "--checkpoint-every", "8", "--set", "checkpoint.async_save=false", "--set", f"checkpoint.local_dir={tmp_path / 'local'}", "--set",
           "checkpoint.local_every=2", "--steps", "12", "--run-dir", str(run_dir)]  # fmt: skip
    faults = {"HANG_MARK": str(tmp_path / "mark"), "DIE_IN_LOCAL_SAVE": "6", "DIE_PROCESS": "0", "DIE_STEP": "10",
              "DIE_WIPE": str(base_dir(str(tmp_path / "local"), run_dir))}  # fmt: skip
    attempts = [
        subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env() | faults) for _ in range(3)
    ]
    said = "\n---\n".join(a.stderr[-1500:] for a in attempts)
    assert [a.returncode for a in attempts] == [-9, -9, 0], said
    assert "one process: no peer holds a copy of its local checkpoints" in attempts[0].stderr
    resumed = "resumed from the local tier" in attempts[1].stderr
    assert resumed and "at step 4: 32 samples consumed" in attempts[1].stderr, said
    assert f"resumed from {run_dir / 'checkpoints'}/8" in attempts[2].stderr, said
    assert figures(run_dir) == figures(reference_run)  # bit for bit
    assert checksums_at(run_dir, 12) == checksums_at(reference_run, 12)
    restores = goodput.read_restores(run_dir)
    assert [(r["tier"], r["step"], r["steps_lost"]) for r in restores] == [
        ("local", 4, 2),
        ("storage", 8, 2),
    ], said


def test_pure_data_parallelism_across_processes_sums_gradients_as_one_vector(reference, tmp_path):
    """cpu.grad_reduce=auto takes the flat gradient sum across processes (gloo pays per
    all-reduce operand) and trains as the 8-device reference (the first 4 of its 12 steps)."""
    args = ["--rules", "dp", "--dcn-mesh", "data=2", "--mesh", "data=4", "--steps", "4"]
    result = launch(2, 4, *args, "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "gradients: summed as one vector per dtype over data (cpu.grad_reduce=auto)" in result.stderr
    ours, theirs = records(tmp_path / "run"), [r for r in reference if r["step"] <= 4]
    assert_close(ours, theirs)
    # A gradient summed twice would train alike under AdamW and clipping; its norm would not.
    norms = [[r["grad_norm"] for r in rs if "grad_norm" in r] for rs in (ours, theirs)]
    assert len(norms[0]) == 4
    np.testing.assert_allclose(*norms, rtol=1e-5)


def test_checkpoint_moves_between_process_counts(reference, tmp_path):
    run_dir = tmp_path / "run"
    common = ["--mesh", "data=2,fsdp=2,tensor=2", "--checkpoint-every", "4", "--run-dir", str(run_dir)]
    first = launch(2, 4, *common, "--steps", "4")  # 2 processes x 4 devices
    assert first.returncode == 0, first.stderr[-3000:]
    second = spmd_train(*TRAIN[2:], *common, "--host-devices", "8", "--steps", "8")  # 1 x 8
    assert second.returncode == 0, second.stderr
    assert f"resumed from {run_dir / 'checkpoints'}/4" in second.stderr
    third = launch(4, 2, *common, "--steps", "12")  # 4 x 2
    assert third.returncode == 0, third.stderr[-3000:]
    assert f"resumed from {run_dir / 'checkpoints'}/8" in third.stderr
    assert_close(records(run_dir), reference)


def test_unreachable_coordinator_and_bad_process_id(tmp_path):
    t = time.time()
    result = spmd_train(
        "--config",
        "tiny",
        "--host-devices",
        "4",
        "--coordinator",
        f"127.0.0.1:{free_port()}",
        "--num-processes",
        "2",
        "--process-id",
        "1",
        "--init-timeout",
        "5",
        "--run-dir",
        str(tmp_path / "a"),
    )
    assert result.returncode == 2 and time.time() - t < 60
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.stderr.strip() == errors[0]
    assert "could not join the job" in errors[0] and "within 5s" in errors[0]
    result = spmd_train(
        "--config",
        "tiny",
        "--coordinator",
        "127.0.0.1:1234",
        "--num-processes",
        "2",
        "--process-id",
        "2",
        "--run-dir",
        str(tmp_path / "b"),
    )
    assert result.returncode == 2
    assert result.stderr.strip() == "error: --process-id 2 is out of range for 2 processes (0..1)"
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_each_process_loads_only_its_rows_and_together_they_are_the_global_batch(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "spmd.cli.launch",
        "--processes",
        "2",
        "--host-devices",
        "4",
        "--",
        sys.executable,
        str(ROOT / "tests" / "mp_data_dump.py"),
        str(tmp_path),
        "data=2,fsdp=4",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env())
    assert result.returncode == 0, result.stderr[-3000:]
    from spmd.assembly.setup import assemble

    single = assemble("tiny", "data=2,fsdp=4", "fsdp", overrides=["train.global_batch_size=16"]).batches()
    rows = [tuple(np.load(tmp_path / f"p{i}_rows.npy")) for i in range(2)]
    assert rows == [(0, 8), (8, 16)]
    for step in range(3):
        union = np.concatenate([np.load(tmp_path / f"p{i}_s{step}.npy") for i in range(2)])
        np.testing.assert_array_equal(union, single.global_numpy_batch(step)[:, :-1])


def test_sigterm_to_the_launcher_saves_a_checkpoint_on_every_process(tmp_path):
    run_dir = tmp_path / "run"
    proc = launch(
        2, 4, "--mesh", "fsdp=4,tensor=2", "--steps", "100000", "--run-dir", str(run_dir), wait=False
    )
    deadline = time.time() + 300
    while not (run_dir / "metrics.jsonl").exists() or len(records(run_dir)) < 3:
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-3000:]
    steps = ckpt.committed_steps(run_dir / "checkpoints")
    assert len(steps) == 1 and steps[0] >= 3
    assert f"[0] stopped by signal 15: checkpoint for step {steps[0]} committed" in stderr


def test_max_restarts_resumes_a_hung_job_from_the_local_tier_and_a_replaced_host_from_its_peer(
    two_processes, tmp_path
):
    """One launch with --max-restarts 2 (tests/hang_train.py injects the failures), storage every 4
    steps, a local tier every 2 with a copy on the other process. Attempt 1 hangs fetching step
    7's batch: both watchdogs dump their stacks and exit 4; attempt 2 resumes from local step 6
    (storage holds 4). Process 1 is killed (-9) before step 12 with its local directory wiped (a
    replaced host); the launcher stops process 0 and reports 137; attempt 3 resumes from local
    step 10, process 1's shards from the copy process 0 holds. The run ends bit for bit as the
    uninterrupted one, and the ledger counts what the restarts cost."""
    from spmd.io.local_tier import base_dir

    run_dir = tmp_path / "run"
    hang = str(ROOT / "tests" / "hang_train.py")
    tier = ["--set", f"checkpoint.local_dir={tmp_path / 'local'}", "--set", "checkpoint.local_every=2",
            "--set", "checkpoint.replicas=1", "--set", "checkpoint.async_save=false"]  # fmt: skip
    cmd = [sys.executable, "-m", "spmd.cli.launch", "--processes", "2", "--host-devices", "4",
           "--max-restarts", "2", "--", sys.executable, hang, *TRAIN[2:], *HYBRID, *tier,
           "--checkpoint-every", "4", "--set", "train.step_timeout=8", "--steps", "12", "--run-dir", str(run_dir)]  # fmt: skip
    hang_env = env() | {
        "HANG_STEP": "6",
        "HANG_MARK": str(tmp_path / "mark"),
        "DIE_STEP": "11",
        "DIE_PROCESS": "1",
        "DIE_WIPE": str(base_dir(str(tmp_path / "local"), run_dir) / "process-1"),
    }
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=hang_env)
    assert result.returncode == 0, result.stderr[-3000:]
    err = result.stderr
    assert (
        "error: hang: no progress for" in err
        and "[0] error: hang: no progress for" in err
        and "since step 6 finished (deadline 8.0s" in err
    )
    assert "in hang_here" in err  # the stack of the hung main thread, in the dump
    dump = (run_dir / "hangs" / "step6.process0.txt").read_text()
    assert "in hang_here" in dump and "in train_batch" in dump
    assert "exited with 4" in err and "restart 1 of 2" in err
    assert "process 1 exited with 137; stopping the others" in err and "restart 2 of 2" in err
    assert "[0] resumed from the local tier" in err and "at step 6: 48 samples consumed\n" in err
    assert "at step 10: 80 samples consumed; process 1's shards from process 0's copy" in err
    assert figures(run_dir) == figures(two_processes[0])  # bit for bit
    assert checksums_at(run_dir, 12) == checksums_at(two_processes[0], 12)
    restores = goodput.read_restores(run_dir)
    assert [(r["tier"], r["step"], r["steps_lost"]) for r in restores] == [("local", 6, 0), ("peer", 10, 1)]
    last = records(run_dir)[-1]
    assert last["restores"] == 2 and last["steps_lost"] == 1 and last["restore_seconds"] > 0
    assert last["time_lost"] > 0 and last["time_compile"] > 0 and 0 < last["goodput"] < 1
    buckets = [last[f"time_{b}"] for b in ("init", "compile", "data_wait", "productive", "checkpoint", "eval",
                                            "lost", "other")]  # fmt: skip
    assert last["goodput"] == pytest.approx(last["time_productive"] / sum(buckets))
    done = [line for line in err.splitlines() if "done: step 12" in line]
    assert done and "goodput " in done[0] and "lost " in done[0]
    assert "2 restores: 1 steps lost" in done[0] and "(local 1, peer 1)" in done[0]


def test_the_launcher_drops_gloos_connection_lines_however_they_interleave():
    """gloo writes one connection line per communicator from several threads at once; the pieces
    land interleaved at any boundary, a number sometimes on a line of its own."""
    import io

    from spmd.platform.launcher import pump

    lines = [
        "[Gloo] Rank 3 is connected to 3[Gloo] Rank 2 is connected to  peer ranks. 3Expected number of "
        "connected peer ranks is :  peer ranks. 3Expected number of connected peer ranks is : \n",
        "3\n",
        "[Gloo] Rank [Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n",
        "step 3  loss 5.56\n",
        "42\n",  # a job's own output, after a line of its own: kept
    ]
    out = io.StringIO()
    pump(iter(lines), "[1] ", out)
    assert out.getvalue() == "[1] step 3  loss 5.56\n[1] 42\n"
    out = io.StringIO()
    pump(iter(lines), "[1] ", out, verbose=True)
    assert out.getvalue().count("[1] ") == len(lines)


def test_two_processes_syncing_across_the_dcn_axis_match_the_slices_simulated_in_one(tmp_path):
    """[sync] across --dcn-mesh data=2 (the slow axis from the flag) on 2 processes: DiLoCo with
    int8 outer gradients trains as the same slices simulated on one process's 8 devices
    (sync.axes = data): the syncs at steps 2 and 4 included."""

    from spmd.assembly.setup import assemble

    sync = ["sync.method=diloco", "sync.inner_steps=2", "sync.compress=int8", "optimizer.schedule_steps=12"]
    result = launch(2, 4, *HYBRID, *(a for s in sync for a in ("--set", s)), "--steps", "4",
                    "--eval-every", "0", "--run-dir", str(tmp_path / "run"))  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    setup = assemble(
        "tiny", "data=2,fsdp=2,tensor=2", "fsdp_tp", overrides=["sync.axes=data", *sync, "train.steps=4"]
    )
    assert setup.cfg.sync.axis_names() == ("data",)
    assert_losses_of(tmp_path / "run", setup, 4)


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1", "gpipe"])
def test_two_processes_with_the_stages_across_them_match_one(tmp_path, schedule):
    """1F1B, ZB-H1 and GPipe (scheduled across processes: gloo lets the stages run different
    passes at once) with --dcn-mesh stage=2 (one stage per process): the activations and gradients
    cross processes by the schedule's permutes; losses equal GPipe's lockstep loop on the same mesh
    in this process (which equals one device, as they do)."""

    from spmd.assembly.setup import assemble

    sets = ["pipeline.microbatches=2", "optimizer.schedule_steps=12"]
    result = launch(2, 4, "--dcn-mesh", "stage=2", "--mesh", "fsdp=2,tensor=2", "--rules", "pp_fsdp_tp",
                    *(a for s in [f"pipeline.schedule={schedule}", *sets] for a in ("--set", s)), "--steps", "3",
                    "--eval-every", "0", "--run-dir", str(tmp_path / "run"))  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"pipeline: {schedule} over 2 stages" in result.stdout + result.stderr
    if schedule == "gpipe":
        assert "scheduled backward" in result.stdout + result.stderr
    setup = assemble("tiny", "stage=2,fsdp=2,tensor=2", "pp_fsdp_tp",
                     overrides=["pipeline.schedule=gpipe", *sets, "train.steps=3"])  # fmt: skip
    assert_losses_of(tmp_path / "run", setup, 3)
