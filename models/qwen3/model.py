"""Qwen3: the Llama decoder with an RMSNorm over each head's queries and keys (before RoPE), dense
or a mixture of experts ([moe]: Qwen3-MoE's softmax top-k routing, its weights renormalised when
`moe.normalize_top_k`, HF norm_topk_prob).

Legend: B batch, T sequence, D embed, N query heads, K kv heads, H head dim.
"""

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
from flax import nnx

from spmd.models.layers import rms_norm
from spmd.models.llama import model as llama


@dataclasses.dataclass(frozen=True)
class Qwen3Config(llama.LlamaConfig):
    family: ClassVar[str] = "qwen3"

    rope_theta: float = 1000000.0
    norm_eps: float = 1e-6


class HeadNorm(nnx.Module):
    """RMSNorm over each head's H dimensions (its scale shared by the heads)."""

    def __init__(self, cfg: Qwen3Config, *, rngs: nnx.Rngs):
        self.eps = cfg.norm_eps
        self.scale_H = nnx.Param(
            jnp.ones((cfg.head_dim,), jnp.dtype(cfg.param_dtype)),
            out_sharding=("head_dim",),
            weight_decay=False,
            compute_cast=False,  # applied in float32
        )

    def __call__(self, x_BTNH):
        return rms_norm(x_BTNH, self.scale_H[...], self.eps)


class Attention(llama.Attention):
    def __init__(self, cfg: Qwen3Config, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        self.q_norm = HeadNorm(cfg, rngs=rngs)
        self.k_norm = HeadNorm(cfg, rngs=rngs)

    def qkv(self, x_BTD):
        q_BTNH, k_BTKH, v_BTKH = super().qkv(x_BTD)
        return self.q_norm(q_BTNH), self.k_norm(k_BTKH), v_BTKH


class Block(llama.Block):
    ATTENTION = Attention


class Qwen3(llama.Llama):
    BLOCK = Block


def count_params(cfg: Qwen3Config, include_embedding: bool = True, active: bool = False) -> int:
    """Llama's count, plus each layer's two head-dimension norm scales."""
    return llama.count_params(cfg, include_embedding, active) + cfg.n_layers * 2 * cfg.head_dim


def figures(cfg: Qwen3Config, seq_len: int):
    return llama.figures(cfg, seq_len, count=count_params)
