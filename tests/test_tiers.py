"""The local checkpoint tier in one process: which step a restore picks, the bytes round trip,
damaged and missing copies, a full disk, and the errors. (Killed processes and peers:
tests/test_multiprocess.py.)"""

import errno

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_cli import spmd_train

from spmd.assembly.config import CheckpointConfig
from spmd.core.errors import UserError
from spmd.io import local_tier
from spmd.loop import goodput

L = "layout"


def held(*steps):
    return {str(s): [100, L, "sha"] for s in steps}


def inv(own=(), **copies):
    return {"own": held(*own), "copies": {k.removeprefix("p"): held(*v) for k, v in copies.items()}}


def test_plan_takes_the_newest_step_every_process_can_get_own_copies_first():
    # process p's copies live on p+1: process 1 lost its own step 6, process 2 holds a copy
    invs = [inv((4, 6), p2=(4, 6)), inv((4,), p0=(4, 6)), inv((4, 6), p1=(4, 6))]
    assert local_tier.plan(invs, L, 3, -1) == (6, {0: 0, 1: 2, 2: 2})
    assert local_tier.plan(invs, L, 3, 6) is None  # storage is as new: storage
    # step 6 of process 1 is held nowhere: the next newest
    invs = [inv((4, 6)), inv((4,), p0=(4, 6)), inv((4, 6), p1=(4,))]
    assert local_tier.plan(invs, L, 3, -1) == (4, {0: 0, 1: 1, 2: 2})
    # a copy that failed its sha256 counts as missing
    invs = [inv((6,), p2=(6,)), inv((), p0=(6,)), inv((6,), p1=(6,))]
    assert local_tier.plan(invs, L, 3, -1, bad={(2, 1, 6)}) is None
    assert local_tier.plan(invs, L, 3, -1, bad={(0, 0, 6)}) == (6, {0: 1, 1: 2, 2: 2})
    # written for another layout, or by another process count: not used
    assert local_tier.plan(invs, "other", 3, -1) is None
    assert local_tier.plan(invs[:2], L, 3, -1) is None


def test_transfers_go_in_rounds_where_each_process_sends_and_receives_once():
    assert local_tier.rounds([(1, 0), (2, 0), (0, 3), (3, 1)]) == [[(1, 0), (0, 3), (3, 1)], [(2, 0)]]


def sharded_state(scale=1.0):
    mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"))
    w = jax.device_put(jnp.arange(64.0).reshape(8, 8) * scale, NamedSharding(mesh, P("fsdp", "tensor")))
    b = jax.device_put(jnp.arange(8, dtype=jnp.bfloat16) * scale, NamedSharding(mesh, P("tensor")))
    step = jax.device_put(jnp.int32(3), NamedSharding(mesh, P()))
    return {"params": {"w": w, "b": b}, "step": step}


def abstract(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


META = {"step": 0, "consumed_samples": 0, "global_batch_size": 8}


def tier_with(tmp_path, *steps):
    tier = local_tier.LocalTier(str(tmp_path / "local"), tmp_path / "run", 0)
    (tmp_path / "run").mkdir(exist_ok=True)
    tier.check_writable()
    tier.adopt(local_tier.run_id(tmp_path / "run", create=True), 0)
    for step in steps:
        state = sharded_state(step)
        tier.save(step, state, META | {"step": step})
    tier.wait()
    return tier


def test_saves_keep_the_newest_two_and_restore_the_newest_exactly(tmp_path):
    tier = tier_with(tmp_path, 2, 4, 6)
    assert local_tier.committed(tier.root / "own") == [4, 6]
    notes = []
    got = tier.restore(abstract(sharded_state()), -1, notes)
    assert (got.step, got.source, got.peers, notes) == (6, "local", {}, [])
    want = sharded_state(6)
    for a, b in zip(jax.tree.leaves(got.state), jax.tree.leaves(want)):
        assert a.sharding == b.sharding and a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert got.meta["consumed_samples"] == 0 and got.meta["checksums"]
    assert tier.restore(abstract(sharded_state()), 6, []) is None  # storage holds step 6 already
    tier.discard_after(4)  # a rollback to step 4, or a run that went back to it
    assert local_tier.committed(tier.root / "own") == [4]


def test_a_copy_that_fails_its_sha256_is_never_loaded(tmp_path):
    tier = tier_with(tmp_path, 4, 6)
    data = tier.root / "own" / "6" / local_tier.DATA
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF  # same size: only the sha256 can tell
    data.write_bytes(bytes(raw))
    notes = []
    got = tier.restore(abstract(sharded_state()), -1, notes)
    assert got.step == 4
    np.testing.assert_array_equal(
        np.asarray(got.state["params"]["w"]), np.asarray(sharded_state(4)["params"]["w"])
    )
    assert notes == ["warning: the local copy of process 0's shards of step 6 failed its sha256: not used"]


def test_another_layout_or_another_run_restores_from_storage(tmp_path):
    tier = tier_with(tmp_path, 4)
    mesh = jax.make_mesh((8,), ("data",))
    other = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P())), sharded_state()
    )
    notes = []
    assert tier.restore(other, -1, notes) is None
    assert notes == [
        "local checkpoints (step 4) were written for another mesh, rules or process count: not used"
    ]
    # the run directory made again (a new run id): its tier starts empty
    (tmp_path / "run" / local_tier.RUN_ID).unlink()
    rid = local_tier.run_id(tmp_path / "run", create=True)
    assert tier.restore(abstract(sharded_state()), -1, []) is None
    tier.adopt(rid, 0)
    assert not (tier.root / "own").exists()


