"""Data-parallel gradients summed as one flat vector (cpu.grad_reduce): the same sums and the same
training as XLA's all-reduce of every array, in one collective operand; only pure data parallelism
takes it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from spmd.analysis import hlo
from spmd.assembly.setup import assemble
from spmd.core.errors import UserError
from spmd.parallel import dataparallel


def test_flat_psum_is_the_psum_of_every_leaf_in_one_operand_per_dtype(devices):
    mesh = jax.make_mesh((4,), ("data",), devices=devices[:4])
    rng = np.random.default_rng(0)
    tree = {
        "w": rng.normal(size=(4, 3, 5)).astype(np.float32),
        "b": rng.normal(size=(4, 7)).astype(np.float32),
        "h": rng.normal(size=(4, 2, 2)).astype(jnp.bfloat16),
        "n": rng.integers(0, 100, size=(4,)).astype(np.int32),
        "s": rng.normal(size=(4,)).astype(np.float32),
    }

    def run(sum_fn):
        # Each device holds one row of every leaf; the result is the sum over devices.
        def local(t):
            return sum_fn(jax.tree.map(lambda x: x[0], t), ("data",))

        fn = jax.jit(
            jax.shard_map(local, mesh=mesh, in_specs=PartitionSpec("data"), out_specs=PartitionSpec())
        )
        placed = jax.device_put(tree, jax.sharding.NamedSharding(mesh, PartitionSpec("data")))
        return fn(placed), fn.lower(placed).compile().as_text()

    flat, flat_hlo = run(dataparallel.flat_psum)
    plain, plain_hlo = run(jax.lax.psum)
    for key in tree:
        assert flat[key].dtype == tree[key].dtype and flat[key].shape == tree[key].shape[1:]
        np.testing.assert_array_equal(np.asarray(flat[key], np.float64), np.asarray(plain[key], np.float64))
    np.testing.assert_allclose(flat["w"], tree["w"].sum(0), rtol=1e-6)
    # One vector operand per dtype (float32, bfloat16, int32; XLA:CPU may combine them into fewer
    # all-reduces), against one operand per leaf.
    operands = [shape for c in hlo.collectives(flat_hlo, mesh) for shape in c.shapes]
    assert sorted(operands) == [(1,), (4,), (15 + 7 + 1,)]
    assert sum(len(c.shapes) for c in hlo.collectives(plain_hlo, mesh)) == 5


def train(mode: str, devices, steps: int = 3):
    setup = assemble(
        "tiny",
        "data=8",
        "dp",
        overrides=[f"cpu.grad_reduce={mode}", "train.microbatches=2", "train.global_batch_size=16"],
        devices=devices,
    )
    trainer, batches = setup.trainer, setup.batches()
    state = trainer.init_state()
    compiled = trainer.train_step.lower(state, batches.train_batch(0)).compile()
    metrics = []
    for step in range(steps):
        state, m = compiled(state, batches.train_batch(step))
        metrics.append({k: float(v) for k, v in m.items() if k != "aux"})
    return (
        trainer,
        metrics,
        jax.device_get(state["params"]),
        hlo.collectives(compiled.as_text(), setup.plan.mesh),
    )


def test_flat_gradient_sum_trains_as_xlas_all_reduce(devices):
    xla_trainer, xla_metrics, xla_params, xla_reduces = train("xla", devices)
    flat_trainer, flat_metrics, flat_params, flat_reduces = train("flat", devices)
    assert xla_trainer.flat_grad_axes is None and flat_trainer.flat_grad_axes == ("data", "fsdp")
    # The gradient norm is what a gradient summed twice (or not at all) would change: AdamW and
    # clipping hide its scale from the loss.
    for key in ("loss", "grad_norm", "tokens", "z_loss"):
        np.testing.assert_allclose([m[key] for m in flat_metrics], [m[key] for m in xla_metrics], rtol=1e-6)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(flat_params), jax.tree.leaves(xla_params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path))
    # The point of it: one collective operand per step, where XLA sends one per parameter array.
    gradient_sums = [c for c in flat_reduces if c.kind == "all-reduce" and c.bytes > 1024]
    assert len(gradient_sums) == 1 and len(gradient_sums[0].shapes) == 1
    assert sum(len(c.shapes) for c in xla_reduces) >= len(jax.tree.leaves(xla_params))
    assert gradient_sums[0].bytes >= sum(x.nbytes for x in jax.tree.leaves(xla_params))


@pytest.mark.parametrize(
    "config,mesh,rules",
    [
        ("tiny", "fsdp=8", "fsdp"),
        ("tiny", "data=4,tensor=2", "tp"),
        ("tiny", "data=8", "dp_zero1"),  # the update is split over data: a reduce-scatter, not a sum
        ("tiny-moe", "data=8", "dp"),  # the load-balancing loss is not a sum over devices
        ("tiny", "data=4,stage=2", "pp"),
    ],
)
def test_only_pure_data_parallelism_takes_the_flat_sum(devices, config, mesh, rules):
    kwargs = {"devices": devices, "optimizer": True}
    auto = assemble(config, mesh, rules, overrides=["train.global_batch_size=16"], **kwargs)
    assert auto.trainer.flat_grad_axes is None
    with pytest.raises(UserError, match="cpu.grad_reduce=flat needs a pure data-parallel layout"):
        assemble(
            config, mesh, rules, overrides=["train.global_batch_size=16", "cpu.grad_reduce=flat"], **kwargs
        )


def test_auto_is_xlas_all_reduce_in_one_process_and_bad_values_are_refused(devices):
    # In one process XLA:CPU's collectives are memory copies: auto leaves them to XLA (in-process
    # A/B on `small`, data=2: 0.995x). Across processes it is flat (tests/test_multiprocess.py).
    assert assemble("tiny", "data=8", "dp", devices=devices).trainer.flat_grad_axes is None
    with pytest.raises(UserError, match="cpu.grad_reduce must be one of auto, flat, xla, got 'ddp'"):
        assemble("tiny", "data=8", "dp", overrides=["cpu.grad_reduce=ddp"], devices=devices)
