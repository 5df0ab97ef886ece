"""The train step when the slices sync by the `[sync]` table (spmd.parallel.slices): each slice's
gradients as one row of a vmap over the slow axes, then their compressed sum, or DiLoCo's inner
steps with an outer step at the sync points. One program per step.

The state gains `sync`: error feedback's residuals (a row per slice), PowerSGD's Q, and under
DiLoCo the slices' replicas and the outer momentum; under DiLoCo `params` are the shared (outer)
parameters and `opt_state` holds a row per slice.
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from spmd.parallel import sharding as sharding_lib
from spmd.parallel import slices as slices_lib


@dataclasses.dataclass(frozen=True)
class SlicedStep:
    opt_shardings: dict  # the state's opt_state (a row per slice under DiLoCo)
    sync_shardings: dict  # the state's `sync`
    init: Callable  # (trained params, optimizer state) -> (opt_state, sync)
    step: Callable  # (state, batch, key, max_loss) -> (new state, metrics, sums)


def inner_micro_sharding(plan, slices) -> NamedSharding:
    """Gradient accumulation's (k, rows, T) split inside one slice (the slow axes taken out)."""
    spec = tuple(plan.batch_sharding.spec)
    inner = tuple(a for a in slices_lib.spec_axes(spec[0]) if a not in slices.axes)
    return NamedSharding(
        plan.mesh, PartitionSpec(None, inner[0] if len(inner) == 1 else (inner or None), *spec[1:])
    )


