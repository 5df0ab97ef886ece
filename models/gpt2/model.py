"""GPT-2: learned positions, pre-LayerNorm blocks (LayerNorm with bias), multi-head attention with
biases, a GELU MLP with biases, the output head tied to the token embedding.

Legend: B batch, T sequence, P positions (the position table), D embed (d_model), N heads, H head
dim, F mlp hidden, V vocab, L layers.

Every parameter carries logical axis names; the position table's rows are `positions`, a name
this family adds (replicated unless a rules file maps it).
"""

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from spmd.core.family import Figures
from spmd.core.logical import constrain
from spmd.models import attention
from spmd.models.decoder import REMAT_POLICIES, RESIDUAL_AXES, Decoder, attention_flops_per_token
from spmd.models.layers import adapter, embed_rows, param, project

# The projections an adapter may adapt (spmd.core.family.adapter_of): weight attribute, contracted
# leading axes.
ADAPTER_TARGETS = {
    "q": ("wq_DNH", 1),
    "k": ("wk_DNH", 1),
    "v": ("wv_DNH", 1),
    "o": ("wo_NHD", 2),
    "up": ("w_fc_DF", 1),
    "down": ("w_proj_FD", 1),
}

DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class GPT2Config:
    family: ClassVar[str] = "gpt2"

    vocab_size: int = 256
    max_positions: int = 1024  # rows of the learned position table (HF n_positions)
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 256  # HF n_inner (4 x d_model when unset)
    norm_eps: float = 1e-5
    dtype: str = "bfloat16"  # compute dtype
    param_dtype: str = "float32"
    remat: str = "none"  # none | full | save_dots | offload_dots
    scan_unroll: int = 1
    attention_impl: str = "xla"
    init_std: float = 0.02

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def n_kv_heads(self) -> int:  # multi-head attention: a kv head per query head
        return self.n_heads

    def check(self) -> list[str]:
        problems = []
        for key in ("vocab_size", "max_positions", "d_model", "n_layers", "n_heads", "d_ff"):
            if getattr(self, key) < 1:
                problems.append(f"model.{key} must be positive, got {getattr(self, key)}")
        if self.n_heads >= 1 and self.d_model % self.n_heads:
            problems.append(
                f"model.d_model ({self.d_model}) must be a multiple of model.n_heads ({self.n_heads})"
            )
        for key in ("init_std", "norm_eps"):
            if not 0 < getattr(self, key) < float("inf"):
                problems.append(f"model.{key} must be a positive number, got {getattr(self, key)}")
        if self.scan_unroll < 1:
            problems.append(f"model.scan_unroll must be positive, got {self.scan_unroll}")
        for key in ("dtype", "param_dtype"):
            if getattr(self, key) not in DTYPES:
                problems.append(
                    f"model.{key} must be float32, bfloat16 or float16, got {getattr(self, key)!r}"
                )
        if self.remat not in REMAT_POLICIES:
            problems.append(f"model.remat must be one of {', '.join(REMAT_POLICIES)}, got {self.remat!r}")
        if self.attention_impl not in attention.CHOICES:
            problems.append(
                f"model.attention_impl must be one of {', '.join(attention.CHOICES)}, got {self.attention_impl!r}"
            )
        return problems


def bias(cfg, shape, logical) -> nnx.Param:
    """A bias, zero at the start and not decayed; added in the compute dtype."""
    return nnx.Param(jnp.zeros(shape, jnp.dtype(cfg.param_dtype)), out_sharding=logical, weight_decay=False)


class LayerNorm(nnx.Module):
    """LayerNorm with a scale and a bias over d_model, computed in float32."""

    def __init__(self, cfg: GPT2Config, *, rngs: nnx.Rngs):
        self.eps = cfg.norm_eps
        dtype = jnp.dtype(cfg.param_dtype)
        meta = dict(out_sharding=("norm",), weight_decay=False, compute_cast=False)
        self.scale_D = nnx.Param(jnp.ones((cfg.d_model,), dtype), **meta)
        self.bias_D = nnx.Param(jnp.zeros((cfg.d_model,), dtype), **meta)

    def __call__(self, x_BTD):
        x = x_BTD.astype(jnp.float32)
        mean = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
        y = (x - mean) * jax.lax.rsqrt(var + self.eps)
        lead = (1,) * (x.ndim - 1)
        scale, shift = (p[...].astype(jnp.float32).reshape(*lead, -1) for p in (self.scale_D, self.bias_D))
        return (y * scale + shift).astype(x_BTD.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: GPT2Config, *, rngs: nnx.Rngs):
        self.cfg = cfg
        D, N, H = cfg.d_model, cfg.n_heads, cfg.head_dim
        self.wq_DNH = param(rngs, cfg, (D, N, H), ("embed", "heads", "head_dim"))
        self.wk_DNH = param(rngs, cfg, (D, N, H), ("embed", "kv_heads", "head_dim"))
        self.wv_DNH = param(rngs, cfg, (D, N, H), ("embed", "kv_heads", "head_dim"))
        self.bq_NH = bias(cfg, (N, H), ("heads", "head_dim"))
        self.bk_NH = bias(cfg, (N, H), ("kv_heads", "head_dim"))
        self.bv_NH = bias(cfg, (N, H), ("kv_heads", "head_dim"))
        # GPT-2 scales the projections into the residual stream by 1/sqrt(2L).
        self.wo_NHD = param(
            rngs, cfg, (N, H, D), ("heads", "head_dim", "embed"), std=cfg.init_std / (2 * cfg.n_layers) ** 0.5
        )
        self.bo_D = bias(cfg, (D,), ("norm",))

    def __call__(self, x_BTD, positions_BT, kv=None, segment_ids_BT=None, order_BT=None):
        dt = x_BTD.dtype
        q_BTNH = (
            project(x_BTD, self.wq_DNH[...], adapter=adapter(self, "wq_DNH"))
            + self.bq_NH[...].astype(dt)[None, None]
        )  # BTD,DNH->BTNH
        k_BTNH = (
            project(x_BTD, self.wk_DNH[...], adapter=adapter(self, "wk_DNH"))
            + self.bk_NH[...].astype(dt)[None, None]
        )
        v_BTNH = (
            project(x_BTD, self.wv_DNH[...], adapter=adapter(self, "wv_DNH"))
            + self.bv_NH[...].astype(dt)[None, None]
        )
        out_BTNH, new_kv = attention.self_attention(
            q_BTNH, k_BTNH, v_BTNH, positions_BT, self.cfg.attention_impl, kv, segment_ids_BT, order_BT
        )
        out_BTD = project(
            out_BTNH, self.wo_NHD[...], n_in=2, adapter=adapter(self, "wo_NHD")
        )  # BTNH,NHD->BTD
        return out_BTD + self.bo_D[...].astype(dt)[None, None], new_kv


