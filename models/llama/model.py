"""Llama-style decoder: embedding, RMSNorm, RoPE, grouped-query attention, SwiGLU (or a mixture of
SwiGLU experts), output head. Llama 2/3/3.1+, Mistral, Qwen2 (q/k/v biases) and Mixtral compute
this function.

Legend: B batch, T sequence, D embed (d_model), N query heads, K kv heads, H head dim,
F mlp hidden, V vocab, L layers.

Every parameter carries logical axis names in its `out_sharding` metadata; the mapping to mesh
axes lives in `sharding_rules/`.
"""

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
from flax import nnx

from spmd.core.family import Figures
from spmd.core.logical import constrain
from spmd.models import attention
from spmd.models.decoder import (
    REMAT_POLICIES,
    RESIDUAL_AXES,
    Decoder,
    attention_flops_per_token,
    layer_groups,
)
from spmd.models.layers import MLP, RMSNorm, adapter, embed_rows, param, project, rope, rope_frequencies
from spmd.models.moe import MoE, MoEConfig, capacity

DTYPES = ("float32", "bfloat16", "float16")
# The projections an adapter may adapt (spmd.core.family.adapter_of): weight attribute, contracted
# leading axes.
ADAPTER_TARGETS = {
    "q": ("wq_DNH", 1),
    "k": ("wk_DKH", 1),
    "v": ("wv_DKH", 1),
    "o": ("wo_NHD", 2),
    "gate": ("w_gate_DF", 1),
    "up": ("w_up_DF", 1),
    "down": ("w_down_FD", 1),
}


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    family: ClassVar[str] = "llama"

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
    moe: MoEConfig | None = None  # the [moe] table: a mixture of experts (models/moe.py); None: dense

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
            if getattr(self, key) not in DTYPES:
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
        if self.attention_impl not in attention.CHOICES:
            problems.append(
                f"model.attention_impl must be one of {', '.join(attention.CHOICES)}, got {self.attention_impl!r}"
            )
        if self.moe is not None:
            problems += self.moe.check(self.n_layers)
        return problems


class Attention(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
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

    def qkv(self, x_BTD):
        """The projections, with their biases: q_BTNH, k_BTKH, v_BTKH (before RoPE)."""
        dt = x_BTD.dtype
        q_BTNH = project(x_BTD, self.wq_DNH[...], adapter=adapter(self, "wq_DNH"))  # BTD,DNH->BTNH
        k_BTKH = project(x_BTD, self.wk_DKH[...], adapter=adapter(self, "wk_DKH"))  # BTD,DKH->BTKH
        v_BTKH = project(x_BTD, self.wv_DKH[...], adapter=adapter(self, "wv_DKH"))  # BTD,DKH->BTKH
        if self.cfg.qkv_bias:
            q_BTNH = q_BTNH + self.bq_NH[...].astype(dt)[None, None]
            k_BTKH = k_BTKH + self.bk_KH[...].astype(dt)[None, None]
            v_BTKH = v_BTKH + self.bv_KH[...].astype(dt)[None, None]
        return q_BTNH, k_BTKH, v_BTKH

    def __call__(self, x_BTD, positions_BT, kv=None, segment_ids_BT=None, order_BT=None):
        """(output, the updated cache's keys and values or None): see attention.self_attention."""
        q_BTNH, k_BTKH, v_BTKH = self.qkv(x_BTD)
        freq_h = rope_frequencies(self.cfg)
        q_BTNH = rope(q_BTNH, positions_BT, freq_h)
        k_BTKH = rope(k_BTKH, positions_BT, freq_h)
        out_BTNH, new_kv = attention.self_attention(
            q_BTNH, k_BTKH, v_BTKH, positions_BT, self.cfg.attention_impl, kv, segment_ids_BT, order_BT
        )
        out_BTD = project(
            out_BTNH, self.wo_NHD[...], n_in=2, adapter=adapter(self, "wo_NHD")
        )  # BTNH,NHD->BTD
        return out_BTD, new_kv


class Block(nnx.Module):
    ATTENTION = Attention

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs, moe: bool = False):
        self.attn_norm = RMSNorm(cfg, rngs=rngs)
        self.attn = self.ATTENTION(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg, rngs=rngs)
        self.moe = moe
        self.mlp = MoE(cfg, rngs=rngs) if moe else MLP(cfg, rngs=rngs)

    def __call__(self, x_BTD, positions_BT, kv=None, segment_ids_BT=None, order_BT=None):
        """(output, new kv or None, the MoE layer's Aux or None)."""
        attn_BTD, new_kv = self.attn(self.attn_norm(x_BTD), positions_BT, kv, segment_ids_BT, order_BT)
        x_BTD = constrain(x_BTD + attn_BTD, RESIDUAL_AXES)
        if self.moe:
            mlp_BTD, aux = self.mlp(self.mlp_norm(x_BTD))
        else:
            mlp_BTD, aux = self.mlp(self.mlp_norm(x_BTD)), None
        return x_BTD + mlp_BTD, new_kv, aux