def test_a_full_local_disk_warns_once_and_saving_goes_on(tmp_path, monkeypatch, capfd):
    tier = tier_with(tmp_path, 2)

    def full(path, payload):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(local_tier, "write_file", full)
    for step in (4, 6):
        state = sharded_state(step)
        tier.save(step, state, META | {"step": step})
    tier.close()
    err = capfd.readouterr().err
    assert err.count("warning: a local checkpoint could not be written to") == 1
    assert "(No space left on device); training and storage checkpoints go on" in err
    assert local_tier.committed(tier.root / "own") == [2]  # what it held stays, nothing half-written
    assert [p.name for p in (tier.root / "own").iterdir()] == ["2"]


def test_tier_settings_are_checked():
    problems = lambda **kw: " | ".join(CheckpointConfig(**kw).check())  # noqa: E731
    assert "checkpoint.local_every needs checkpoint.local_dir" in problems(local_every=2)
    assert "checkpoint.local_dir is set but checkpoint.local_every is 0" in problems(local_dir="/dev/shm/x")
    assert "checkpoint.replicas copies the local tier" in problems(replicas=1)
    assert "must be >= 0" in problems(local_every=-1, local_dir="x")
    assert CheckpointConfig(local_every=2, local_dir="x", replicas=1).check() == []
    with pytest.raises(
        UserError, match=r"checkpoint.replicas = 2 but the job has 2 process\(es\).*at most 1 peer copy"
    ):
        local_tier.LocalTier.check("x", 2, 2)
    assert local_tier.LocalTier.check("x", 0, 1) == [
        "one process: no peer holds a copy of its local checkpoints (checkpoint.replicas needs 2+)"
    ]
    assert local_tier.LocalTier.check("x", 3, 4) == []


def test_a_local_dir_that_cannot_be_written_is_one_error_before_anything_is_written(tmp_path):
    (tmp_path / "file").write_text("")
    run_dir = tmp_path / "run"
    result = spmd_train("--config", "tiny", "--steps", "2", "--run-dir", str(run_dir),
                        "--set", f"checkpoint.local_dir={tmp_path / 'file' / 'tier'}", "--set", "checkpoint.local_every=1")  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1].startswith("error: checkpoint.local_dir")
    assert "cannot be written (Not a directory); give a directory this user can write" in result.stderr
    assert "Traceback" not in result.stderr and not run_dir.exists()


def test_the_run_keeps_every_restore_and_the_ledger_sums_them(tmp_path):
    goodput.record_restore(tmp_path, 4, "local", 2, 0.5)
    with open(tmp_path / goodput.RESTORES, "a") as f:
        f.write('{"step": "x"}\n{"step": 3, "tier"')  # edited, then cut short by a kill: skipped
    restores = goodput.record_restore(tmp_path, 8, "storage", 3, 1.25)
    assert [(r["tier"], r["step"], r["steps_lost"]) for r in restores] == [("local", 4, 2), ("storage", 8, 3)]
    ledger = goodput.Ledger(0.0, {"productive": 1.0})
    ledger.restores = goodput.read_restores(tmp_path)
    record = ledger.record()
    assert (record["restores"], record["steps_lost"], record["restore_seconds"]) == (2, 5, 1.75)
    assert goodput.summary(ledger.totals(), ledger.restores).endswith(
        "; 2 restores: 5 steps lost, 1.8s reading (local 1, storage 1)"
    )


def test_local_saves_skip_the_steps_storage_saves_and_continuous_saves_start_when_the_last_committed():
    from spmd.loop.train_loop import CheckpointHook, LocalCheckpointHook

    local = LocalCheckpointHook(None, CheckpointConfig(every=4, local_every=2, local_dir="x"), None, None)
    assert [s for s in range(1, 13) if local.should_run(s, s == 12, False)] == [2, 6, 10]
    assert not local.should_run(2, False, True)  # a stop saves to storage

    class Saver:
        busy = True

        def idle(self):
            return not self.busy

    saver = Saver()
    hook = CheckpointHook(saver, 100, None, continuous=True)
    assert not hook.should_run(3, False, False)
    saver.busy = False
    assert hook.should_run(3, False, False)
    assert not CheckpointHook(saver, 100, None).should_run(3, False, False)


def test_continuous_storage_saves_beside_a_local_tier_every_step(tmp_path):
    from spmd.io import checkpoint as ckpt

    run_dir = tmp_path / "run"
    result = spmd_train("--config", "tiny", "--host-devices", "8", "--mesh", "fsdp=8", "--steps", "6", "--run-dir",
                        str(run_dir), "--set", "checkpoint.continuous=true", "--set", "checkpoint.keep_last=10", "--set",
                        f"checkpoint.local_dir={tmp_path / 'local'}", "--set", "checkpoint.local_every=1")  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    stored = ckpt.committed_steps(run_dir / "checkpoints")
    assert stored[0] == 1 and stored[-1] == 6 and len(stored) >= 2  # the next save starts once one committed
    own = local_tier.base_dir(str(tmp_path / "local"), run_dir) / "process-0" / "own"
    assert local_tier.committed(own) == [4, 5]  # every step but the last (storage's), the newest two kept
    assert "local checkpoints: 5 saves, " in result.stderr and "blocking each (median)" in result.stderr
