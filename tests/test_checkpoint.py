"""Checkpoints restored onto other meshes, rules and device counts; compatibility errors; data position."""

import types

import jax
import numpy as np
import pytest

from spmd import checkpoint as ckpt
from spmd import sharding as sharding_lib
from spmd.config import load_config
from spmd.data import make_batches
from spmd.errors import UserError
from spmd.mesh import build_mesh
from spmd.rules import load_rules
from spmd.train import build_trainer


def setup(cfg, mesh_spec, rules, n_devices):
    mesh = build_mesh(mesh_spec, devices=jax.devices()[:n_devices])
    plan = sharding_lib.plan(
        cfg.model, mesh, load_rules(rules), cfg.train.global_batch_size, cfg.train.seq_len
    )
    return build_trainer(cfg, plan), make_batches(cfg, plan.batch_sharding)


def train(trainer, batches, state, steps):
    losses = []
    for step in steps:
        state, m = trainer.train_step(state, batches.train_batch(step))
        losses.append(float(m["loss"]))
    return state, losses


def save(tmp_path, state, step, batches):
    writer = ckpt.Checkpointer(tmp_path, ckpt.CheckpointConfig())
    writer.save(
        step,
        jax.tree.map(lambda x: x, state),
        {
            "step": step,
            "consumed_samples": batches.consumed_samples(step),
            "global_batch_size": batches.global_batch_size,
        },
    )
    writer.close()


MOVES = [  # (mesh A, rules A, devices A) -> (mesh B, rules B, devices B)
    (("fsdp=8", "fsdp", 8), ("fsdp=2,tensor=2", "fsdp_tp", 4)),
    (("fsdp=4,tensor=2", "fsdp_tp", 8), ("", "dp", 1)),
    (("data=2", "dp", 2), ("fsdp=8", "fsdp", 8)),
]


@pytest.mark.parametrize(
    "a,b", MOVES, ids=[f"{a[0] or 'one'}-{a[1]}->{b[0] or 'one'}-{b[1]}" for a, b in MOVES]
)
def test_reshard_on_restore(tiny_cfg, devices, tmp_path, a, b):
    trainer_a, batches_a = setup(tiny_cfg, *a)
    state, _ = train(trainer_a, batches_a, trainer_a.init_state(), range(3))
    saved = jax.tree.map(np.asarray, jax.device_get(state))
    save(tmp_path, state, 3, batches_a)
    _, unmoved_losses = train(trainer_a, batches_a, state, range(3, 6))

    trainer_b, batches_b = setup(tiny_cfg, *b)
    restored, meta = ckpt.restore(tmp_path / ckpt.SUBDIR, 3, trainer_b.abstract_state)
    assert meta["consumed_samples"] == 24
    for x, want, sharding in zip(
        jax.tree.leaves(restored), jax.tree.leaves(saved), jax.tree.leaves(trainer_b.state_shardings)
    ):
        np.testing.assert_array_equal(np.asarray(x), want)
        assert x.sharding.is_equivalent_to(sharding, x.ndim)
        assert len(x.sharding.device_set) == b[2]
    _, moved_losses = train(trainer_b, batches_b, restored, range(3, 6))
    np.testing.assert_allclose(moved_losses, unmoved_losses, rtol=1e-5)


def test_shape_mismatch_names_the_parameter(tiny_cfg, devices, tmp_path):
    trainer, batches = setup(tiny_cfg, "fsdp=8", "fsdp", 8)
    save(tmp_path, trainer.init_state(), 0, batches)
    other = load_config("tiny", ["model.d_ff=128"])
    trainer_b, _ = setup(other, "fsdp=8", "fsdp", 8)
    with pytest.raises(
        UserError, match=r"layers/mlp/w_down_FD has shape \(2, 192, 64\) but this config needs \(2, 128, 64\)"
    ):
        ckpt.restore(tmp_path / ckpt.SUBDIR, 0, trainer_b.abstract_state)


def test_locate_errors(tmp_path):
    with pytest.raises(UserError, match="not found"):
        ckpt.locate(str(tmp_path / "nope"))
    (tmp_path / "checkpoints" / "7.orbax-checkpoint-tmp-123").mkdir(parents=True)
    with pytest.raises(
        UserError, match=r"no committed checkpoint .*only uncommitted: 7.orbax-checkpoint-tmp-123"
    ):
        ckpt.locate(str(tmp_path))
    with pytest.raises(UserError, match="never committed"):
        ckpt.locate(str(tmp_path / "checkpoints" / "7.orbax-checkpoint-tmp-123"))


def test_changed_global_batch_continues_the_sample_stream(tiny_cfg, devices, tmp_path):
    """Saved at step 4 with B=8 (32 samples consumed); resumed with B=16: step 4 draws samples 32..47,
    exactly what the B=8 run would have drawn at its steps 4 and 5; the step counter stays 4."""
    from spmd.cli import _initial_state

    trainer, batches = setup(tiny_cfg, "fsdp=8", "fsdp", 8)
    state, _ = train(trainer, batches, trainer.init_state(), range(4))
    save(tmp_path, state, 4, batches)
    big = load_config("tiny", ["train.global_batch_size=16"])
    trainer16, batches16 = setup(big, "fsdp=8", "fsdp", 8)
    args = types.SimpleNamespace(resume_from=str(tmp_path), overwrite=False)
    restored, step, warnings = _initial_state(args, big, trainer16, batches16, tmp_path / "elsewhere")
    assert step == 4 and int(restored["step"]) == 4
    np.testing.assert_array_equal(
        batches16.global_numpy_batch(4),
        np.concatenate([batches.global_numpy_batch(4), batches.global_numpy_batch(5)]),
    )
    assert batches16.consumed_samples(5) == 32 + 16
    assert any("global batch size changed from 8 to 16" in w for w in warnings)