class Llama(Decoder):
    BLOCK = Block

    def init_input(self, cfg: LlamaConfig, rngs: nnx.Rngs) -> None:
        # Untied, the embedding starts at unit scale (the residual stream is O(1) from the start).
        # Tied, the same table is the output head, whose logits x.e over a normalised x of norm
        # sqrt(D) must start small (loss ln V): it takes the matmul scale init_std, as Llama does.
        embed_std = cfg.init_std if cfg.tie_embeddings else 1.0
        self.embed_VD = param(rngs, cfg, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), std=embed_std)

    def init_output(self, cfg: LlamaConfig, rngs: nnx.Rngs) -> None:
        self.final_norm = RMSNorm(cfg, rngs=rngs)
        if not cfg.tie_embeddings:
            self.head_DV = param(rngs, cfg, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"))

    def embed(self, tokens_BT, positions_BT):
        return embed_rows(self.embed_VD[...], tokens_BT, jnp.dtype(self.cfg.dtype))

    def head(self, x_BTD):
        x_BTD = self.final_norm(x_BTD)
        if self.cfg.tie_embeddings:
            return jnp.einsum("BTD,VD->BTV", x_BTD, self.embed_VD[...].astype(x_BTD.dtype))
        return project(x_BTD, self.head_DV[...])  # BTD,DV->BTV


def attention_params(cfg: LlamaConfig) -> int:
    """One layer's attention and norm parameters (both norms)."""
    D, N, K, H = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    return D * N * H * 2 + D * K * H * 2 + 2 * D + ((N + 2 * K) * H if cfg.qkv_bias else 0)


def count_params(cfg: LlamaConfig, include_embedding: bool = True, active: bool = False) -> int:
    """Parameters; `active`: those one token uses (k routed experts of an MoE layer, not all E)."""
    D, F, V = cfg.d_model, cfg.d_ff, cfg.vocab_size
    attn = attention_params(cfg)
    groups, dense_per_group, has_moe = layer_groups(cfg)
    n = groups * dense_per_group * (attn + 3 * D * F)
    if has_moe:
        moe = cfg.moe
        Fe = moe.d_ff_expert or F
        experts = moe.top_k if active else moe.n_experts
        n += groups * (attn + D * moe.n_experts + 3 * D * Fe * (experts + moe.n_shared_experts))
    n += D + (0 if cfg.tie_embeddings else D * V)
    return n + (V * D if include_embedding else 0)


def flops_per_token(cfg: LlamaConfig, seq_len: int, count=count_params) -> float:
    """Training FLOPs per token: 6 x active matmul params, plus attention (causal: half the scores).

    The embedding lookup is a gather, not a matmul, so its parameters are not counted (a tied
    table is counted once, as the output head). MoE layers count the k experts a token uses.
    """
    matmul_params = count(cfg, include_embedding=False, active=True) + (
        cfg.vocab_size * cfg.d_model if cfg.tie_embeddings else 0
    )
    return 6 * matmul_params + attention_flops_per_token(cfg, seq_len)


def figures(cfg: LlamaConfig, seq_len: int, count=count_params) -> Figures:
    """The family's Figures (spmd.core.family); `count`: the parameter count (a family built on this
    one with more parameters per layer passes its own)."""
    moe = cfg.moe
    groups, _, has_moe = layer_groups(cfg)
    return Figures(
        params=count(cfg),
        active_params=count(cfg, active=True),
        flops_per_token=flops_per_token(cfg, seq_len, count),
        d_model=cfg.d_model,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        n_kv_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        vocab_size=cfg.vocab_size,
        tie_embeddings=cfg.tie_embeddings,
        n_experts=moe.n_experts if has_moe else 0,
        moe_layers=groups if has_moe else 0,
        expert_capacity=capacity(seq_len, moe.n_experts, moe.top_k, moe.capacity_factor) if has_moe else 0,
    )
