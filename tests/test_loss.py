"""The cross-entropy without a float32 copy of the logits (spmd.training.loss) against optax's on float32
logits: values, logsumexp and gradients (through a z-loss too), and a train step built with it."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import run_training

from spmd.assembly.config import load_config
from spmd.assembly.setup import assemble
from spmd.training.loss import cross_entropy


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cross_entropy_and_its_gradient_equal_optax_on_float32_logits(dtype):
    k1, k2, k3 = jax.random.split(jax.random.key(7), 3)
    logits = (4 * jax.random.normal(k1, (2, 8, 300))).astype(dtype)
    targets = jax.random.randint(k2, (2, 8), 0, 300).at[0, 0].set(-1)  # a masked position's id
    mask = (targets >= 0).astype(jnp.float32)
    weights = jax.random.uniform(k3, (2, 8))

    def ours(logits):
        ce, lse = cross_entropy(logits, targets)
        return jnp.sum(ce * mask * weights) + 1e-2 * jnp.sum(jnp.square(lse) * mask), (ce, lse)

    def theirs(logits):
        x = logits.astype(jnp.float32)
        ce = optax.softmax_cross_entropy_with_integer_labels(x, jnp.clip(targets, 0, None))
        lse = jax.nn.logsumexp(x, axis=-1)
        return jnp.sum(ce * mask * weights) + 1e-2 * jnp.sum(jnp.square(lse) * mask), (ce, lse)

    (v1, (ce1, lse1)), g1 = jax.value_and_grad(ours, has_aux=True)(logits)
    (v2, (ce2, lse2)), g2 = jax.value_and_grad(theirs, has_aux=True)(logits)
    assert g1.dtype == logits.dtype
    np.testing.assert_allclose(ce1 * mask, ce2 * mask, rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(lse1, lse2, rtol=1e-6)
    np.testing.assert_allclose(v1, v2, rtol=1e-6)
    # the same float32 math, then one rounding to the logits' dtype
    tol = 1e-6 if dtype == "float32" else 1e-2
    np.testing.assert_allclose(
        np.asarray(g1, np.float32), np.asarray(g2, np.float32), rtol=tol, atol=tol * 1e-2
    )
    assert not np.asarray(g1[0, 0], np.float32).any()  # the masked position: no gradient at all


def test_a_train_step_with_the_fused_loss_trains_like_optax(devices):
    cfg = load_config("tiny", ["train.z_loss=1e-3"])
    losses, _, _ = run_training(cfg, "fsdp=2", "fsdp", 4, devices=devices[:2])
    setup = assemble(cfg, "fsdp=2", "fsdp", devices=devices[:2])
    assert not setup.choices.fused_loss  # CPU keeps optax's (the pinned trajectories)
    trainer = setup.with_choices(fused_loss=True).trainer
    state, batches, fused = trainer.init_state(), setup.batches(), []
    for step in range(4):
        state, metrics = trainer.train_step(state, batches.train_batch(step))
        fused.append(float(metrics["loss"]))
    np.testing.assert_allclose(fused, losses, rtol=2e-5)
