"""The one seam between models and the mesh: constrain an activation by logical axis names.

Models call `constrain(x, ("batch", "seq", "act_embed"))` and know nothing else. The trainer
activates a (rules, mesh) pair while it traces the step; outside that, `constrain` is a no-op, so
the model runs unchanged on one device, in tests, or under `jax.eval_shape`.
"""

import contextlib
import contextvars

import jax
from jax.sharding import NamedSharding

_ACTIVE = contextvars.ContextVar("spmd_activation_sharding", default=None)


@contextlib.contextmanager
def activation_sharding(rules, mesh):
    token = _ACTIVE.set((rules, mesh))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def constrain(x: jax.Array, logical: tuple[str | None, ...]) -> jax.Array:
    active = _ACTIVE.get()
    if active is None:
        return x
    rules, mesh = active
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, rules.spec(logical)))