class MLP(nnx.Module):
    """gelu(x W_fc + b_fc) W_proj + b_proj, GELU in its tanh form (GPT-2's gelu_new)."""

    def __init__(self, cfg: GPT2Config, *, rngs: nnx.Rngs):
        D, F = cfg.d_model, cfg.d_ff
        self.w_fc_DF = param(rngs, cfg, (D, F), ("embed", "mlp"))
        self.b_fc_F = bias(cfg, (F,), ("mlp",))
        self.w_proj_FD = param(
            rngs, cfg, (F, D), ("mlp", "embed"), std=cfg.init_std / (2 * cfg.n_layers) ** 0.5
        )
        self.b_proj_D = bias(cfg, (D,), ("norm",))

    def __call__(self, x_BTD):
        dt = x_BTD.dtype
        h_BTF = (
            project(x_BTD, self.w_fc_DF[...], adapter=adapter(self, "w_fc_DF"))
            + self.b_fc_F[...].astype(dt)[None, None]
        )  # BTD,DF->BTF
        h_BTF = jax.nn.gelu(h_BTF.astype(jnp.float32), approximate=True).astype(dt)
        return (
            project(h_BTF, self.w_proj_FD[...], adapter=adapter(self, "w_proj_FD"))
            + self.b_proj_D[...].astype(dt)[None, None]
        )  # BTF,FD->BTD


class Block(nnx.Module):
    def __init__(self, cfg: GPT2Config, *, rngs: nnx.Rngs, moe: bool = False):
        self.ln_1 = LayerNorm(cfg, rngs=rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.ln_2 = LayerNorm(cfg, rngs=rngs)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x_BTD, positions_BT, kv=None, segment_ids_BT=None, order_BT=None):
        attn_BTD, new_kv = self.attn(self.ln_1(x_BTD), positions_BT, kv, segment_ids_BT, order_BT)
        x_BTD = constrain(x_BTD + attn_BTD, RESIDUAL_AXES)
        return x_BTD + self.mlp(self.ln_2(x_BTD)), new_kv, None


class GPT2(Decoder):
    BLOCK = Block

    def init_input(self, cfg: GPT2Config, rngs: nnx.Rngs) -> None:
        # The lookups read the parameter dtype, their sum cast after (GPT-2's own rounding): their
        # gradients are scatter-adds in it.
        self.wte_VD = param(rngs, cfg, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), compute_cast=False)
        self.wpe_PD = param(
            rngs, cfg, (cfg.max_positions, cfg.d_model), ("positions", "embed"), compute_cast=False
        )

    def init_output(self, cfg: GPT2Config, rngs: nnx.Rngs) -> None:
        self.ln_f = LayerNorm(cfg, rngs=rngs)

    def embed(self, tokens_BT, positions_BT):
        # Padding (decoding left-padded prompts) has negative positions: any row will do, it is masked.
        stored = self.wte_VD[...].dtype
        pos_BTD = embed_rows(self.wpe_PD[...], jnp.maximum(positions_BT, 0), stored, "positions")
        x_BTD = embed_rows(self.wte_VD[...], tokens_BT, stored) + pos_BTD
        return x_BTD.astype(jnp.dtype(self.cfg.dtype))

    def head(self, x_BTD):
        x_BTD = self.ln_f(x_BTD)
        return jnp.einsum("BTD,VD->BTV", x_BTD, self.wte_VD[...].astype(x_BTD.dtype))  # tied


def count_params(cfg: GPT2Config, include_embedding: bool = True) -> int:
    D, F, V, P = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.max_positions
    layer = 4 * D * D + 4 * D + 2 * D * F + F + D + 4 * D  # attention, MLP (with biases), two LayerNorms
    return cfg.n_layers * layer + 2 * D + (V * D + P * D if include_embedding else 0)


def figures(cfg: GPT2Config, seq_len: int) -> Figures:
    # The tied table is the output head's matmul; the position table is only read.
    matmul = count_params(cfg, include_embedding=False) + cfg.vocab_size * cfg.d_model
    return Figures(
        params=count_params(cfg),
        active_params=count_params(cfg),
        flops_per_token=6 * matmul + attention_flops_per_token(cfg, seq_len),
        d_model=cfg.d_model,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        n_kv_heads=cfg.n_heads,
        head_dim=cfg.head_dim,
        vocab_size=cfg.vocab_size,
        tie_embeddings=True,
        max_positions=cfg.max_positions,
    )
