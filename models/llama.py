"""Llama-style decoder: embedding, RMSNorm, RoPE, grouped-query attention, SwiGLU, output head.

Legend: B batch, T sequence, D embed (d_model), N query heads, K kv heads, H head dim,
F mlp hidden, V vocab, L layers.

Every parameter carries logical axis names in its `out_sharding` metadata; the mapping to mesh
axes lives in `sharding_rules/`. Layers are created stacked (a leading `layers` axis) and applied
with `jax.lax.scan`, so compile time does not grow with depth.
"""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from spmd.logical import constrain, is_split, provided
from spmd.models import attention
from spmd.models.layers import MLP, RMSNorm, param, project, rope, rope_frequencies
from spmd.models.moe import DISPATCHED_AXES, MoE, MoEStats

REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    # Matmuls without batch axes: the projections (flattened to 2-D by `project`), not the
    # attention scores, which are batched over (B, K) and would cost O(T^2) to keep.
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # The same residuals, moved to host memory after the forward and back for the backward
    # (needs a backend that moves data between memories inside a program: spmd/memory.py).
    "offload_dots": jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host"),
}

# The only activations we constrain: the residual stream and the logits. Everything else the
# partitioner infers from the parameters. The residual's sequence axis has its own name, `act_seq`,
# so rules can split it where attention and MLP internals are not (Megatron sequence parallelism).
RESIDUAL_AXES = ("batch", "act_seq", "act_embed")
LOGITS_AXES = ("batch", "seq", "act_vocab")
# Heads before slots: the attention reads a cache as (B*K, S, H) without a transpose (a copy of
# the whole cache per layer and token in XLA:CPU with the slots first).
KV_CACHE_AXES = ("layers", "batch", "act_kv_heads", "seq", "head_dim")


