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


def active():
    """The (rules, mesh) pair active while tracing, or None (one device, tests, eval_shape)."""
    return _ACTIVE.get()


def split_axes(rules, mesh, name: str) -> tuple[str, ...]:
    """The mesh axes, of more than one device, that the logical axis `name` is split over."""
    sizes = dict(mesh.shape)
    return tuple(a for a in rules.mapping.get(name, ()) if sizes[a] > 1)


def constrain(x: jax.Array, logical: tuple[str | None, ...]) -> jax.Array:
    active = _ACTIVE.get()
    if active is None:
        return x
    rules, mesh = active
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, rules.spec(logical)))


def can_merge(logical: tuple[str, ...]) -> bool:
    """Whether adjacent dimensions with these logical names can be flattened into one without
    moving data: true unless a dimension after the first is split over devices."""
    active = _ACTIVE.get()
    if active is None:
        return True
    rules, mesh = active
    return not any(split_axes(rules, mesh, name) for name in logical[1:])


def per_shard(fn, in_logical, out_logical):
    """`fn` applied to each device's shards (shard_map over the active mesh), for ops GSPMD cannot
    partition by itself (Pallas kernels). Identity when no rules are active (one device, tests).

    `in_logical` / `out_logical` give each argument's / the result's logical axes. Axes of size 1
    are left out of the specs; a sharded `seq` axis is refused: per-shard attention would then see
    only part of the sequence (that needs ring or all-to-all attention).
    """
    active = _ACTIVE.get()
    if active is None:
        return fn
    rules, mesh = active

    def spec(logical):
        if "seq" in logical and split_axes(rules, mesh, "seq"):
            raise ValueError(
                f"rules {rules.name!r} shard the sequence, which per-shard attention cannot handle"
            )
        return rules.spec(logical)

    return jax.shard_map(
        fn,
        mesh=mesh,
        in_specs=tuple(spec(names) for names in in_logical),
        out_specs=spec(out_logical),
        check_vma=False,
    )