def build(cfg, plan, slices, *, grads_and_sums, update, param_shardings, opt_shardings, views, layered):
    """`grads_and_sums(params, batch, key, frozen)`: one slice's summed gradients and loss sums (built with
    `inner_micro_sharding`); `update(state, grads, sums)`: the optimizer step (trainer.apply_update)
    of a {"params", "opt_state", "step"} state; `views`: PowerSGD's MatrixView per trained
    parameter (or None); `layered`: per trained parameter whether its leading axis is the layer
    stack (streaming DiLoCo's fragments)."""
    scfg = cfg.sync
    inner_rules = slices_lib.slice_rules(plan.rules, slices.axes)
    stacked = lambda tree: jax.tree.map(slices.stacked, tree)  # noqa: E731
    feedback = scfg.error_feedback and scfg.compress != "none"
    sync_shardings = {}
    if scfg.diloco:
        sync_shardings["replicas"] = stacked(param_shardings)
        sync_shardings["momentum"] = param_shardings
    if feedback:
        sync_shardings["residual"] = stacked(param_shardings)
    if scfg.compress == "powersgd":
        sync_shardings["q"] = {k: plan.replicated for k in slices_lib.q_shapes(views, scfg.rank)}
    state_opt_shardings = stacked(opt_shardings) if scfg.diloco else opt_shardings

    def f32_zeros_n(tree):
        return jax.tree.map(lambda x: jnp.zeros((slices.n, *x.shape), jnp.float32), tree)

    def init(trained, opt_state):
        sync = {}
        if scfg.diloco:
            sync["replicas"] = slices.broadcast(trained, param_shardings)
            sync["momentum"] = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), trained)
            opt_state = slices.broadcast(opt_state, opt_shardings)
        if feedback:
            sync["residual"] = f32_zeros_n(trained)
        if scfg.compress == "powersgd":
            sync["q"] = slices_lib.q_init(views, scfg.rank, cfg.train.seed)
        return opt_state, sync

    def per_slice_grads(params, batch, key, frozen, own_params: bool):
        batch_n = slices.rows(batch, plan.batch_sharding)

        def one(p, b):
            with sharding_lib.activate(inner_rules, plan.mesh, None, plan.lowering):
                return grads_and_sums(p, b, key, frozen)

        return jax.vmap(one, in_axes=(0 if own_params else None, 0), spmd_axis_name=slices.axes)(
            params, batch_n
        )

    def kept(keep, new, old):
        return jax.tree.map(lambda a, b: jnp.where(keep, a, b), new, old)

    def allreduce_step(state, batch, key, max_loss):
        sync = state["sync"]
        grads_n, sums_n = per_slice_grads(state["params"], batch, key, state.get("frozen"), False)
        sums = slices_lib.plain_sum(sums_n)
        residual = sync.get("residual")
        new_sync = dict(sync)
        if scfg.compress == "powersgd":

            def compressed():
                return slices_lib.powersgd_sum(grads_n, residual, sync["q"], views, slices, scfg.rank)

            def plain():
                return slices_lib.plain_sum(grads_n), residual, sync["q"]

            if scfg.start_step:
                grads, residual, new_sync["q"] = jax.lax.cond(
                    state["step"] >= scfg.start_step, compressed, plain
                )
            else:
                grads, residual, new_sync["q"] = compressed()
        else:
            grads, residual = slices_lib.cast_sum(grads_n, residual, scfg.compress, slices, param_shardings)
        if feedback:
            new_sync["residual"] = residual
        core = {k: state[k] for k in ("params", "opt_state", "step")}
        new_state, metrics = update(core, grads, sums, max_loss)
        new_state["sync"] = kept(metrics["skipped"] == 0, new_sync, sync)
        return new_state, metrics, sums

    fragments = slices_lib.fragment_offsets(scfg.inner_steps, scfg.fragments)

    def diloco_step(state, batch, key, max_loss):
        sync = state["sync"]
        start = sync["replicas"]
        grads_n, sums_n = per_slice_grads(start, batch, key, state.get("frozen"), True)

        def inner(p, o, g, s):
            st, m = update({"params": p, "opt_state": o, "step": state["step"]}, g, s, max_loss)
            return st["params"], st["opt_state"], m

        reps, opt_state, m_n = jax.vmap(inner, spmd_axis_name=slices.axes)(
            start, state["opt_state"], grads_n, sums_n
        )
        sums = slices_lib.plain_sum(sums_n)
        count = state["step"] + 1
        last = count == cfg.train.steps
        overlap = scfg.method == "streaming_diloco" and scfg.overlap
        carry = (state["params"], sync["momentum"], reps, sync.get("residual"))
        for f, offset in enumerate(fragments):
            pred = (count % scfg.inner_steps == offset) | last
            carry = jax.lax.cond(
                pred, lambda c, f=f: sync_fragment(c, f, start, last, overlap), lambda c: c, carry
            )
        anchor, momentum, reps, residual = carry
        new_sync = {"replicas": reps, "momentum": momentum}
        if feedback:
            new_sync["residual"] = residual
        ce_sum, z_sum, tokens, _ = sums
        metrics = {
            "loss": ce_sum / tokens,
            "z_loss": z_sum / tokens,
            "grad_norm": jnp.mean(m_n["grad_norm"]),  # the slices' mean
            "tokens": tokens,
            "skipped": jnp.max(m_n["skipped"]),
        }
        new_state = {"params": anchor, "opt_state": opt_state, "step": count, "sync": new_sync}
        return new_state, metrics, sums

    def sync_leaf(a, m, r_end, r_start, e, sharding, last, overlap):
        """One parameter's (part in a fragment) outer step: (anchor, momentum, replicas, residual)
        after averaging the slices' outer gradients anchor - replica (from the replicas at the
        start of the step under `overlap`, but at the run's last step)."""
        src = jnp.where(last, r_end, r_start) if overlap else r_end
        delta_n = a[None].astype(jnp.float32) - src.astype(jnp.float32)
        if scfg.compress == "none":
            spec = tuple(sharding.spec) + (None,) * (a.ndim - len(sharding.spec))
            total = slices.sum(delta_n, jax.sharding.PartitionSpec(*spec))
        else:
            total, e = slices_lib.cast_sum(delta_n, e, scfg.compress, slices, sharding)
        (a,), (m,) = slices_lib.outer_update([a], [m], [total / slices.n], scfg)
        reps = jnp.broadcast_to(a[None], r_end.shape)
        if overlap:  # the slice's step made while the sync ran, carried on the new parameters
            reps = reps + jnp.where(last, 0.0, r_end - r_start).astype(r_end.dtype)
        return a, m, jax.lax.with_sharding_constraint(reps.astype(r_end.dtype), slices.stacked(sharding)), e

    def sync_fragment(carry, f, start, last, overlap):
        """`carry` (anchor, momentum, replicas, residual) with fragment f synced: its rows of the
        layer stack, and with the first fragment every parameter outside the stack."""
        leaves = [list(jax.tree.leaves(t)) if t is not None else None for t in carry]
        treedef = jax.tree.structure(carry[0])
        starts, shardings = jax.tree.leaves(start), jax.tree.leaves(param_shardings)
        for i, is_layer in enumerate(jax.tree.leaves(layered)):
            if not (is_layer or f == 0):
                continue
            lo, hi = (
                slices_lib.fragment_bounds(leaves[0][i].shape[0], scfg.fragments)[f] if is_layer else (0, 0)
            )

            def part(x, axis):
                return jax.lax.slice_in_dim(x, lo, hi, axis=axis) if is_layer else x

            def put(x, new, axis):
                new = new.astype(x.dtype)
                return jax.lax.dynamic_update_slice_in_dim(x, new, lo, axis=axis) if is_layer else new

            residual = None if leaves[3] is None else part(leaves[3][i], 1)
            synced = sync_leaf(
                part(leaves[0][i], 0), part(leaves[1][i], 0), part(leaves[2][i], 1), part(starts[i], 1),
                residual, shardings[i], last, overlap,
            )  # fmt: skip
            for k, axis in enumerate((0, 0, 1, 1)):
                if leaves[k] is not None:
                    leaves[k][i] = put(leaves[k][i], synced[k], axis)
        return tuple(None if x is None else jax.tree.unflatten(treedef, x) for x in leaves)

    step = diloco_step if scfg.diloco else allreduce_step
    return SlicedStep(state_opt_shardings, sync_shardings, init, step)
