"""Llama-style decoder: embedding, RMSNorm, RoPE, grouped-query attention, SwiGLU, output head.

Legend: B batch, T sequence, D embed (d_model), N query heads, K kv heads, H head dim,
F mlp hidden, V vocab, L layers.

Every parameter carries logical axis names in its `out_sharding` metadata; the mapping to mesh
axes lives in `sharding_rules/`. Layers are created stacked (a leading `layers` axis) and applied
with `jax.lax.scan`, so compile time does not grow with depth.
"""

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from models import attention
from spmd.logical import can_merge, constrain

REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    # Matmuls without batch axes: the projections (flattened to 2-D by `project`), not the
    # attention scores, which are batched over (B, K) and would cost O(T^2) to keep.
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}

# The only activations we constrain: the residual stream and the logits. Everything else the
# partitioner infers from the parameters. The residual's sequence axis has its own name, `act_seq`,
# so rules can split it where attention and MLP internals are not (Megatron sequence parallelism).
RESIDUAL_AXES = ("batch", "act_seq", "act_embed")
LOGITS_AXES = ("batch", "seq", "act_vocab")
KV_CACHE_AXES = ("layers", "batch", "seq", "act_kv_heads", "head_dim")


class KVCache(NamedTuple):
    """Keys and values of every layer for S slots, and the position of the token in each slot
    (-1: empty or padding). Decoding writes T new slots at `index`."""

    k_LBSKH: jax.Array
    v_LBSKH: jax.Array
    positions_BS: jax.Array
    index: jax.Array  # scalar int32: the next slot to write

    @classmethod
    def empty(cls, cfg: "ModelConfig", batch: int, slots: int) -> "KVCache":
        shape = (cfg.n_layers, batch, slots, cfg.n_kv_heads, cfg.head_dim)
        zeros = jnp.zeros(shape, jnp.dtype(cfg.dtype))
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
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    dtype: str = "bfloat16"  # compute dtype
    param_dtype: str = "float32"  # parameters and optimizer state
    remat: str = "none"  # none | full | save_dots
    scan_unroll: int = 1  # layers per scan iteration (n_layers: fully unrolled; faster, longer compile)
    attention_impl: str = "xla"
    init_std: float = 0.02

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
        if self.scan_unroll < 1:
            problems.append(f"model.scan_unroll must be positive, got {self.scan_unroll}")
        if self.head_dim % 2:
            problems.append(f"model.head_dim must be even for RoPE, got {self.head_dim}")
        for key in ("dtype", "param_dtype"):
            if getattr(self, key) not in ("float32", "bfloat16", "float16"):
                problems.append(f"model.{key} must be float32, bfloat16 or float16, got {getattr(self, key)!r}")
        if self.remat not in REMAT_POLICIES:
            problems.append(f"model.remat must be one of {', '.join(REMAT_POLICIES)}, got {self.remat!r}")
        if self.attention_impl not in attention.CHOICES:
            problems.append(
                f"model.attention_impl must be one of {', '.join(attention.CHOICES)}, got {self.attention_impl!r}"
            )
        return problems


def project(x, w, n_in: int = 1, lead_axes=("batch", "seq")):
    """Contract the last `n_in` axes of x with the first `n_in` axes of w, as one 2-D matmul.

    Same math as the einsum in each caller's comment. XLA:CPU runs the backward of a dot with two
    contracting axes (e.g. BTD,BTF->DF) far slower than the same dot on flattened operands: the
    `small` MLP's backward took 1.5x longer, so we flatten. On GPU/TPU this is free either way.
    When the sequence is split over devices (context parallelism) flattening (B, T) would scatter
    each device's tokens across the merged axis, so the dot keeps the leading axes instead.
    """
    lead, out = x.shape[: x.ndim - n_in], w.shape[n_in:]
    if not can_merge(lead_axes):
        return jax.lax.dot_general(x, w, ((tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in))), ((), ())))
    y = x.reshape(math.prod(lead), -1) @ w.reshape(math.prod(w.shape[:n_in]), -1)
    return y.reshape(*lead, *out)


def _param(rngs, cfg, shape, logical, std=None):
    init = nnx.initializers.normal(cfg.init_std if std is None else std)
    return nnx.Param(init(rngs.params(), shape, jnp.dtype(cfg.param_dtype)), out_sharding=logical)


