"""Data parallelism: the batch split over `data` (and every axis that carries it), gradients summed
over it; its share of the analytic minimum and its collectives (the strategy, below).

Gradients summed as one flat vector (`cpu.grad_reduce`), as DDP's buckets do.

Under GSPMD a data-parallel step sums its gradients in one all-reduce with one operand per
parameter array. XLA:CPU's gloo collectives reduce the operands one at a time, each at a fixed
cost on loopback whatever its size, so a model's many small arrays cost far more than the same
bytes as one vector (figures: docs/performance.md). XLA's pass that would make the operands
contiguous (AllReduceContiguous) is not in the CPU pipeline, so here the
step computes each device's gradient in a `shard_map` over the data axes and sums it as one vector
per dtype.

Only a pure data-parallel layout may take this path: every parameter and its update whole on every
device, the batch split over every mesh axis of more than one device, a dense model (an MoE's
load-balancing loss is a function of the whole batch's routing, not a sum over devices).
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from spmd.core.errors import UserError
from spmd.core.mesh import axes_size, spec_axes
from spmd.parallel.strategy import (
    AS_ALL_REDUCE_SCATTER,
    AS_ALL_REDUCE_UPDATE,
    Attribution,
    Strategy,
    rule,
)

GRAD_REDUCE = ("auto", "flat", "xla")


def pure_data_axes(plan, update_shardings, dense: bool) -> tuple[str, ...] | None:
    """The mesh axes the batch is split over, when splitting the batch (over every axis of more than
    one device) is all the layout does; None for any other layout, one device, or a model with
    auxiliary losses (`dense` False: they are functions of the whole batch)."""
    mesh = plan.mesh
    big = {a for a, n in mesh.shape.items() if n > 1}
    spec = tuple(plan.batch_sharding.spec)
    # All the batch's axes, of one device too: the rows vary over each of them in the shard_map.
    batch_axes = spec_axes(spec[0]) if spec else ()
    if not big or plan.schedule is not None or not dense:
        return None
    if not big <= set(batch_axes) or any(a in big for e in spec[1:] for a in spec_axes(e)):
        return None
    shardings = jax.tree.leaves((plan.param_shardings, update_shardings))
    if not all(s.is_fully_replicated for s in shardings):
        return None
    return batch_axes


def flat_axes(mode: str, plan, update_shardings, dense: bool) -> tuple[str, ...] | None:
    """The axes to sum gradients over as one flat vector, or None for XLA's own all-reduce.
    `mode` is cpu.grad_reduce as the platform resolved it (spmd.assembly.policy.grad_reduce): "xla", or
    "flat" where the layout allows it, which it must when the setting asked for it."""
    if mode == "xla":
        return None
    axes = pure_data_axes(plan, update_shardings, dense)
    if axes is None and mode == "flat_required":
        raise UserError(
            "cpu.grad_reduce=flat needs a pure data-parallel layout of a dense model (every parameter "
            f"replicated, the batch split over every mesh axis; this run: rules {plan.rules.name!r}); "
            "use auto or xla"
        )
    return axes


def flat_psum(tree, axes: tuple[str, ...]):
    """`jax.lax.psum(tree, axes)` as one all-reduce operand per dtype: the leaves of each dtype
    concatenated into one vector, summed, and cut back into their shapes. Elementwise the same sums
    as a psum of the leaves."""
    leaves, treedef = jax.tree.flatten(tree)
    groups: dict = {}
    for i, x in enumerate(leaves):
        groups.setdefault(jnp.dtype(x.dtype), []).append(i)
    vectors = [jnp.concatenate([jnp.ravel(leaves[i]) for i in idx]) for idx in groups.values()]
    vectors = jax.lax.psum(vectors, axes)
    out = list(leaves)
    for idx, vector in zip(groups.values(), vectors, strict=True):
        ends = np.cumsum([leaves[i].size for i in idx])
        for i, end in zip(idx, ends, strict=True):
            out[i] = vector[end - leaves[i].size : end].reshape(leaves[i].shape)
    return jax.tree.unflatten(treedef, out)


def summed_over(fn, mesh, axes: tuple[str, ...], batch_spec: PartitionSpec):
    """`fn(params, batch) -> tree` run on each device's rows of the batch (params whole), its
    result summed over `axes` by `flat_psum`: for sums (gradients of summed losses, token counts),
    the value `fn` gives on the whole batch. The model inside runs as on one device: no activation
    constraints (there is nothing to constrain when only the batch is split)."""

    def local(params, batch):
        # Marked as varying over the data axes, the parameters' gradients inside `fn` are each
        # device's own; left invariant, JAX would sum every one of them itself (the transpose of
        # using an invariant value on varying data is a psum), one operand per array again.
        params = jax.lax.pcast(params, axes, to="varying")
        return flat_psum(fn(params, batch), axes)

    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(PartitionSpec(), batch_spec),
        out_specs=PartitionSpec(),
    )


# --- the strategy: data parallelism and the sharded weight update --------------------------------


def minimum(step) -> float:
    """Data parallelism (and context parallelism, whose devices see different tokens too)
    all-reduces the gradient of what it replicates; a sharded weight update (shard_optimizer_over)
    over z of those replicas reduce-scatters the gradient and gathers the updated parameter
    (parameter dtype) back, and all-reduces over the others each device's part of it."""
    total, sizes, rules = 0.0, step.sizes, step.plan.rules
    for p in step.plan.params:
        f, _, _, axes = step.weight(p)
        replicas = axes_size(sizes, [a for a in step.grad_axes if a not in axes])
        z = axes_size(sizes, [a for a in step.grad_axes if a not in axes and a in rules.shard_optimizer_over])
        grad = step.gathered(p) * step.grad_factor(p) / f
        if z > 1:
            total += (grad + p.bytes_per_device) * (z - 1) / z
            grad, replicas = grad / z, replicas // z
        if replicas > 1:
            total += 2 * grad * (replicas - 1) / replicas
    return total


def gradients(c, seen, shape, p, dim):
    """An array shaped like a parameter's shard, reduced over axes that split the batch (or the
    sequence): its gradient; or gathered under a sharded weight update: the updated parameter."""
    axes = seen.axes
    if seen.zero_axes and (c.kind == "all-gather" or c.as_gather):
        return (
            f"shard_optimizer_over -> {','.join(axes)}",
            AS_ALL_REDUCE_UPDATE if c.as_gather else "updated parameters gathered (sharded update)",
        )
    if c.kind == "all-reduce" and (dim is not None or seen.zero_axes) and seen.token_names:
        # The whole gradient summed everywhere, each device then keeping its shard (of the
        # parameter, or of the optimizer state under a sharded update).
        return rule(seen.token_names, axes), AS_ALL_REDUCE_SCATTER
    if c.kind in ("all-reduce", "reduce-scatter") and seen.token_names:
        return rule(seen.token_names, axes), "gradients reduced"
    return None


STRATEGY = Strategy(
    name="data",
    rank=20,
    axes=("data",),
    minimum=minimum,
    attributions=(Attribution(120, "param", gradients),),
)
