"""Mixture-of-experts MLP: a top-k router over SwiGLU experts, optional shared experts.

Legend: B batch (one routing group per sequence), T tokens, D embed, F expert hidden, E experts,
k experts per token, C capacity (token slots per expert per group), M = T*k token-choices.

Two dispatch paths compute the same function when nothing is dropped:

- capacity (GShard): one-hot dispatch and combine tensors and einsums. Each expert takes at most
  C = ceil(k * T * capacity_factor / E) tokens per sequence; choices past that are dropped (first
  choices before second choices, then in token order). Plain einsums, so GSPMD partitions it:
  with experts sharded over the `expert` mesh axis it exchanges tokens with all-to-all.
- dropless: token-choices sorted by expert and multiplied with `jax.lax.ragged_dot` (grouped
  matmul; on CPU as tiles of one expert's rows, see grouped_swiglu); nothing is dropped. GSPMD
  cannot partition a sort-and-ragged-dot by expert, so this path runs per shard (spmd.parallel.expert_parallel) and
  exchanges tokens with an explicit all-to-all.

The router's auxiliary losses: load balance E * sum_e f_e P_e (Switch/GShard; f_e the fraction of
token-choices sent to e, P_e the mean router probability of e) and z-loss mean(logsumexp(logits)^2).
"""

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from spmd.core.family import Aux
from spmd.core.logical import active, constrain, lowering, provided
from spmd.models.layers import MLP, param, swiglu

ROUTER_SCORES = ("softmax", "sigmoid")
DISPATCH = ("capacity", "dropless")

DISPATCHED_AXES = ("act_moe_batch", "act_expert", None, "act_embed")  # B E C D, at the experts
LOCAL_AXES = ("batch", None, None, "act_embed")  # B E C D, where the tokens came from


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """The `[moe]` table: a model whose config has one is a mixture of experts (absent: dense)."""

    n_experts: int = 8
    top_k: int = 2  # experts per token
    every: int = 1  # every every-th layer is MoE (1: all of them)
    d_ff_expert: int = 0  # each expert's hidden size; 0: model.d_ff
    n_shared_experts: int = 0  # always-on experts (DeepSeek), as one SwiGLU of n x d_ff_expert
    router_score: str = "softmax"  # softmax | sigmoid
    normalize_top_k: bool = True  # the k chosen weights rescaled to sum to 1 (Qwen3-MoE: norm_topk_prob)
    dispatch: str = "capacity"  # capacity (GShard einsums, drops past capacity) | dropless (ragged_dot)
    capacity_factor: float = 1.25
    aux_loss_coef: float = 0.01  # load-balancing loss weight
    router_z_loss_coef: float = 0.001

    def check(self, n_layers: int) -> list[str]:
        problems = []
        if self.n_experts < 1:
            problems.append(f"moe.n_experts must be positive, got {self.n_experts}")
        elif not 1 <= self.top_k <= self.n_experts:
            problems.append(
                f"moe.top_k ({self.top_k}) must be between 1 and moe.n_experts ({self.n_experts})"
            )
        if self.n_shared_experts < 0 or self.d_ff_expert < 0:
            problems.append("moe.n_shared_experts and moe.d_ff_expert must be >= 0")
        if self.every < 1 or n_layers % self.every:
            problems.append(f"model.n_layers ({n_layers}) must be a multiple of moe.every ({self.every})")
        if self.router_score not in ROUTER_SCORES:
            problems.append(f"moe.router_score must be softmax or sigmoid, got {self.router_score!r}")
        if self.dispatch not in DISPATCH:
            problems.append(f"moe.dispatch must be capacity or dropless, got {self.dispatch!r}")
        if not 0 < self.capacity_factor < float("inf"):
            problems.append(f"moe.capacity_factor must be positive, got {self.capacity_factor}")
        for key in ("aux_loss_coef", "router_z_loss_coef"):
            if not 0 <= getattr(self, key) < float("inf"):
                problems.append(f"moe.{key} must be a finite number >= 0, got {getattr(self, key)}")
        return problems


# The MoE layer's auxiliary outputs (spmd.core.family.Aux): its losses, weighted by the config's
# coefficients, and the counts its metrics are made of.
AUX_LOSSES = {"moe_aux_loss": "aux_loss_coef", "moe_router_z_loss": "router_z_loss_coef"}


def aux_weights(cfg) -> dict[str, float]:
    """Each auxiliary loss's weight in the training loss (none for a dense model)."""
    moe = getattr(cfg, "moe", None)
    return {} if moe is None else {name: getattr(moe, key) for name, key in AUX_LOSSES.items()}