class RMSNorm(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.eps = cfg.norm_eps
        self.scale_D = nnx.Param(jnp.ones((cfg.d_model,), jnp.dtype(cfg.param_dtype)), out_sharding=("norm",))

    def __call__(self, x_BTD):
        x = x_BTD.astype(jnp.float32)
        y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        scale = self.scale_D[...].astype(jnp.float32).reshape((1,) * (x.ndim - 1) + (-1,))
        return (y * scale).astype(x_BTD.dtype)


def rope(x_BTNH, positions_BT, theta: float):
    """Rotary embedding, computed in fp32; pairs dimension i with i + H/2 (Llama layout)."""
    half = x_BTNH.shape[-1] // 2
    freq_h = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle_BTh = positions_BT[..., None].astype(jnp.float32) * freq_h[None, None, :]
    cos, sin = jnp.cos(angle_BTh)[:, :, None, :], jnp.sin(angle_BTh)[:, :, None, :]
    x1, x2 = jnp.split(x_BTNH.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_BTNH.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        D, N, K, H = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq_DNH = _param(rngs, cfg, (D, N, H), ("embed", "heads", "head_dim"))
        self.wk_DKH = _param(rngs, cfg, (D, K, H), ("embed", "kv_heads", "head_dim"))
        self.wv_DKH = _param(rngs, cfg, (D, K, H), ("embed", "kv_heads", "head_dim"))
        # Output projection scaled down with depth (GPT-2 style) so the residual stays O(1).
        self.wo_NHD = _param(rngs, cfg, (N, H, D), ("heads", "head_dim", "embed"),
                             std=cfg.init_std / (2 * cfg.n_layers) ** 0.5)

    def __call__(self, x_BTD, positions_BT, kv=None):
        """kv: None (training: causal over this sequence), or (k_BSKH, v_BSKH, positions_BS, index)
        of a cache: the new keys and values are written at `index` and attended with the cache."""
        dt = x_BTD.dtype
        q_BTNH = project(x_BTD, self.wq_DNH[...].astype(dt))  # BTD,DNH->BTNH
        k_BTKH = project(x_BTD, self.wk_DKH[...].astype(dt))  # BTD,DKH->BTKH
        v_BTKH = project(x_BTD, self.wv_DKH[...].astype(dt))  # BTD,DKH->BTKH
        q_BTNH = rope(q_BTNH, positions_BT, self.cfg.rope_theta)
        k_BTKH = rope(k_BTKH, positions_BT, self.cfg.rope_theta)
        if kv is None:
            impl = attention.resolve(self.cfg.attention_impl, q_BTNH.shape[1])
            out_BTNH = attention.attend(q_BTNH, k_BTKH, v_BTKH, positions_BT, impl)
            new_kv = None
        else:
            k_BSKH, v_BSKH, positions_BS, index = kv
            k_BSKH = jax.lax.dynamic_update_slice_in_dim(k_BSKH, k_BTKH.astype(k_BSKH.dtype), index, axis=1)
            v_BSKH = jax.lax.dynamic_update_slice_in_dim(v_BSKH, v_BTKH.astype(v_BSKH.dtype), index, axis=1)
            out_BTNH = attention.xla_attention(q_BTNH, k_BSKH.astype(dt), v_BSKH.astype(dt),
                                     q_positions_BT=positions_BT, k_positions_BS=positions_BS)
            new_kv = (k_BSKH, v_BSKH)
        return project(out_BTNH, self.wo_NHD[...].astype(dt), n_in=2), new_kv  # BTNH,NHD->BTD


class MLP(nnx.Module):
    """SwiGLU: down(silu(x W_gate) * (x W_up))."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        D, F = cfg.d_model, cfg.d_ff
        self.w_gate_DF = _param(rngs, cfg, (D, F), ("embed", "mlp"))
        self.w_up_DF = _param(rngs, cfg, (D, F), ("embed", "mlp"))
        self.w_down_FD = _param(rngs, cfg, (F, D), ("mlp", "embed"), std=cfg.init_std / (2 * cfg.n_layers) ** 0.5)

    def __call__(self, x_BTD):
        dt = x_BTD.dtype
        gate_BTF = project(x_BTD, self.w_gate_DF[...].astype(dt))  # BTD,DF->BTF
        up_BTF = project(x_BTD, self.w_up_DF[...].astype(dt))  # BTD,DF->BTF
        return project(jax.nn.silu(gate_BTF) * up_BTF, self.w_down_FD[...].astype(dt))  # BTF,FD->BTD


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg, rngs=rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg, rngs=rngs)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x_BTD, positions_BT, kv=None):
        attn_BTD, new_kv = self.attn(self.attn_norm(x_BTD), positions_BT, kv)
        x_BTD = constrain(x_BTD + attn_BTD, RESIDUAL_AXES)
        return x_BTD + self.mlp(self.mlp_norm(x_BTD)), new_kv


class Decoder(nnx.Module):
    ACTIVATION_AXES = {"activation residual_BTD": RESIDUAL_AXES, "activation logits_BTV": LOGITS_AXES,
                       "kv cache": KV_CACHE_AXES}

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed_VD = _param(rngs, cfg, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), std=1.0)

        @nnx.split_rngs(splits=cfg.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def stacked_blocks(rngs):
            return Block(cfg, rngs=rngs)

        self.layers = stacked_blocks(rngs)
        self.final_norm = RMSNorm(cfg, rngs=rngs)
        if not cfg.tie_embeddings:
            self.head_DV = _param(rngs, cfg, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"))

    def __call__(self, tokens_BT, positions_BT=None, cache: KVCache | None = None):
        """Logits for every position; with a cache, also the updated cache (see KVCache)."""
        cfg, dt = self.cfg, jnp.dtype(self.cfg.dtype)
        x_BTD = constrain(jnp.take(self.embed_VD[...], tokens_BT, axis=0).astype(dt), RESIDUAL_AXES)
        if positions_BT is None:
            positions_BT = jnp.broadcast_to(jnp.arange(tokens_BT.shape[1]), tokens_BT.shape)

        graphdef, layer_state = nnx.split(self.layers)

        if cache is None:
            def layer(x_BTD, one_layer_state):
                x_BTD, _ = nnx.merge(graphdef, one_layer_state)(x_BTD, positions_BT)
                return constrain(x_BTD, RESIDUAL_AXES), None

            if cfg.remat != "none":
                layer = jax.checkpoint(layer, policy=REMAT_POLICIES[cfg.remat], prevent_cse=False)
            x_BTD, _ = jax.lax.scan(layer, x_BTD, layer_state, unroll=min(cfg.scan_unroll, cfg.n_layers))
        else:
            positions_BS = jax.lax.dynamic_update_slice_in_dim(cache.positions_BS, positions_BT, cache.index, axis=1)

            def layer(x_BTD, xs):
                one_layer_state, k_BSKH, v_BSKH = xs
                kv = (k_BSKH, v_BSKH, positions_BS, cache.index)
                x_BTD, (k_BSKH, v_BSKH) = nnx.merge(graphdef, one_layer_state)(x_BTD, positions_BT, kv)
                return constrain(x_BTD, RESIDUAL_AXES), (k_BSKH, v_BSKH)

            x_BTD, (k_LBSKH, v_LBSKH) = jax.lax.scan(layer, x_BTD, (layer_state, cache.k_LBSKH, cache.v_LBSKH))
            cache = KVCache(constrain(k_LBSKH, KV_CACHE_AXES), constrain(v_LBSKH, KV_CACHE_AXES), positions_BS,
                            cache.index + tokens_BT.shape[1])

        x_BTD = self.final_norm(x_BTD)
        if cfg.tie_embeddings:
            logits_BTV = jnp.einsum("BTD,VD->BTV", x_BTD, self.embed_VD[...].astype(dt))
        else:
            logits_BTV = project(x_BTD, self.head_DV[...].astype(dt))  # BTD,DV->BTV
        logits_BTV = constrain(logits_BTV, LOGITS_AXES)
        return logits_BTV if cache is None else (logits_BTV, cache)


def count_params(cfg: ModelConfig, include_embedding: bool = True) -> int:
    D, N, K, H, F, V, L = (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff,
                           cfg.vocab_size, cfg.n_layers)
    per_layer = D * N * H * 2 + D * K * H * 2 + 3 * D * F + 2 * D
    n = L * per_layer + D + (0 if cfg.tie_embeddings else D * V)
    return n + (V * D if include_embedding else 0)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 x matmul params, plus attention (causal: half the score matrix).

    The embedding lookup is a gather, not a matmul, so its parameters are not counted (a tied
    table is counted once, as the output head).
    """
    matmul_params = count_params(cfg, include_embedding=False) + (cfg.vocab_size * cfg.d_model if cfg.tie_embeddings else 0)
    # QK^T and PV: 2 matmuls x 2 FLOPs x T x N*H per token forward, x3 for forward+backward, /2 causal.
    attention = 3 * 2 * 2 * seq_len * cfg.n_heads * cfg.head_dim * cfg.n_layers / 2
    return 6 * matmul_params + attention
