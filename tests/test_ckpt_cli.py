"""spmd-ckpt inspect / verify / reshard, and what corruption looks like to the user."""

import os
import shutil
import subprocess
import sys

import pytest
from test_cli import spmd_train

from spmd import start as start_lib
from spmd.io import checkpoint as ckpt


def spmd_ckpt(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "spmd.cli.ckpt", *args],
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
        env=env,
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


# OCDBT's b-tree node files start with this magic; the other files under d/ hold array values.
BTREE_NODE_MAGIC = bytes.fromhex("0cdb20de")


def data_files(step_dir):
    """The checkpoint's array value files, largest first. B-tree node files are left out: OCDBT
    leaves the nodes of superseded versions behind, and a byte flipped in one of those changes
    nothing that is read (a CI run had only two value files, and its third-largest file was such a
    node: the restored state was bit-identical)."""
    files = (step_dir / "state").rglob("ocdbt.process_0/d/*")
    values = [p for p in files if p.read_bytes()[:4] != BTREE_NODE_MAGIC]
    return sorted(values, key=lambda p: -p.stat().st_size)


def flip_byte(path, fraction: float) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * fraction)] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["truncate", "delete", "flip"])
def test_corruption_is_reported_by_verify_and_resume(trained, tmp_path, damage):
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    victim = data_files(run_dir / "checkpoints" / "10")[0]
    if damage == "truncate":
        victim.write_bytes(victim.read_bytes()[:100])
    elif damage == "delete":
        victim.unlink()
    else:
        flip_byte(victim, 0.5)
    line = one_error_line(spmd_ckpt("verify", str(run_dir / "checkpoints" / "10")))
    assert "checkpoint" in line and "10" in line and ("corrupt" in line or "incomplete" in line)
    if damage == "flip":  # read fine, values wrong: only the checksum can tell, and it names the array
        assert "does not match the checksum saved with it" in line
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
    assert "corrupt" in line and "--resume-from" in line


@pytest.mark.parametrize("fraction", [0.2, 0.5, 0.8])
def test_single_flipped_bytes_never_load_silently(trained, tmp_path, fraction):
    """One flipped byte in each of the (up to) three largest value files: verify and a full restore
    (resume) refuse the step; a parameters-only restore (eval, sample, --init-from) refuses it
    whenever the byte belongs to a parameter and otherwise returns the parameters exactly as saved.
    Before checksums, 8 of 10 such flips loaded changed values."""
    import jax
    import numpy as np

    from spmd.assembly.setup import assemble
    from spmd.core.errors import UserError

    setup = assemble("tiny", "fsdp=8", "fsdp")
    intact, _ = ckpt.restore_params(trained / "checkpoints", 10, setup.plan.abstract_params)
    n = min(3, len(data_files(trained / "checkpoints" / "10")))
    assert n >= 1
    for i in range(n):
        step_dir = tmp_path / f"f{i}" / "10"
        shutil.copytree(trained / "checkpoints" / "10", step_dir)
        flip_byte(data_files(step_dir)[i], fraction)
        with pytest.raises(UserError, match="corrupt"):
            ckpt.verify(step_dir.parent, 10)
        with pytest.raises(UserError, match="corrupt"):
            ckpt.restore(step_dir.parent, 10, setup.trainer.abstract_state)
        try:
            params, _ = ckpt.restore_params(step_dir.parent, 10, setup.plan.abstract_params)
        except UserError as e:
            assert "corrupt" in str(e)
        else:
            for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(intact)):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


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
    assert ": params/embed_VD has shape (256, 64) but this config needs (256, 32)" in line
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