def aux_metrics(sums: dict, count):
    """Logged metrics from the summed statistics of a step (the trainer's sums: each loss's mean
    times the counted tokens, and the layers' counts)."""
    if "moe_choices" not in sums:
        return {}
    return {
        "moe_aux_loss": sums["moe_aux_loss"] / count,
        "moe_router_z_loss": sums["moe_router_z_loss"] / count,
        "moe_dropped_fraction": jnp.sum(sums["moe_dropped"]) / jnp.sum(sums["moe_choices"]),
        # token-choices routed to the least and the most loaded expert of any MoE layer
        "moe_expert_load_min": jnp.min(sums["moe_load_E"]),
        "moe_expert_load_max": jnp.max(sums["moe_load_E"]),
    }


class Routing(NamedTuple):
    weights_BTk: jax.Array  # combine weight of each chosen expert (normalised over the k)
    experts_BTk: jax.Array  # int32 expert ids, best first
    aux_loss: jax.Array  # scalar: load-balancing loss
    z_loss: jax.Array  # scalar: router z-loss


def route(logits_BTE, top_k: int, score: str = "softmax", normalize: bool = True) -> Routing:
    """Top-k routing from router logits (fp32); `normalize`: the k weights rescaled to sum to 1."""
    E = logits_BTE.shape[-1]
    logits_BTE = logits_BTE.astype(jnp.float32)
    if score == "softmax":
        scores_BTE = jax.nn.softmax(logits_BTE, axis=-1)
        probs_BTE = scores_BTE
    else:  # sigmoid (DeepSeek-V3 style): independent scores, normalised for the balance loss
        scores_BTE = jax.nn.sigmoid(logits_BTE)
        probs_BTE = scores_BTE / jnp.sum(scores_BTE, axis=-1, keepdims=True)
    top_BTk, experts_BTk = jax.lax.top_k(scores_BTE, top_k)
    weights_BTk = top_BTk / jnp.sum(top_BTk, axis=-1, keepdims=True) if normalize else top_BTk
    chosen_BTE = jnp.sum(jax.nn.one_hot(experts_BTk, E, dtype=jnp.float32), axis=2)
    f_E = jnp.mean(chosen_BTE, axis=(0, 1)) / top_k
    P_E = jnp.mean(probs_BTE, axis=(0, 1))
    aux = E * jnp.sum(f_E * P_E)
    z = jnp.mean(jnp.square(jax.nn.logsumexp(logits_BTE, axis=-1)))
    return Routing(weights_BTk, experts_BTk.astype(jnp.int32), aux, z)


def capacity(T: int, E: int, top_k: int, capacity_factor: float) -> int:
    return max(1, min(T, math.ceil(top_k * T * capacity_factor / E)))


def dispatched_shape(cfg, B: int, T: int) -> tuple[int, int, int, int]:
    """(B, E, C, D): the tokens of B sequences of T dispatched to the experts (capacity path)."""
    moe = cfg.moe
    return B, moe.n_experts, capacity(T, moe.n_experts, moe.top_k, moe.capacity_factor), cfg.d_model


def dispatch_masks(experts_BTk, weights_BTk, E: int, C: int):
    """GShard dispatch (0/1) and combine (weights) tensors, (B, T, E, C), and the kept choices.

    Slots are given out first choice first, then second choice, ..., each in token order."""
    B, T, k = experts_BTk.shape
    onehot_BkTE = jax.nn.one_hot(experts_BTk.transpose(0, 2, 1), E, dtype=jnp.int32)
    position_BkTE = jnp.cumsum(onehot_BkTE.reshape(B, k * T, E), axis=1).reshape(B, k, T, E) - 1
    keep_BkTE = (onehot_BkTE == 1) & (position_BkTE < C)
    slot_BkTEC = jax.nn.one_hot(jnp.where(keep_BkTE, position_BkTE, -1), C, dtype=jnp.float32)  # -1: no slot
    dispatch_BTEC = jnp.sum(slot_BkTEC, axis=1)
    combine_BTEC = jnp.einsum("BkTEC,BTk->BTEC", slot_BkTEC, weights_BTk.astype(jnp.float32))
    return dispatch_BTEC, combine_BTEC, keep_BkTE


