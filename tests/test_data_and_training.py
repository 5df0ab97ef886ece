"""Data position as a pure function of (seed, step, global batch); accumulation; masking; z-loss."""

import dataclasses
import re

import jax
import numpy as np
import pytest
from conftest import run_training
from jax.sharding import NamedSharding, PartitionSpec

from spmd.assembly.config import load_config
from spmd.core.errors import UserError
from spmd.core.mesh import build_mesh
from spmd.data.loader import make_batches, stdlib_corpus


def _batches(cfg, mesh_spec="data=8"):
    mesh = build_mesh(mesh_spec)
    return make_batches(cfg, NamedSharding(mesh, PartitionSpec(("data", "fsdp"), None)))


def test_batches_are_a_pure_function_of_seed_and_step(tiny_cfg, devices):
    a, b = _batches(tiny_cfg), _batches(tiny_cfg, "fsdp=8")
    for step in (0, 7, 123456):
        np.testing.assert_array_equal(a.global_numpy_batch(step), b.global_numpy_batch(step))
        got = a.train_batch(step)
        np.testing.assert_array_equal(np.asarray(got["inputs"]), a.global_numpy_batch(step)[:, :-1])
        np.testing.assert_array_equal(np.asarray(got["targets"]), a.global_numpy_batch(step)[:, 1:])
    other = _batches(dataclasses.replace(tiny_cfg, train=dataclasses.replace(tiny_cfg.train, seed=1)))
    assert not np.array_equal(a.global_numpy_batch(0), other.global_numpy_batch(0))
    assert not np.array_equal(a.global_numpy_batch(0), a.global_numpy_batch(1))


