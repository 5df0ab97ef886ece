"""The CLI as a user meets it: bad input gives one `error:` line and exit 2; a real run trains."""

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def spmd_train(*args, cwd=None, timeout=300):
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    return subprocess.run(
        [sys.executable, "-m", "spmd.cli.train", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
    )


def _case_files(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "short.txt").write_text("def f(): pass\n")
    (tmp_path / "typo_rules.toml").write_text('[rules]\nbatch = "data"\nembd = "fsdp"\n')


ERROR_CASES = {
    "mesh product": (["--mesh", "data=4"], "--mesh data=4 has 4 devices but 8 are available"),
    "unknown mesh axis": (["--mesh", "model=8"], "unknown mesh axis 'model'"),
    "indivisible parameter": (
        ["--mesh", "tensor=8", "--rules", "tp"],
        "layers/attn/wk_DKH: dimension 2 (kv_heads, size 2) does not divide by mesh axes tensor=8",
    ),
    "unknown logical axis": (["--rules", "{tmp}/typo_rules.toml"], "unknown logical axis 'embd'"),
    "unknown rules preset": (["--rules", "zero3"], "unknown rules preset 'zero3'"),
    "unknown config key": (["--set", "train.learnig_rate=1e-3"], "did you mean 'optimizer.learning_rate'?"),
    "wrong --set type": (["--set", "train.global_batch_size=eight"], "expected an integer"),
    "missing data": (["--set", "data.path={tmp}/nope.txt"], "data file '{tmp}/nope.txt' not found"),
    "empty data": (["--set", "data.path={tmp}/empty.txt"], "is empty"),
    "sequence longer than corpus": (
        ["--set", "data.path={tmp}/short.txt"],
        "train.seq_len 64 is longer than the",
    ),
    "batch not divisible": (
        ["--mesh", "data=8", "--set", "train.global_batch_size=4"],
        "batch tokens: dimension 0",
    ),
    "unknown flag": (["--meshh", "data=8"], "unrecognized arguments: --meshh"),
    "top_k above n_experts": (
        ["--set", "moe.n_experts=4", "--set", "moe.top_k=5"],
        "moe.top_k (5) must be between 1 and moe.n_experts (4)",
    ),
    "experts indivisible": (
        ["--mesh", "data=2,expert=4", "--rules", "ep", "--set", "moe.n_experts=6"],
        "moe.n_experts (6) does not divide by the expert mesh axes expert=4",
    ),
    "ulysses heads": (
        ["--mesh", "data=2,context=4", "--rules", "cp_ulysses"],
        "ulysses context parallelism over context=4 splits the heads 4 ways",
    ),
    # Pipeline parallelism (spmd/parallel/pipeline.py).
    "layers indivisible by stages x repeats": (
        [
            "--mesh",
            "stage=2,data=4",
            "--rules",
            "pp",
            "--set",
            "pipeline.schedule=circular",
            "--set",
            "pipeline.repeats=2",
        ],
        "model.n_layers (2) does not divide into 2 stages x 2 repeats = 4 equal parts",
    ),  # fmt: skip
    "fewer microbatches than stages": (
        ["--mesh", "stage=2,data=4", "--rules", "pp", "--set", "pipeline.microbatches=1"],
        "pipeline.microbatches (1) must be at least the number of stages (2)",
    ),
    "stage without a pipeline preset": (
        ["--mesh", "stage=2,fsdp=4", "--rules", "fsdp"],
        "the mesh has stage=2 but rules 'fsdp' do not map the logical axis `layers` to it",
    ),
    "context_parallel is a rules key": (
        ["--set", "attention.context_parallel=ulysses"],
        "config key 'attention.context_parallel' (in --set) is a key of the sharding rules now: write "
        "context_parallel = 'ulysses' in a rules file",
    ),
}


@pytest.mark.parametrize("case", sorted(ERROR_CASES))
def test_bad_input_is_one_error_line_and_exit_2(tmp_path, case):
    _case_files(tmp_path)
    args, expected = ERROR_CASES[case]
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    run_dir = tmp_path / "run"
    result = spmd_train("--config", "tiny", "--host-devices", "8", "--run-dir", str(run_dir), *args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert expected.replace("{tmp}", str(tmp_path)) in lines[0]
    assert not run_dir.exists(), "a failed validation must not leave a run directory"


def test_print_sharding_allocates_nothing_for_a_big_model(tmp_path):
    result = spmd_train(
        "--config",
        "llama-70b",
        "--mesh",
        "fsdp=32,tensor=8",
        "--rules",
        "fsdp_tp",
        "--host-devices",
        "256",
        "--print-sharding",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "layers/mlp/w_gate_DF" in result.stdout and "P(-, fsdp, tensor)" in result.stdout
    assert "parameters: 70,553,706,496" in result.stdout
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_trains_tiny_end_to_end(tmp_path):
    run_dir = tmp_path / "run"
    result = spmd_train(
        "--config",
        "tiny",
        "--mesh",
        "fsdp=4,tensor=2",
        "--rules",
        "fsdp_tp",
        "--host-devices",
        "8",
        "--steps",
        "40",
        "--eval-every",
        "20",
        "--profile-steps",
        "2:3",
        "--run-dir",
        str(run_dir),
    )
    assert result.returncode == 0, result.stderr
    assert list((run_dir / "profile").rglob("*.xplane.pb"))  # --profile-steps wrote a trace
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [5, 10, 15, 20, 25, 30, 35, 40]
    for r in records:
        assert {"step", "loss", "tokens_per_sec", "mfu", "learning_rate"} <= set(r)
        assert r["tokens_per_sec"] > 0 and 0 < r["mfu"] < 1
    assert [r["step"] for r in records if "eval_loss" in r] == [20, 40]
    assert records[-1]["loss"] < records[0]["loss"] - 1.0
    assert records[-1]["eval_loss"] < records[0]["loss"]
    resolved = json.loads((run_dir / "config.json").read_text())
    assert resolved["mesh"]["shape"]["tensor"] == 2 and resolved["rules"]["name"] == "fsdp_tp"
    assert resolved["config"]["train"]["steps"] == 40
    assert (run_dir / "loss.png").stat().st_size > 1000
    assert any((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert "attention: xla" in result.stderr and "peak for MFU" in result.stderr
    # Running again in the same directory resumes from its final checkpoint.
    again = spmd_train(
        "--config",
        "tiny",
        "--mesh",
        "fsdp=4,tensor=2",
        "--rules",
        "fsdp_tp",
        "--host-devices",
        "8",
        "--steps",
        "45",
        "--run-dir",
        str(run_dir),
    )
    assert again.returncode == 0, again.stderr
    assert "resumed from" in again.stderr
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [5, 10, 15, 20, 25, 30, 35, 40, 45]


def test_a_directory_with_files_but_no_checkpoints_is_not_reused(tmp_path):
    """The run-dir checks spmd-train makes before it writes anything (in-process: the CLI turns
    these UserErrors into one `error:` line and exit 2, as test_bad_input checks)."""
    from spmd.core.errors import UserError
    from spmd.run import prepare_run_dir

    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="already holds files but no checkpoints"):
        prepare_run_dir(tmp_path, 0, False, True)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    for bad, what in ((tmp_path / "notes.txt", "is a file"), (tmp_path / "notes.txt" / "run", "cannot be created"),
                      (pathlib.Path("/proc/spmd-run"), "cannot be created")):  # fmt: skip
        with pytest.raises(UserError, match=f"^--run-dir .*{what}"):
            prepare_run_dir(bad, 0, False, True)


@pytest.mark.slow
def test_a_run_killed_before_its_first_checkpoint_restarts_with_the_same_command(tmp_path):
    """kill -9 while the step compiles leaves config.json (and maybe logs, a cut-off metrics line):
    the same command starts afresh, no --overwrite needed."""
    run_dir = tmp_path / "run"
    args = [
        "--config",
        "tiny",
        "--host-devices",
        "8",
        "--run-dir",
        str(run_dir),
        "--steps",
        "3",
        "--log-every",
        "1",
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    proc = subprocess.Popen([sys.executable, "-m", "spmd.cli.train", *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.time() + 120
    while not (run_dir / "config.json").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    assert (run_dir / "config.json").exists() and not (run_dir / "checkpoints" / "3").exists()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 5.5}\n{"step": 2, "lo')  # as a kill leaves it
    (run_dir / "tensorboard").mkdir(exist_ok=True)
    result = spmd_train(*args)
    assert result.returncode == 0, result.stderr
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    assert (run_dir / "checkpoints" / "3").is_dir()


@pytest.mark.parametrize(
    "command",
    [
        "spmd-train",
        "spmd-ckpt",
        "spmd-eval",
        "spmd-sample",
        "spmd-launch",
        "spmd-dryrun",
        "spmd-plan",
        "spmd-data",
    ],
)
def test_installed_entry_points_run_outside_the_repo(tmp_path, command):
    """The console scripts import every package they need from the installation (not the repo root)."""
    script = pathlib.Path(sys.executable).parent / command
    if not script.exists():
        pytest.skip(f"{command} is not installed next to this Python (run the README's `pip install -e .`)")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS", "PYTHONPATH")}
    result = subprocess.run(
        [str(script), "--help"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout
    if command == "spmd-train":
        table = subprocess.run(
            [str(script), "--config", "tiny", "--host-devices", "8", "--mesh", "fsdp=8", "--print-sharding"],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env=env,
            timeout=300,
        )
        assert table.returncode == 0, table.stderr
        assert "layers/attn/wq_DNH" in table.stdout


@pytest.mark.slow
def test_one_trainer_per_run_dir_and_a_dead_holders_lock_is_taken_over(tmp_path):
    run_dir = tmp_path / "run"
    args = ["--config", "tiny", "--host-devices", "8", "--run-dir", str(run_dir)]
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    first = subprocess.Popen([sys.executable, "-m", "spmd.cli.train", *args, "--steps", "100000"],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.time() + 120
        while not (run_dir / "config.json").exists() and time.time() < deadline:
            time.sleep(0.05)
        second = spmd_train(*args, "--steps", "2")
        assert second.returncode == 2, second.stderr
        line = second.stderr.strip()
        assert line.startswith("error: run directory") and f"in use by process {first.pid}" in line, line
        assert "\n" not in line
    finally:
        first.kill()
        first.wait()
    assert (run_dir / ".lock").exists()  # kill -9 leaves it behind
    third = spmd_train(*args, "--steps", "2")
    assert third.returncode == 0, third.stderr
    assert not (run_dir / ".lock").exists() and (run_dir / "checkpoints" / "2").is_dir()


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MiB tmpfs: room for two checkpoints of `tiny`, not for three."""
    mount = tmp_path / "disk"
    mount.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True
    )
    if result.returncode:
        pytest.skip(f"mounting a tmpfs is not permitted here ({result.stderr.decode().strip()[:100]})")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], capture_output=True)


@pytest.mark.slow
def test_a_full_disk_stops_training_with_one_error_and_keeps_earlier_checkpoints(small_disk):
    from spmd.io import checkpoint as ckpt

    run_dir = small_disk / "run"
    result = spmd_train("--config", "tiny", "--host-devices", "1", "--mesh", "fsdp=1", "--steps", "12",
                        "--checkpoint-every", "2", "--run-dir", str(run_dir))  # fmt: skip
    assert result.returncode == 3, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower() or "Traceback" in line]
    # Whichever write meets the full disk first (a checkpoint, or metrics.jsonl between them)
    # stops the run with one line that names it and the checkpoints kept.
    assert len(errors) == 1 and errors[0].startswith("error: "), result.stderr
    assert "No space left on device" in errors[0] and "training stopped" in errors[0]
    assert "the committed checkpoints (" in errors[0]
    kept = ckpt.committed_steps(run_dir / "checkpoints")
    assert kept and not ckpt.uncommitted(run_dir / "checkpoints")
    assert max(kept) < 12  # it stopped: no final checkpoint
    for step in kept:
        ckpt.verify(run_dir / "checkpoints", step)
    assert not (run_dir / ".lock").exists()


@pytest.mark.slow
def test_a_diverged_run_stops_with_an_error_and_finite_checkpoints(tmp_path):
    """The issue's recipe for NaN (learning rate 1e6, no warmup, no clipping) used to train to the
    end with exit 0 and rotate out every finite checkpoint."""
    from spmd.io import checkpoint as ckpt

    run_dir = tmp_path / "run"
    result = spmd_train("--config", "tiny", "--host-devices", "1", "--mesh", "fsdp=1", "--steps", "40",
                        "--checkpoint-every", "2", "--log-every", "1", "--run-dir", str(run_dir),
                        "--set", "optimizer.learning_rate=1e6", "--set", "optimizer.warmup_steps=0",
                        "--set", "optimizer.grad_clip=0")  # fmt: skip
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: training diverged: steps ") and "5 in a row" in last
    assert "Traceback" not in result.stderr
    steps = ckpt.committed_steps(run_dir / "checkpoints")
    assert steps and max(steps) < 40
    for step in steps:
        ckpt.verify(run_dir / "checkpoints", step)  # finite, checksums intact
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["skipped_steps"] >= 1


@pytest.mark.slow
def test_profile_steps_must_be_a_range(tmp_path):
    # (A good range writes a trace: test_trains_tiny_end_to_end.)
    bad = spmd_train(
        "--config", "tiny", "--host-devices", "1", "--profile-steps", "0:2", "--run-dir", str(tmp_path / "b")
    )
    assert bad.returncode == 2 and "--profile-steps must look like A:B" in bad.stderr
    assert not (tmp_path / "b").exists()