class MoE(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs):
        self.cfg = cfg
        D, E, F = cfg.d_model, cfg.moe.n_experts, cfg.moe.d_ff_expert or cfg.d_ff
        self.router_DE = param(rngs, cfg, (D, E), ("embed", "expert"))
        self.w_gate_EDF = param(rngs, cfg, (E, D, F), ("expert", "embed", "mlp"))
        self.w_up_EDF = param(rngs, cfg, (E, D, F), ("expert", "embed", "mlp"))
        self.w_down_EFD = param(
            rngs, cfg, (E, F, D), ("expert", "mlp", "embed"), std=cfg.init_std / (2 * cfg.n_layers) ** 0.5
        )
        if cfg.moe.n_shared_experts:  # one dense SwiGLU of the shared experts' total width
            self.shared = MLP(cfg, rngs=rngs, d_ff=cfg.moe.n_shared_experts * F)

    def __call__(self, x_BTD):
        moe, dt = self.cfg.moe, x_BTD.dtype
        B, T, _ = x_BTD.shape
        E, k = moe.n_experts, moe.top_k
        logits_BTE = jnp.einsum(
            "BTD,DE->BTE", x_BTD, self.router_DE[...].astype(dt), preferred_element_type=jnp.float32
        )
        r = route(logits_BTE, k, moe.router_score, moe.normalize_top_k)
        w_gate, w_up, w_down = (w[...].astype(dt) for w in (self.w_gate_EDF, self.w_up_EDF, self.w_down_EFD))
        load_E = jnp.sum(jax.nn.one_hot(r.experts_BTk, E, dtype=jnp.int32), axis=(0, 1, 2))
        if moe.dispatch == "capacity":
            C = capacity(T, E, k, moe.capacity_factor)
            dispatch_BTEC, combine_BTEC, keep_BkTE = dispatch_masks(r.experts_BTk, r.weights_BTk, E, C)
            # Dispatch where the tokens are, then move them to their experts' devices: pinning both
            # layouts makes the move (and its transpose in the backward) one all-to-all each way.
            x_BECD = constrain(jnp.einsum("BTEC,BTD->BECD", dispatch_BTEC.astype(dt), x_BTD), LOCAL_AXES)
            x_BECD = constrain(x_BECD, DISPATCHED_AXES)
            y_BECD = constrain(_experts(x_BECD, w_gate, w_up, w_down), DISPATCHED_AXES)
            y_BECD = constrain(y_BECD, LOCAL_AXES)
            out_BTD = jnp.einsum("BECD,BTEC->BTD", y_BECD, combine_BTEC.astype(dt))
            dropped = B * T * k - jnp.sum(keep_BkTE)
        else:
            out_BTD = dropless(x_BTD, r.experts_BTk, r.weights_BTk, w_gate, w_up, w_down)
            dropped = jnp.zeros((), jnp.int32)
        if moe.n_shared_experts:
            out_BTD = out_BTD + self.shared(x_BTD)
        aux = Aux(
            {"moe_aux_loss": r.aux_loss, "moe_router_z_loss": r.z_loss},
            {
                "moe_dropped": dropped.astype(jnp.float32),
                "moe_choices": jnp.float32(B * T * k),
                "moe_load_E": load_E.astype(jnp.float32),
            },
        )
        return out_BTD.astype(dt), aux


def _experts(x_BECD, w_gate_EDF, w_up_EDF, w_down_EFD):
    """SwiGLU of every expert on its slots: BECD,EDF->BECF, then BECF,EFD->BECD, computed with the
    expert axis leading and (B, C) merged (one batch axis per dot: XLA:CPU runs that form much
    faster; the merge moves no data since B is the major axis)."""
    B, E, C, D = x_BECD.shape
    x_EMD = x_BECD.transpose(1, 0, 2, 3).reshape(E, B * C, D)
    h_EMF = swiglu(jnp.einsum("EMD,EDF->EMF", x_EMD, w_gate_EDF), jnp.einsum("EMD,EDF->EMF", x_EMD, w_up_EDF))
    y_EMD = jnp.einsum("EMF,EFD->EMD", h_EMF, w_down_EFD)
    return y_EMD.reshape(E, B, C, D).transpose(1, 0, 2, 3)


def dropless(x_BTD, experts_BTk, weights_BTk, w_gate_EDF, w_up_EDF, w_down_EFD):
    """The dropless path: on one device the reference below; with sharding rules active, the
    expert-parallel exchange handed in through the seam (spmd/parallel/expert_parallel.py), which runs the reference on
    each device's tokens and experts."""
    if active() is not None:
        return provided("dropless_moe")(
            x_BTD,
            experts_BTk,
            weights_BTk,
            w_gate_EDF,
            w_up_EDF,
            w_down_EFD,
            reference=dropless_reference,
            experts=grouped_swiglu,
        )
    B, T, D = x_BTD.shape
    flat = (x_BTD.reshape(B * T, D), experts_BTk.reshape(B * T, -1), weights_BTk.reshape(B * T, -1))
    return dropless_reference(*flat, w_gate_EDF, w_up_EDF, w_down_EFD).reshape(B, T, D)


