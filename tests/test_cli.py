"""The CLI as a user meets it: bad input gives one `error:` line and exit 2; a real run trains."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def spmd_train(*args, cwd=None, timeout=300):
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "train.py"), *args],
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
    "unknown config key": (["--set", "train.learnig_rate=1e-3"], "did you mean 'train.learning_rate'?"),
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
        ["--set", "model.n_experts=4", "--set", "model.top_k=5"],
        "model.top_k (5) must be between 1 and model.n_experts (4)",
    ),
    "experts indivisible": (
        ["--mesh", "data=2,expert=4", "--rules", "ep", "--set", "model.n_experts=6"],
        "model.n_experts (6) does not divide by the expert mesh axes expert=4",
    ),
    "ulysses heads": (
        ["--mesh", "data=2,context=4", "--rules", "cp_ulysses"],
        "ulysses context parallelism over context=4 splits the heads 4 ways",
    ),
    "unknown context_parallel": (
        ["--set", "attention.context_parallel=ulyses"],
        "attention.context_parallel must be one of ring, ulysses, allgather",
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
        "--run-dir",
        str(run_dir),
    )
    assert result.returncode == 0, result.stderr
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
    (tmp_path / "notes.txt").write_text("mine")
    result = spmd_train("--config", "tiny", "--host-devices", "8", "--run-dir", str(tmp_path), "--steps", "1")
    assert result.returncode == 2 and "already holds files but no checkpoints" in result.stderr
    assert (tmp_path / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize(
    "command",
    ["spmd-train", "spmd-ckpt", "spmd-eval", "spmd-sample", "spmd-launch", "spmd-dryrun", "spmd-plan"],
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