class KVCache(NamedTuple):
    """Keys and values of every layer for S slots, and the position of the token in each slot
    (-1: empty or padding). Decoding writes T new slots at `index`. The keys and values are one
    stacked array each, or a tuple of one (B, K, S, H) array per layer (`empty(per_layer=True)`)."""

    k_LBKSH: jax.Array | tuple[jax.Array, ...]
    v_LBKSH: jax.Array | tuple[jax.Array, ...]
    positions_BS: jax.Array
    index: jax.Array  # scalar int32: the next slot to write

    @classmethod
    def empty(cls, cfg: "ModelConfig", batch: int, slots: int, per_layer: bool = False) -> "KVCache":
        """per_layer: what XLA:CPU decodes fastest (a layer's slice of a stacked cache is a copy
        there, a layer's own array is updated in place)."""
        layer, dtype = (batch, cfg.n_kv_heads, slots, cfg.head_dim), jnp.dtype(cfg.dtype)
        if per_layer:
            zeros = tuple(jnp.zeros(layer, dtype) for _ in range(cfg.n_layers))
        else:
            zeros = jnp.zeros((cfg.n_layers, *layer), dtype)
        return cls(zeros, zeros, jnp.full((batch, slots), -1, jnp.int32), jnp.zeros((), jnp.int32))


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    d_ff: int = 192
    rope_theta: float = 10000.0
    rope_scaling: str = "none"  # none | llama3 (Llama 3.1+ long-context frequencies; models/layers.py)
    rope_factor: float = 8.0  # llama3 scaling: how much the long wavelengths are stretched
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192  # the context the frequencies were first trained for
    qkv_bias: bool = False  # biases on the q, k and v projections (Qwen2)
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    dtype: str = "bfloat16"  # compute dtype
    param_dtype: str = "float32"  # parameters and optimizer state
    remat: str = "none"  # none | full | save_dots | offload_dots
    scan_unroll: int = 1  # layers per scan iteration (n_layers: fully unrolled; faster, longer compile)
    attention_impl: str = "xla"
    init_std: float = 0.02
    # Mixture of experts (models/moe.py); n_experts = 0 is a dense model.
    n_experts: int = 0
    top_k: int = 2  # experts per token
    moe_every: int = 1  # every moe_every-th layer is MoE (1: all of them)
    d_ff_expert: int = 0  # each expert's hidden size; 0: d_ff
    n_shared_experts: int = 0  # always-on experts (DeepSeek), as one SwiGLU of n x d_ff_expert
    router_score: str = "softmax"  # softmax | sigmoid
    moe_dispatch: str = "capacity"  # capacity (GShard einsums, drops past capacity) | dropless (ragged_dot)
    capacity_factor: float = 1.25
    aux_loss_coef: float = 0.01  # load-balancing loss weight
    router_z_loss_coef: float = 0.001

    def check(self) -> list[str]:
        """Problems with this config, as messages (empty when fine)."""
        problems = []
        for key in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff"):
            if getattr(self, key) < 1:
                problems.append(f"model.{key} must be positive, got {getattr(self, key)}")
        if self.n_kv_heads >= 1 and self.n_heads % self.n_kv_heads:
            problems.append(
                f"model.n_heads ({self.n_heads}) must be a multiple of model.n_kv_heads ({self.n_kv_heads})"
            )
        for key in ("init_std", "norm_eps", "rope_theta"):
            if not 0 < getattr(self, key) < float("inf"):  # NaN, 0 or negative can only give NaN
                problems.append(f"model.{key} must be a positive number, got {getattr(self, key)}")
        if self.scan_unroll < 1:
            problems.append(f"model.scan_unroll must be positive, got {self.scan_unroll}")
        if self.head_dim % 2:
            problems.append(f"model.head_dim must be even for RoPE, got {self.head_dim}")
        for key in ("dtype", "param_dtype"):
            if getattr(self, key) not in ("float32", "bfloat16", "float16"):
                problems.append(
                    f"model.{key} must be float32, bfloat16 or float16, got {getattr(self, key)!r}"
                )
        if self.rope_scaling not in ("none", "llama3"):
            problems.append(f"model.rope_scaling must be none or llama3, got {self.rope_scaling!r}")
        elif self.rope_scaling == "llama3" and not (
            self.rope_factor > 0
            and 0 < self.rope_low_freq_factor < self.rope_high_freq_factor
            and self.rope_original_max_position > 0
        ):
            problems.append(
                "model.rope_scaling = llama3 needs rope_factor > 0, 0 < rope_low_freq_factor < "
                "rope_high_freq_factor and rope_original_max_position > 0"
            )
        if self.remat not in REMAT_POLICIES:
            problems.append(f"model.remat must be one of {', '.join(REMAT_POLICIES)}, got {self.remat!r}")
        if self.n_experts < 0 or self.n_shared_experts < 0 or self.d_ff_expert < 0:
            problems.append("model.n_experts, model.n_shared_experts and model.d_ff_expert must be >= 0")
        if self.n_experts:
            if not 1 <= self.top_k <= self.n_experts:
                problems.append(
                    f"model.top_k ({self.top_k}) must be between 1 and model.n_experts ({self.n_experts})"
                )
            if self.moe_every < 1 or self.n_layers % self.moe_every:
                problems.append(
                    f"model.n_layers ({self.n_layers}) must be a multiple of model.moe_every "
                    f"({self.moe_every})"
                )
            if self.router_score not in ("softmax", "sigmoid"):
                problems.append(f"model.router_score must be softmax or sigmoid, got {self.router_score!r}")
            if self.moe_dispatch not in ("capacity", "dropless"):
                problems.append(f"model.moe_dispatch must be capacity or dropless, got {self.moe_dispatch!r}")
            if self.capacity_factor <= 0:
                problems.append(f"model.capacity_factor must be positive, got {self.capacity_factor}")
        if self.attention_impl not in attention.CHOICES:
            problems.append(
                f"model.attention_impl must be one of {', '.join(attention.CHOICES)}, got {self.attention_impl!r}"
            )
        return problems


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        D, N, K, H = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq_DNH = param(rngs, cfg, (D, N, H), ("embed", "heads", "head_dim"))
        self.wk_DKH = param(rngs, cfg, (D, K, H), ("embed", "kv_heads", "head_dim"))
        self.wv_DKH = param(rngs, cfg, (D, K, H), ("embed", "kv_heads", "head_dim"))
        # Output projection scaled down with depth (GPT-2 style) so the residual stays O(1).
        self.wo_NHD = param(
            rngs, cfg, (N, H, D), ("heads", "head_dim", "embed"), std=cfg.init_std / (2 * cfg.n_layers) ** 0.5
        )
        if cfg.qkv_bias:
            dtype = jnp.dtype(cfg.param_dtype)
            self.bq_NH, self.bk_KH, self.bv_KH = (
                nnx.Param(jnp.zeros(shape, dtype), out_sharding=axes, weight_decay=False)
                for shape, axes in (
                    ((N, H), ("heads", "head_dim")),
                    ((K, H), ("kv_heads", "head_dim")),
                    ((K, H), ("kv_heads", "head_dim")),
                )
            )

    def __call__(self, x_BTD, positions_BT, kv=None, segment_ids_BT=None, order_BT=None):
        """kv: None (training: causal over this sequence), or (k_BKSH, v_BKSH, positions_BS, index)
        of a cache: the new keys and values are written at `index` and attended with the cache.
        segment_ids_BT (training): packed documents; a token attends only within its own segment,
        and positions_BT (RoPE) restart at each document, so order_BT gives each token's index in
        the sequence for masks that compare positions (context parallelism)."""
        dt = x_BTD.dtype
        q_BTNH = project(x_BTD, self.wq_DNH[...])  # BTD,DNH->BTNH
        k_BTKH = project(x_BTD, self.wk_DKH[...])  # BTD,DKH->BTKH
        v_BTKH = project(x_BTD, self.wv_DKH[...])  # BTD,DKH->BTKH
        if self.cfg.qkv_bias:
            q_BTNH = q_BTNH + self.bq_NH[...].astype(dt)[None, None]
            k_BTKH = k_BTKH + self.bk_KH[...].astype(dt)[None, None]
            v_BTKH = v_BTKH + self.bv_KH[...].astype(dt)[None, None]
        freq_h = rope_frequencies(self.cfg)
        q_BTNH = rope(q_BTNH, positions_BT, freq_h)
        k_BTKH = rope(k_BTKH, positions_BT, freq_h)
        if kv is None:
            impl = attention.resolve(self.cfg.attention_impl, q_BTNH.shape[1])
            out_BTNH = attention.attend(
                q_BTNH, k_BTKH, v_BTKH, positions_BT if order_BT is None else order_BT, impl, segment_ids_BT
            )
            new_kv = None
        else:
            k_BKSH, v_BKSH, positions_BS, index = kv
            k_BKSH = jax.lax.dynamic_update_slice_in_dim(
                k_BKSH, k_BTKH.swapaxes(1, 2).astype(k_BKSH.dtype), index, 2
            )
            v_BKSH = jax.lax.dynamic_update_slice_in_dim(
                v_BKSH, v_BTKH.swapaxes(1, 2).astype(v_BKSH.dtype), index, 2
            )
            # The updated caches made once, in place: else XLA fuses the cheap update into the
            # attention's read as well and copies the whole cache for the second one.
            k_BKSH, v_BKSH = jax.lax.optimization_barrier((k_BKSH, v_BKSH))
            out_BTNH = attention.xla_attention(
                q_BTNH,
                k_BKSH.swapaxes(1, 2).astype(dt),  # (B, S, K, H) views: XLA folds the transposes
                v_BKSH.swapaxes(1, 2).astype(dt),
                q_positions_BT=positions_BT,
                k_positions_BS=positions_BS,
            )
            new_kv = (k_BKSH, v_BKSH)
        return project(out_BTNH, self.wo_NHD[...], n_in=2), new_kv  # BTNH,NHD->BTD


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, moe: bool = False):
        self.attn_norm = RMSNorm(cfg, rngs=rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg, rngs=rngs)
        self.moe = moe
        self.mlp = MoE(cfg, rngs=rngs) if moe else MLP(cfg, rngs=rngs)

    def __call__(self, x_BTD, positions_BT, kv=None, segment_ids_BT=None, order_BT=None):
        """(output, new kv or None, MoEStats or None)."""
        attn_BTD, new_kv = self.attn(self.attn_norm(x_BTD), positions_BT, kv, segment_ids_BT, order_BT)
        x_BTD = constrain(x_BTD + attn_BTD, RESIDUAL_AXES)
        if self.moe:
            mlp_BTD, stats = self.mlp(self.mlp_norm(x_BTD))
        else:
            mlp_BTD, stats = self.mlp(self.mlp_norm(x_BTD)), None
        return x_BTD + mlp_BTD, new_kv, stats


