"""Expert parallelism for the dropless MoE path: an explicit all-to-all inside shard_map.

GSPMD partitions the capacity path's einsums by itself. The dropless path sorts token-choices by
expert and runs grouped matmuls (`ragged_dot`) whose group sizes are data: the partitioner cannot
split that by expert, so each device runs it on its own tokens here:

1. route locally; sort token-choices by expert, which groups them by the device owning the expert;
2. all-to-all a (devices, M, D) buffer: M = this device's token-choices is the bound on what one
   device can send to another, so nothing is ever dropped (cost: n*M*D memory per device, and
   the padding travels; a ragged all-to-all would send only the real rows);
3. sort what arrived by local expert, grouped matmuls through the local experts, unsort;
4. all-to-all back, weight and scatter-add into the tokens.

With `mlp` split over tensor as well, each tensor rank holds a slice of every local expert's
hidden units and the outputs are summed over tensor at the end.
"""

import jax
import jax.numpy as jnp

from spmd.core.logical import active as active_sharding
from spmd.core.logical import split_axes
from spmd.core.mesh import axes_size, format_axes
from spmd.parallel.strategy import Attribution, Strategy, names_on, rule

TOKEN_AXES = ("batch", "seq", None)


def dropless(x_BTD, experts_BTk, weights_BTk, w_gate_EDF, w_up_EDF, w_down_EFD, *, reference, experts):
    """The dropless MoE on the active mesh. `reference(x_TD, experts_Tk, weights_Tk, w_gate, w_up,
    w_down)` is the model's single-device computation (spmd.models.moe.dropless_reference), run where
    the experts are not split; `experts(x_MD, sizes_E, w_gate, w_up, w_down)` its grouped SwiGLU
    (spmd.models.moe.grouped_swiglu) on rows sorted by local expert. Both handed in so that this module
    needs nothing from spmd.models/."""
    rules, mesh = active_sharding()
    expert_axes, tensor_axes = split_axes(rules, mesh, "expert"), split_axes(rules, mesh, "mlp")
    n = axes_size(mesh.shape, expert_axes)
    ep = (expert_axes if len(expert_axes) > 1 else expert_axes[0]) if expert_axes else None
    tp = (tensor_axes if len(tensor_axes) > 1 else tensor_axes[0]) if tensor_axes else None
    P = jax.sharding.PartitionSpec
    token_spec = rules.spec(TOKEN_AXES)

    def local(x_BTD, e_BTk, w_BTk, wg, wu, wd):
        B, T, D = x_BTD.shape
        k = e_BTk.shape[-1]
        x_TD, e_M, w_M = x_BTD.reshape(B * T, D), e_BTk.reshape(-1), w_BTk.reshape(-1)
        if n == 1:
            out = reference(x_TD, e_BTk.reshape(B * T, k), w_BTk.reshape(B * T, k), wg, wu, wd)
        else:
            out = _exchange(x_TD, e_M, w_M, k, wg, wu, wd, ep, n, experts)
        if tp is not None:
            out = jax.lax.psum(out, tp)
        return out.reshape(B, T, D).astype(x_BTD.dtype)

    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(token_spec, token_spec, token_spec, P(ep, None, tp), P(ep, None, tp), P(ep, tp, None)),
        out_specs=token_spec,
        check_vma=False,
    )(x_BTD, experts_BTk, weights_BTk, w_gate_EDF, w_up_EDF, w_down_EFD)


def _exchange(x_TD, e_M, w_M, k, wg, wu, wd, axis, n, experts):
    M, D = e_M.shape[0], x_TD.shape[1]
    E_local = wg.shape[0]
    order_M = jnp.argsort(e_M, stable=True)  # by expert, hence by owning device
    e_s, token_s = e_M[order_M], order_M // k
    dest_s = e_s // E_local
    count_n = jnp.bincount(dest_s, length=n)
    rank_s = jnp.arange(M) - (jnp.cumsum(count_n) - count_n)[dest_s]  # slot within its destination
    send_nMD = jnp.zeros((n, M, D), x_TD.dtype).at[dest_s, rank_s].set(x_TD[token_s])
    send_nM = (
        jnp.full((n, M), E_local, jnp.int32).at[dest_s, rank_s].set(e_s % E_local)
    )  # E_local: empty slot
    recv_nMD = jax.lax.all_to_all(send_nMD, axis, 0, 0)
    recv_nM = jax.lax.all_to_all(send_nM, axis, 0, 0)

    e_R = recv_nM.reshape(-1)
    order_R = jnp.argsort(e_R, stable=True)  # empty slots sort last
    sizes = jnp.bincount(e_R, length=E_local + 1)[:E_local].astype(jnp.int32)
    xs = recv_nMD.reshape(n * M, D)[order_R]
    y = experts(xs, sizes, wg, wu, wd)
    y = jnp.where((e_R[order_R] < E_local)[:, None], y, 0)
    y_nMD = jnp.zeros_like(y).at[order_R].set(y).reshape(n, M, D)

    back_nMD = jax.lax.all_to_all(y_nMD, axis, 0, 0)
    y_s = back_nMD[dest_s, rank_s]
    w_s = w_M[order_M].astype(y_s.dtype)
    return jnp.zeros((x_TD.shape[0], D), y_s.dtype).at[token_s].add(y_s * w_s[:, None])


# --- the strategy ---------------------------------------------------------------------------------


def check(rules, mesh, figures, seq_len) -> list[str]:
    """The experts split evenly over the expert mesh axes."""
    if not figures.n_experts:
        return []
    expert_axes = rules.mapping.get("expert", ())
    n = axes_size(mesh.shape, expert_axes)
    if figures.n_experts % n:
        where = format_axes(mesh.shape, expert_axes)
        return [
            f"moe.n_experts ({figures.n_experts}) does not divide by the expert mesh axes {where} = {n}; "
            f"use a number of experts that {where} divides, or a smaller expert axis"
        ]
    return []


def minimum(step) -> float:
    """Each MoE layer moves its dispatched tokens (B/dp, E, C, D) to the experts and back, forward
    and backward: 4 all-to-alls, each sending (n-1)/n of the buffer; under remat the backward
    moves them again (the experts' inputs and outputs are not saved: their einsums have a batch
    dimension): 6."""
    n = axes_size(step.sizes, step.expert_axes)
    if not step.fig.n_experts or n <= 1:
        return 0.0
    moves = 4 + (2 if step.model.remat != "none" else 0)
    return moves * step.fig.moe_layers // step.stages * step.dispatched * (n - 1) / n


def dispatched_tokens(c, seen, shape):
    """Tokens dispatched to the experts and back: an all-to-all over the expert axes."""
    names = names_on(seen.rules, seen.axes, ("expert",))
    if c.kind == "all-to-all" and names and seen.holds_tokens(shape):
        return rule(names, seen.axes), "dispatched tokens (MoE)"
    return None


STRATEGY = Strategy(
    name="expert",
    rank=40,
    axes=("expert",),
    ops={"dropless_moe": dropless},
    check=check,
    minimum=minimum,
    attributions=(Attribution(330, "activation", dispatched_tokens),),
)
