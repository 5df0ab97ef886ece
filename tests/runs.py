"""In-process training for the tests, importable without conftest's process set-up (so also in a
fresh process: conftest.run_fresh)."""

import jax
import numpy as np


def run_training(cfg, mesh_spec: str, rules_name: str, steps: int, devices=None):
    """Train `steps` steps in-process; return (losses, params as host numpy, trainer)."""
    from spmd.setup import assemble

    setup = assemble(cfg, mesh_spec, rules_name, devices=devices)
    trainer, batches = setup.trainer, setup.batches()
    state = trainer.init_state()
    losses = []
    for step in range(steps):
        state, metrics = trainer.train_step(state, batches.train_batch(step))
        losses.append(float(metrics["loss"]))
    params = jax.tree.map(np.asarray, jax.device_get(state["params"]))
    return np.array(losses), params, trainer