def test_every_window_once_per_epoch(devices, tmp_path):
    path = tmp_path / "d.npy"
    np.save(path, np.arange(1000, dtype=np.uint16))
    cfg = load_config("tiny", [f"data.path={path}", "train.seq_len=16", "model.vocab_size=1000"])
    b = _batches(cfg)
    n = b.n_train_windows
    starts = [int(w[0]) for s in range(n // 8) for w in b.global_numpy_batch(s)]
    assert len(set(starts)) == len(starts) == n // 8 * 8
    assert all(x % 16 == 0 for x in starts)


def test_held_out_split_is_disjoint_and_cached():
    train, val = stdlib_corpus(0.02)
    assert stdlib_corpus(0.02) == (train, val)
    t, v = np.load(train, mmap_mode="r"), np.load(val, mmap_mode="r")
    assert 0.005 < len(v) / (len(t) + len(v)) < 0.05
    assert bytes(v[:20000]) not in bytes(t)


def test_text_and_bin_user_data(devices, tmp_path):
    (tmp_path / "a.txt").write_text("hello world\n" * 300)
    cfg = load_config("tiny", [f"data.path={tmp_path / 'a.txt'}", "train.seq_len=32"])
    batch = _batches(cfg).global_numpy_batch(0)
    assert bytes(batch[0].astype(np.uint8)).decode() in ("hello world\n" * 300)
    (tmp_path / "t.bin").write_bytes(np.arange(5000, dtype=np.uint32).tobytes())
    with pytest.raises(UserError, match="token id 4999 but model.vocab_size is 256"):
        _batches(load_config("tiny", [f"data.path={tmp_path / 't.bin'}", "data.bin_dtype=uint32"]))
    cfg = load_config(
        "tiny",
        [
            f"data.path={tmp_path / 't.bin'}",
            "data.bin_dtype=uint32",
            "model.vocab_size=5000",
            "train.seq_len=16",
        ],
    )
    w = _batches(cfg).global_numpy_batch(0)[0]
    np.testing.assert_array_equal(np.diff(w), 1)


def test_gradient_accumulation_equals_one_big_batch(tiny_cfg, devices):
    cfg4 = load_config("tiny", ["train.microbatches=4", "train.global_batch_size=32"])
    cfg1 = load_config("tiny", ["train.microbatches=1", "train.global_batch_size=32"])
    l4, p4, _ = run_training(cfg4, "fsdp=4,data=2", "fsdp", 3)
    l1, p1, _ = run_training(cfg1, "fsdp=4,data=2", "fsdp", 3)
    np.testing.assert_allclose(l4, l1, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), p4, p1)


def _one_step_metrics(cfg):
    from spmd.assembly.setup import assemble

    setup = assemble(cfg, "", "dp", devices=jax.devices()[:1])
    trainer, plan = setup.trainer, setup.plan
    batch = setup.batches().train_batch(0)
    state = trainer.init_state()
    logits = jax.jit(lambda p, x: __import__("flax").nnx.merge(plan.graphdef, p)(x))(
        state["params"], batch["inputs"]
    )
    _, metrics = trainer.train_step(state, batch)
    return np.asarray(logits, np.float64), np.asarray(batch["targets"]), jax.device_get(metrics)


def test_loss_masking_and_z_loss(devices):
    space = ord(" ")
    logits, targets, m = _one_step_metrics(
        load_config("tiny", [f"data.mask_token_id={space}", "train.z_loss=1e-3"])
    )
    lse = np.log(np.exp(logits).sum(-1))
    ce = lse - np.take_along_axis(logits, targets[..., None], -1)[..., 0]
    keep = targets != space
    assert 0 < keep.sum() < keep.size  # the masked id really occurs
    np.testing.assert_allclose(m["tokens"], keep.sum())
    np.testing.assert_allclose(m["loss"], ce[keep].mean(), rtol=1e-5)
    np.testing.assert_allclose(m["z_loss"], 1e-3 * (lse[keep] ** 2).mean(), rtol=1e-5)


def test_a_non_finite_step_leaves_the_state_unchanged(tiny_cfg, devices):
    """A NaN in the parameters makes the loss NaN: the jitted step skips the update (parameters,
    optimizer state bit-identical) and says so; a finite step after it is not skipped."""
    from spmd.assembly.setup import assemble

    setup = assemble(tiny_cfg, "fsdp=4,tensor=2", "fsdp_tp")
    trainer, batches = setup.trainer, setup.batches()
    state, metrics = trainer.train_step(trainer.init_state(), batches.train_batch(0))
    assert int(metrics["skipped"]) == 0
    good = jax.tree.map(np.asarray, state)
    poisoned = dict(state, params=jax.tree.map(lambda x: x, state["params"]))
    poisoned["params"]["final_norm"]["scale_D"] = (
        poisoned["params"]["final_norm"]["scale_D"].at[0].set(np.nan)
    )
    before = jax.tree.map(np.asarray, poisoned)
    after, metrics = trainer.train_step(poisoned, batches.train_batch(1))
    assert int(metrics["skipped"]) == 1 and not np.isfinite(float(metrics["grad_norm"]))
    for a, b in zip(jax.tree.leaves(before["params"]) + jax.tree.leaves(before["opt_state"]),
                    jax.tree.leaves(after["params"]) + jax.tree.leaves(after["opt_state"])):  # fmt: skip
        np.testing.assert_array_equal(a, np.asarray(b))
    assert int(after["step"]) == 2  # the step (and the data) moves on
    state, metrics = trainer.train_step(jax.tree.map(jax.numpy.asarray, good), batches.train_batch(1))
    assert int(metrics["skipped"]) == 0


@pytest.mark.parametrize(
    "override,message",
    [
        ("optimizer.learning_rate=nan", "optimizer.learning_rate must be a positive number"),
        ("model.init_std=nan", "model.init_std must be a positive number"),
        ("model.norm_eps=-1", "model.norm_eps must be a positive number"),
        ("optimizer.beta2=nan", r"optimizer.beta2 must be in \[0, 1\)"),
        ("optimizer.beta1=5", r"optimizer.beta1 must be in \[0, 1\)"),
    ],
)
def test_config_values_that_can_only_give_nan_are_refused(override, message):
    with pytest.raises(UserError, match=message):
        load_config("tiny", [override])


def test_a_mask_token_that_masks_every_target_is_refused(tmp_path):
    path = tmp_path / "sevens.npy"
    np.save(path, np.full(5000, 7, np.uint16))
    with pytest.raises(UserError, match="masks every target"):
        make_batches(load_config("tiny", [f"data.path={path}", "data.mask_token_id=7"]), None)


@pytest.mark.parametrize(
    "n_devices,mesh,rules,overrides",
    [
        (1, "", "dp", []),
        (8, "data=2,fsdp=2,tensor=2", "fsdp_tp", []),
        (4, "stage=2,fsdp=2", "pp_fsdp", ["model.n_layers=4", "pipeline.microbatches=2"]),
    ],
    ids=["one-device", "fsdp_tp", "pipeline"],
)
def test_cpu_copy_insertion_option_drops_the_moment_copies_and_changes_no_bit(
    n_devices, mesh, rules, overrides, monkeypatch
):
    """spmd.assembly.policy.TRAIN_OPTIONS_CPU: on CPU, copy insertion with region analysis. The same
    program less copies: 3 steps give bit-identical states with and without it (one device, GSPMD,
    a pipeline's loops), and on one device the copies of the AdamW moments are gone."""
    from spmd.assembly import policy
    from spmd.assembly.setup import assemble

    def three_steps():
        setup = assemble(load_config("tiny", overrides), mesh, rules, devices=jax.devices()[:n_devices])
        trainer, batches = setup.trainer, setup.batches()
        state = trainer.init_state()
        program = trainer.train_step.lower(state, batches.train_batch(0)).compile()
        for step in range(3):
            state, _ = program(state, batches.train_batch(step))
        return jax.tree.map(np.asarray, jax.device_get(state)), program.as_text()

    with_option, text = three_steps()
    assert policy.resolve(load_config("tiny"), "cpu").train_options == policy.TRAIN_OPTIONS_CPU
    monkeypatch.setattr(policy, "TRAIN_OPTIONS_CPU", {})
    without, text_without = three_steps()
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(with_option), jax.tree.leaves(without)):
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
    if not mesh:
        moment_copies = re.compile(r"copy\(%state__opt_state\S*__(mu|nu)__")
        assert not moment_copies.search(text)
        assert moment_copies.search(text_without), "XLA no longer copies them: is the option still needed?"