def layer_groups(cfg: ModelConfig) -> tuple[int, int, bool]:
    """(groups, dense layers per group, whether a group ends in an MoE layer). The layer scan runs
    over groups: a dense model is L groups of one dense layer; an MoE model with moe_every = m is
    L/m groups of m-1 dense layers and one MoE layer."""
    if not cfg.n_experts:
        return cfg.n_layers, 1, False
    return cfg.n_layers // cfg.moe_every, cfg.moe_every - 1, True


class Decoder(nnx.Module):
    ACTIVATION_AXES = {
        "activation residual_BTD": RESIDUAL_AXES,
        "activation logits_BTV": LOGITS_AXES,
        "kv cache": KV_CACHE_AXES,
        "moe dispatched_BECD": DISPATCHED_AXES,
    }

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        # Untied, the embedding starts at unit scale (the residual stream is O(1) from the start).
        # Tied, the same table is the output head, whose logits x.e over a normalised x of norm
        # sqrt(D) must start small (loss ln V): it takes the matmul scale init_std, as Llama does.
        embed_std = cfg.init_std if cfg.tie_embeddings else 1.0
        # The lookup reads the parameter dtype (cast after): its gradient is a scatter-add in that dtype.
        self.embed_VD = param(
            rngs, cfg, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), std=embed_std, compute_cast=False
        )
        groups, dense_per_group, has_moe = layer_groups(cfg)

        def stack(n, moe):
            @nnx.split_rngs(splits=n)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
            def stacked_blocks(rngs):
                return Block(cfg, rngs=rngs, moe=moe)

            return stacked_blocks(rngs)

        if dense_per_group:
            self.layers = stack(groups * dense_per_group, False)
        if has_moe:
            self.moe_layers = stack(groups, True)
        self.final_norm = RMSNorm(cfg, rngs=rngs)
        if not cfg.tie_embeddings:
            self.head_DV = param(rngs, cfg, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"))

    def __call__(self, tokens_BT, positions_BT=None, cache: KVCache | None = None):
        """Logits for every position; with a cache, also the updated cache (see KVCache)."""
        logits_BTV, cache, _ = self.forward(tokens_BT, positions_BT, cache)
        return logits_BTV if cache is None else (logits_BTV, cache)

    def forward(
        self, tokens_BT, positions_BT=None, cache: KVCache | None = None, segment_ids_BT=None, order_BT=None
    ):
        """(logits, updated cache or None, MoEStats stacked over MoE layers or None).
        segment_ids_BT, order_BT: packed documents (training); see Attention."""
        cfg, dt = self.cfg, jnp.dtype(self.cfg.dtype)
        x_BTD = constrain(jnp.take(self.embed_VD[...], tokens_BT, axis=0).astype(dt), RESIDUAL_AXES)
        if positions_BT is None:
            positions_BT = jnp.broadcast_to(jnp.arange(tokens_BT.shape[1]), tokens_BT.shape)
        groups, dense_per_group, has_moe = layer_groups(cfg)
        per_group = dense_per_group + has_moe

        # Scan inputs, one row per group: the dense layers' state (groups, dense_per_group, ...),
        # the MoE layer's state, and (decoding) the group's index into the caches.
        # stack_axes: each leaf's logical axes, in leaf order (a group's dense rows get a dimension).
        xs, graphdefs, stack_axes = {}, {}, {}
        if dense_per_group:
            graphdefs["dense"], state = nnx.split(self.layers)
            xs["dense"] = jax.tree.map(lambda a: a.reshape(groups, dense_per_group, *a.shape[1:]), state)
            stack_axes["dense"] = _logical_axes(state, lambda axes: (axes[0], None, *axes[1:]))
        if has_moe:
            graphdefs["moe"], xs["moe"] = nnx.split(self.moe_layers)
            stack_axes["moe"] = _logical_axes(xs["moe"], lambda axes: axes)
        kv_LG = None  # the caches as (groups, per_group, B, K, S, H), the scan's carry
        # A cache given as one array per layer (KVCache.empty(per_layer=True)) is kept so: the
        # layers run as a Python loop (a fully unrolled scan), each writing its own array in place.
        per_layer = cache is not None and isinstance(cache.k_LBKSH, tuple)
        if cache is not None:
            positions_BS = jax.lax.dynamic_update_slice_in_dim(
                cache.positions_BS, positions_BT, cache.index, axis=1
            )
            # The caches ride in the scan's carry, each layer's new slots written in place: as the
            # scan's inputs and outputs every token would copy them whole and zero the outputs
            # first (decoding `small` at batch 16: docs/performance.md, issue 19).
            kv_LG = (
                (cache.k_LBKSH, cache.v_LBKSH)
                if per_layer
                else tuple(c.reshape(groups, per_group, *c.shape[1:]) for c in (cache.k_LBKSH, cache.v_LBKSH))
            )
            xs["group"] = np.arange(groups) if per_layer else jnp.arange(groups)

        def group(carry, xs, side):
            x_BTD, kv_LG = carry
            positions_BT, segment_ids_BT, order_BT = side
            stats = None
            for i in range(per_group):
                moe = i == dense_per_group
                block = (
                    nnx.merge(graphdefs["moe"], xs["moe"])
                    if moe
                    else nnx.merge(graphdefs["dense"], jax.tree.map(lambda a: a[i], xs["dense"]))
                )
                kv = None
                if per_layer:
                    layer = int(xs["group"]) * per_group + i
                    kv = (kv_LG[0][layer], kv_LG[1][layer], positions_BS, cache.index)
                elif kv_LG is not None:
                    start = (xs["group"], i, 0, 0, 0, 0)
                    k_BKSH, v_BKSH = (
                        jax.lax.dynamic_slice(c, start, (1, 1, *c.shape[2:]))[0, 0] for c in kv_LG
                    )
                    kv = (k_BKSH, v_BKSH, positions_BS, cache.index)
                x_BTD, layer_kv, layer_stats = block(x_BTD, positions_BT, kv, segment_ids_BT, order_BT)
                x_BTD = constrain(x_BTD, RESIDUAL_AXES)
                stats = layer_stats if moe else stats
                if per_layer:
                    kv_LG = tuple(
                        c[:layer] + (new,) + c[layer + 1 :] for c, new in zip(kv_LG, layer_kv, strict=True)
                    )
                elif kv_LG is not None:
                    # Only the T new slots go back into the carry.
                    T, at = x_BTD.shape[1], (xs["group"], i, 0, 0, cache.index, 0)
                    kv_LG = tuple(
                        jax.lax.dynamic_update_slice(
                            c, jax.lax.dynamic_slice_in_dim(new, cache.index, T, axis=2)[None, None], at
                        )
                        for c, new in zip(kv_LG, layer_kv, strict=True)
                    )
            return (x_BTD, kv_LG), stats

        if cfg.remat != "none" and cache is None:
            group = jax.checkpoint(group, policy=REMAT_POLICIES[cfg.remat], prevent_cse=False)

        def run_groups(x_BTD, kv_LG, xs, side):
            """The groups stacked in `xs` applied in order: ((x, caches), stats stacked)."""
            n = jax.tree.leaves(xs)[0].shape[0]
            if per_layer:
                carry, stats = (x_BTD, kv_LG), []
                for g in range(n):
                    carry, group_stats = group(carry, jax.tree.map(lambda a: a[g], xs), side)
                    stats.append(group_stats)
                return carry, None if stats[0] is None else jax.tree.map(lambda *s: jnp.stack(s), *stats)
            return jax.lax.scan(
                lambda carry, row: group(carry, row, side), (x_BTD, kv_LG), xs, unroll=min(cfg.scan_unroll, n)
            )

        def stage_groups(x_BTD, xs, side):
            (x_BTD, _), stats = run_groups(x_BTD, None, xs, side)
            return x_BTD, stats

        side = (positions_BT, segment_ids_BT, order_BT)
        if cache is None and is_split("layers"):
            # The layer stack is split over pipeline stages (spmd/pipeline.py).
            x_BTD, stats = provided("pipeline")(
                stage_groups,
                x_BTD,
                xs,
                side,
                x_axes=RESIDUAL_AXES,
                xs_axes=[axes for key in sorted(xs) for axes in stack_axes[key]],
                combine_stats=MoEStats.of_microbatches,
            )
        else:
            (x_BTD, kv_LG), stats = run_groups(x_BTD, kv_LG, xs, side)
        if per_layer:
            k_LBKSH, v_LBKSH = (tuple(constrain(c, KV_CACHE_AXES[1:]) for c in cs) for cs in kv_LG)
            cache = KVCache(k_LBKSH, v_LBKSH, positions_BS, cache.index + tokens_BT.shape[1])
        elif cache is not None:
            k_LBKSH, v_LBKSH = (c.reshape(cfg.n_layers, *c.shape[2:]) for c in kv_LG)
            cache = KVCache(
                constrain(k_LBKSH, KV_CACHE_AXES),
                constrain(v_LBKSH, KV_CACHE_AXES),
                positions_BS,
                cache.index + tokens_BT.shape[1],
            )

        x_BTD = self.final_norm(x_BTD)
        if cfg.tie_embeddings:
            logits_BTV = jnp.einsum("BTD,VD->BTV", x_BTD, self.embed_VD[...].astype(dt))
        else:
            logits_BTV = project(x_BTD, self.head_DV[...])  # BTD,DV->BTV
        return constrain(logits_BTV, LOGITS_AXES), cache, stats


def _logical_axes(state, f) -> list[tuple]:
    """Each variable's logical axes (its `out_sharding` metadata) through `f`, in the order of
    jax.tree.leaves(state)."""
    variables = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return [f(tuple(v.get_metadata().get("out_sharding") or ())) for v in variables]


def count_params(cfg: ModelConfig, include_embedding: bool = True, active: bool = False) -> int:
    """Parameters; `active`: those one token uses (k routed experts of an MoE layer, not all E)."""
    D, N, K, H, F, V = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff, cfg.vocab_size
    attn = D * N * H * 2 + D * K * H * 2 + 2 * D + ((N + 2 * K) * H if cfg.qkv_bias else 0)
    groups, dense_per_group, has_moe = layer_groups(cfg)
    n = groups * dense_per_group * (attn + 3 * D * F)
    if has_moe:
        Fe = cfg.d_ff_expert or F
        experts = cfg.top_k if active else cfg.n_experts
        n += groups * (attn + D * cfg.n_experts + 3 * D * Fe * (experts + cfg.n_shared_experts))
    n += D + (0 if cfg.tie_embeddings else D * V)
    return n + (V * D if include_embedding else 0)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 x active matmul params, plus attention (causal: half the scores).

    The embedding lookup is a gather, not a matmul, so its parameters are not counted (a tied
    table is counted once, as the output head). MoE layers count the k experts a token uses.
    """
    matmul_params = count_params(cfg, include_embedding=False, active=True) + (
        cfg.vocab_size * cfg.d_model if cfg.tie_embeddings else 0
    )
    # QK^T and PV: 2 matmuls x 2 FLOPs x T x N*H per token forward, x3 for forward+backward, /2 causal.
    attention = 3 * 2 * 2 * seq_len * cfg.n_heads * cfg.head_dim * cfg.n_layers / 2
    return 6 * matmul_params + attention