def dropless_reference(x_TD, experts_Tk, weights_Tk, w_gate_EDF, w_up_EDF, w_down_EFD):
    """Sort token-choices by expert, grouped matmuls with ragged_dot, weighted scatter back.
    One device's tokens and all (or its local) experts; used per shard by spmd.parallel.expert_parallel."""
    T, D = x_TD.shape
    E = w_gate_EDF.shape[0]
    k = experts_Tk.shape[1]
    e_M = experts_Tk.reshape(-1)
    order_M = jnp.argsort(e_M, stable=True)
    token_M = order_M // k
    sizes_E = jnp.bincount(e_M, length=E).astype(jnp.int32)
    y_MD = grouped_swiglu(x_TD[token_M], sizes_E, w_gate_EDF, w_up_EDF, w_down_EFD)
    w_M = weights_Tk.reshape(-1)[order_M].astype(y_MD.dtype)
    return jnp.zeros((T, D), y_MD.dtype).at[token_M].add(y_MD * w_M[:, None])


# Rows per tile of the tiled grouped matmul below: each expert's group is padded to whole tiles.
GROUP_TILE = 128


def grouped_swiglu(x_MD, sizes_E, w_gate_EDF, w_up_EDF, w_down_EFD):
    """Each expert's SwiGLU on its rows of x, which are sorted by expert (group e: the next
    sizes_E[e] rows; rows past the groups give 0): ragged_dot's grouped matmuls, or tiles of one
    expert's rows where the run's Lowering says (XLA:CPU lowers ragged_dot densely)."""
    if lowering().grouped_matmul == "tiles":
        return _swiglu_in_tiles(x_MD, sizes_E, w_gate_EDF, w_up_EDF, w_down_EFD)
    h_MF = swiglu(jax.lax.ragged_dot(x_MD, w_gate_EDF, sizes_E), jax.lax.ragged_dot(x_MD, w_up_EDF, sizes_E))
    return jax.lax.ragged_dot(h_MF, w_down_EFD, sizes_E)


def _swiglu_in_tiles(x_MD, sizes_E, w_gate_EDF, w_up_EDF, w_down_EFD, tile: int = GROUP_TILE):
    """grouped_swiglu as batched matmuls over tiles of `tile` rows that each hold one expert's
    rows (Megablocks' layout): every group padded to whole tiles, each tile multiplied by its
    expert's weights.

    XLA:CPU lowers ragged_dot densely (every row against every expert, then a select): E times
    the FLOPs. Tiles cost the padding: at most E tiles beyond ceil(M / tile)."""
    M, D = x_MD.shape
    E = sizes_E.shape[0]
    n = -(-M // tile) + E  # tiles: every group wastes less than one
    padded_E = -(-sizes_E // tile) * tile
    pad_start_E = jnp.cumsum(padded_E) - padded_E
    start_E = jnp.cumsum(sizes_E) - sizes_E
    # Each padded row's expert, its rank in the group, and the sorted row it holds (if any).
    row_R = jnp.arange(n * tile)
    expert_R = jnp.clip(jnp.searchsorted(jnp.cumsum(padded_E), row_R, side="right"), 0, E - 1)
    rank_R = row_R - pad_start_E[expert_R]
    valid_R = rank_R < sizes_E[expert_R]
    source_R = jnp.where(valid_R, start_E[expert_R] + rank_R, 0)
    x_nCD = jnp.where(valid_R[:, None], x_MD[source_R], 0).reshape(n, tile, D)
    expert_n = expert_R[::tile]
    h_nCF = swiglu(
        jnp.einsum("nCD,nDF->nCF", x_nCD, w_gate_EDF[expert_n]),
        jnp.einsum("nCD,nDF->nCF", x_nCD, w_up_EDF[expert_n]),
    )
    y_RD = jnp.einsum("nCF,nFD->nCD", h_nCF, w_down_EFD[expert_n]).reshape(n * tile, D)
    # Back to the sorted rows: row m sits at padded row pad_start + (m - start) of its expert.
    row_M = jnp.arange(M)
    expert_M = jnp.clip(jnp.searchsorted(jnp.cumsum(sizes_E), row_M, side="right"), 0, E - 1)
    y_MD = y_RD[pad_start_E[expert_M] + row_M - start_E[expert_M]]
    return jnp.where((row_M < jnp.sum(sizes_E))[:, None], y_MD, 0)
