"""spmd-ckpt inspect / verify / reshard, and what corruption looks like to the user."""

import shutil
import subprocess
import sys

import pytest
from test_cli import ROOT, spmd_train

from spmd import checkpoint as ckpt


def spmd_ckpt(*args):
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "ckpt.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )


def one_error_line(result) -> str:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ckpt") / "run"
    result = spmd_train(
        "--config",
        "tiny",
        "--mesh",
        "fsdp=8",
        "--host-devices",
        "8",
        "--steps",
        "10",
        "--checkpoint-every",
        "5",
        "--run-dir",
        str(run_dir),
    )
    assert result.returncode == 0, result.stderr
    return run_dir


def test_inspect(trained):
    result = spmd_ckpt("inspect", str(trained))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "step        5  committed" in out and "step       10  committed" in out
    assert "mesh fsdp=8, rules fsdp" in out
    assert "params/layers/attn/wq_DNH" in out and "(2, 64, 4, 16)" in out
    assert "80 samples consumed (global batch 8" in out
    assert "on disk" in out


def test_verify_ok(trained):
    result = spmd_ckpt("verify", str(trained))
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("ok: ") == 2


def test_reshard_then_resume_on_fewer_devices(trained, tmp_path):
    dst = tmp_path / "moved"
    result = spmd_ckpt(
        "reshard",
        str(trained),
        str(dst),
        "--mesh",
        "fsdp=2,tensor=2",
        "--rules",
        "fsdp_tp",
        "--host-devices",
        "4",
    )
    assert result.returncode == 0, result.stderr
    assert "mesh fsdp=2,tensor=2, rules fsdp_tp, 4 devices" in spmd_ckpt("inspect", str(dst)).stdout
    run = spmd_train(
        "--config",
        "tiny",
        "--mesh",
        "fsdp=2,tensor=2",
        "--rules",
        "fsdp_tp",
        "--host-devices",
        "4",
        "--steps",
        "12",
        "--run-dir",
        str(dst),
    )
    assert run.returncode == 0, run.stderr
    assert f"resumed from {dst / 'checkpoints'}/10" in run.stderr
    assert ckpt.committed_steps(dst / "checkpoints")[-1] == 12


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_corruption_is_reported_by_verify_and_resume(trained, tmp_path, damage):
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    data_files = sorted(
        (run_dir / "checkpoints" / "10" / "state").rglob("ocdbt.process_0/d/*"),
        key=lambda p: p.stat().st_size,
    )
    victim = data_files[-1]
    if damage == "truncate":
        victim.write_bytes(victim.read_bytes()[:100])
    else:
        victim.unlink()
    line = one_error_line(spmd_ckpt("verify", str(run_dir / "checkpoints" / "10")))
    assert "checkpoint" in line and "10" in line and ("corrupt" in line or "incomplete" in line)
    line = one_error_line(
        spmd_train(
            "--config",
            "tiny",
            "--mesh",
            "fsdp=8",
            "--host-devices",
            "8",
            "--steps",
            "20",
            "--run-dir",
            str(run_dir),
        )
    )
    assert "corrupt or incomplete" in line and "--resume-from" in line


def test_resume_from_errors(trained, tmp_path):
    base = ["--config", "tiny", "--host-devices", "8", "--run-dir", str(tmp_path / "new")]
    line = one_error_line(spmd_train(*base, "--resume-from", str(tmp_path / "missing")))
    assert "not found" in line
    partial = tmp_path / "partial" / "checkpoints" / "5.orbax-checkpoint-tmp-1"
    partial.mkdir(parents=True)
    line = one_error_line(spmd_train(*base, "--resume-from", str(tmp_path / "partial")))
    assert "no committed checkpoint" in line and "5.orbax-checkpoint-tmp-1" in line
    line = one_error_line(
        spmd_train(
            *base, "--resume-from", str(trained), "--set", "model.d_model=32", "--set", "model.head_dim=8"
        )
    )
    assert "has shape (256, 64) but this config needs (256, 32)" in line
    assert not (tmp_path / "new").exists()


def test_only_uncommitted_checkpoints_start_fresh_with_a_warning(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "3.orbax-checkpoint-tmp-9").mkdir(parents=True)
    result = spmd_train("--config", "tiny", "--host-devices", "8", "--steps", "2", "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr
    assert "holds only uncommitted checkpoints (3.orbax-checkpoint-tmp-9)" in result.stderr
    assert ckpt.committed_steps(run_dir / "checkpoints") == [2]
    assert not ckpt.uncommitted(run_dir / "checkpoints")


def test_retention_keeps_the_last_k_plus_every_mth(tmp_path):
    run_dir = tmp_path / "run"
    result = spmd_train(
        "--config",
        "tiny",
        "--host-devices",
        "8",
        "--steps",
        "12",
        "--checkpoint-every",
        "2",
        "--set",
        "checkpoint.keep_last=2",
        "--set",
        "checkpoint.keep_every=4",
        "--run-dir",
        str(run_dir),
    )
    assert result.returncode == 0, result.stderr
    assert ckpt.committed_steps(run_dir / "checkpoints") == [4, 8, 10, 12]