def test_edited_or_renamed_metadata_is_refused(trained, tmp_path):
    """Metadata carries a digest and its step: an edited data position, a step directory renamed,
    and metadata missing what resume needs are errors, not a quietly shifted data stream."""
    import json

    from spmd.assembly.setup import assemble
    from spmd.core.errors import UserError

    setup = assemble("tiny", "fsdp=8", "fsdp")
    meta_file = "meta/metadata"

    def prepared(name):
        root = tmp_path / name / ckpt.SUBDIR
        shutil.copytree(trained / ckpt.SUBDIR / "10", root / "10")
        return root

    edited = prepared("edited")
    meta = json.loads((edited / "10" / meta_file).read_text())
    (edited / "10" / meta_file).write_text(json.dumps({**meta, "consumed_samples": 8}))
    with pytest.raises(UserError, match="metadata was edited or is corrupt"):
        start_lib.resume_or_init(setup.trainer, setup.batches(), edited.parent)
    renamed = prepared("renamed")
    (renamed / "10").rename(renamed / "11")
    with pytest.raises(UserError, match="metadata is for step 10; the step directory was renamed"):
        start_lib.resume_or_init(setup.trainer, setup.batches(), renamed.parent)
    missing = prepared("missing")
    body = {k: v for k, v in meta.items() if k not in ("consumed_samples", ckpt.META_DIGEST)}
    (missing / "10" / meta_file).write_text(json.dumps(body))
    with pytest.raises(
        UserError, match="its metadata has no meta_sha256, so what it holds cannot be checked"
    ):
        start_lib.resume_or_init(setup.trainer, setup.batches(), missing.parent)
    ckpt.trust_unverified()
    try:
        with pytest.raises(UserError, match="no valid 'consumed_samples'"):
            start_lib.resume_or_init(setup.trainer, setup.batches(), missing.parent)
    finally:
        ckpt.trust_unverified(False)
    line = one_error_line(spmd_ckpt("inspect", str(missing), "--trust-unverified"))
    assert "no valid 'consumed_samples'" in line


def test_metadata_without_its_digest_or_checksums_is_refused_unless_trusted(trained, tmp_path):
    """Every save writes a digest and per-array checksums; metadata without them (stripped, or cut
    down to {"version": 1}) is refused by every reader, and --trust-unverified reads it saying what
    went unchecked."""
    import json

    from spmd.assembly.setup import assemble
    from spmd.core.errors import UserError

    setup = assemble("tiny", "fsdp=8", "fsdp")
    root = tmp_path / "run" / ckpt.SUBDIR
    shutil.copytree(trained / ckpt.SUBDIR / "10", root / "10")
    meta_path = root / "10" / "meta" / "metadata"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(
        json.dumps({k: v for k, v in meta.items() if k not in ("checksums", ckpt.META_DIGEST)})
    )
    for read in (
        lambda: start_lib.resume_or_init(setup.trainer, setup.batches(), root.parent),
        lambda: ckpt.restore_params(root, 10, setup.plan.abstract_params),
        lambda: ckpt.verify(root, 10),
    ):
        with pytest.raises(UserError, match="has no meta_sha256 and no checksums.*--trust-unverified"):
            read()
    checked = spmd_ckpt("verify", str(root.parent))
    assert checked.returncode == 2 and "--trust-unverified" in one_error_line(checked)
    trusted = spmd_ckpt("verify", str(root.parent), "--trust-unverified")
    assert trusted.returncode == 0, trusted.stderr
    assert trusted.stdout.startswith(f"unchecked: {root}/10: ") and "meta_sha256, checksums" in trusted.stdout
    meta_path.write_text(json.dumps({"version": 1}))
    assert spmd_ckpt("verify", str(root.parent)).returncode == 2


def test_commands_on_a_cpu_host_print_nothing_of_libtpu(tmp_path):
    """With the tpu extra installed and no platform named, a command that does not target a TPU
    topology wakes no libtpu: stderr holds nothing of it (it used to print its start-up warnings
    and an `E0000 ... unexpected worker hostname` line before the command's own output)."""
    run = spmd_train("--config", "tiny", "--host-devices", "1", "--mesh", "fsdp=1", "--steps", "1",
                     "--run-dir", str(tmp_path / "run"))  # fmt: skip
    assert run.returncode == 0, run.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    for args in (
        ["ckpt.py", "verify", str(tmp_path / "run")],
        ["eval.py", "--run-dir", str(tmp_path / "run")],
    ):
        result = subprocess.run(
            [sys.executable, "-m", f"spmd.cli.{args[0].removesuffix('.py')}", *args[1:]],
            capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL, env=env,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert "TPU" not in result.stderr and "E0000" not in result.stderr, result.stderr
