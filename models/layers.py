"""Layers shared by the decoder and the mixture of experts: the flattened projection, parameters
with logical axes, RMSNorm, RoPE and the SwiGLU MLP.

Legend: B batch, T sequence, D embed (d_model), N query heads, H head dim, F mlp hidden.
`cfg` is a model family's config (spmd.core.family): d_model, d_ff, init_std, param_dtype, norm_eps, ... .
"""

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from spmd.core.family import adapter_of
from spmd.core.logical import TOKEN_AXES, can_merge, constrain, constrain_whole_over, lowering


def adapter(module, weight: str):
    """The adapter a model transform attached beside `module`'s parameter `weight` (a callable
    x -> its update of x's projection), or None: a model without adapters runs unchanged."""
    return adapter_of(module, weight)


def project(x, w, n_in: int = 1, lead_axes=("batch", "seq"), adapter=None):
    """Contract the last `n_in` axes of x with the first `n_in` axes of w (a parameter as stored,
    cast here to x's dtype, the compute dtype); plus `adapter(x)`, the update of an adapter a model
    transform attached (e.g. low-rank: x W + (alpha / r) x A B), if any.

    Same math as the einsum in each caller's comment. Where the run's Lowering says so (XLA:CPU,
    whose backward of a dot with two contracting axes, e.g. BTD,BTF->DF, is far slower than the same
    dot on flattened operands) it is one 2-D matmul; elsewhere the weight keeps its shape, so that
    FSDP gathers it once per use (a reshaped copy would be gathered again under recomputation).
    When the sequence is split over devices (context parallelism) flattening (B, T) would scatter
    each device's tokens across the merged axis, so the dot keeps the leading axes instead.
    """
    y = _contract(x, w, n_in, lead_axes)
    return y if adapter is None else y + adapter(x, n_in, lead_axes)


def _contract(x, w, n_in: int, lead_axes):
    lead, out = x.shape[: x.ndim - n_in], w.shape[n_in:]
    if lowering().float32_weight_grads and x.dtype != jnp.float32:
        return _contract_f32_grad(x, w, n_in)
    if not lowering().flatten_matmuls or not can_merge(lead_axes):
        return jax.lax.dot_general(x, w.astype(x.dtype), (_dims(x.ndim, n_in), ((), ())))
    x_MK, w_KN = x.reshape(math.prod(lead), -1), w.reshape(math.prod(w.shape[:n_in]), -1)
    # On CPU the backward's dots (x^T g contracts the tokens of both operands) go to oneDNN
    # (spmd/platform/cpu_matmul.py), which takes transposed operands as they are, in the compute dtype.
    return (x_MK @ w_KN.astype(x.dtype)).reshape(*lead, *out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _contract_f32_grad(x, w, n_in: int):
    """x's last n_in axes contracted with w's first n_in, in x's dtype; the weight's gradient leaves
    its matmul in float32 (accumulated there, and so reduced across devices in it) and is returned
    in w's dtype (train.grad_reduce_dtype = "float32")."""
    return jax.lax.dot_general(x, w.astype(x.dtype), (_dims(x.ndim, n_in), ((), ())))


def _dims(x_ndim: int, n_in: int):
    """The contracting dims of x (its last n_in) and of w (its first n_in)."""
    return tuple(range(x_ndim - n_in, x_ndim)), tuple(range(n_in))


def _contract_f32_grad_fwd(x, w, n_in):
    return _contract_f32_grad(x, w, n_in), (x, w)


def _contract_f32_grad_bwd(n_in, res, g):
    x, w = res
    lead = x.ndim - n_in
    n_out = w.ndim - n_in
    # dx: g contracted with w over the output axes; dw: x and g contracted over the lead axes.
    dx = jax.lax.dot_general(
        g, w.astype(x.dtype), ((tuple(range(lead, lead + n_out)), tuple(range(n_in, w.ndim))), ((), ()))
    )
    dw = jax.lax.dot_general(
        x, g, ((tuple(range(lead)), tuple(range(lead))), ((), ())), preferred_element_type=jnp.float32
    )
    return dx.astype(x.dtype), dw.astype(w.dtype)


_contract_f32_grad.defvjp(_contract_f32_grad_fwd, _contract_f32_grad_bwd)


def embed_rows(table_RD, ids_BT, dtype, rows: str = "vocab"):
    """table[ids] in `dtype` (the table cast to it first: its gradient leaves the lookup in that
    dtype, as every weight's leaves its matmul), moving looked-up rows, never the table.

    The table stays split as the rules split it. Where they split its embed dimension over batch
    axes too (FSDP), each device looks up the tokens of all the devices that share its columns (the
    ids gathered over those axes: 4 bytes a token), in its own columns, and the rows go to the
    residual stream's layout by an all-to-all; the gradient comes back the same way and is
    scatter-added into the device's own columns: no gather of the table, no reduction of its
    gradient over those axes. Rows split over an axis that does not carry the batch (Megatron's
    vocab-parallel embedding) are looked up where they live and summed over it."""
    ids_BT = constrain_whole_over(ids_BT, TOKEN_AXES, "embed")
    table_RD = constrain(table_RD, (rows, "embed"))
    if lowering().float32_weight_grads:  # looked up as stored, its gradient scatter-added in it
        rows_BTD = jnp.take(table_RD, ids_BT, axis=0).astype(dtype)
    else:
        rows_BTD = jnp.take(table_RD.astype(dtype), ids_BT, axis=0)
    return constrain_whole_over(rows_BTD, (*TOKEN_AXES, "embed"), "embed")


def param(rngs, cfg, shape, logical, std=None, compute_cast=True):
    """A parameter drawn from N(0, std) (default `cfg.init_std`) carrying its logical axes.

    `compute_cast`: whether the model casts it to the compute dtype where it uses it (then its
    gradient leaves the matmuls in that dtype, and is reduced across devices in it); declared for
    the communication bound in spmd/analysis/aot.py, which reads it as the optimizer reads weight_decay."""
    init = nnx.initializers.normal(cfg.init_std if std is None else std)
    value = init(rngs.params(), shape, jnp.dtype(cfg.param_dtype))
    return nnx.Param(value, out_sharding=logical, compute_cast=compute_cast)


class RMSNorm(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs):
        self.eps = cfg.norm_eps
        # Scales are not decayed towards 0 (that would shrink the normalised signal): the optimizer
        # reads this declared property, not the parameter's name.
        self.scale_D = nnx.Param(
            jnp.ones((cfg.d_model,), jnp.dtype(cfg.param_dtype)),
            out_sharding=("norm",),
            weight_decay=False,
            compute_cast=False,  # applied in float32 (below)
        )

    def __call__(self, x_BTD):
        return rms_norm(x_BTD, self.scale_D[...], self.eps)


def rms_norm(x, scale, eps: float):
    """x / rms(x) * scale over the last axis, computed in float32, returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * scale.astype(jnp.float32).reshape((1,) * (x.ndim - 1) + (-1,))).astype(x.dtype)


def rope_frequencies(cfg):
    """Rotation frequency of each of the head's H/2 dimension pairs (fp32): theta^(-i / (H/2)).

    `rope_scaling = "llama3"` (Llama 3.1+) stretches the long wavelengths by `rope_factor` and
    blends the middle band, as Meta's reference does: wavelengths above
    original_max_position / low_freq_factor are divided by the factor, those below
    original_max_position / high_freq_factor kept, and those between interpolated."""
    half = cfg.head_dim // 2
    freq_h = cfg.rope_theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    if cfg.rope_scaling == "llama3":
        factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        wavelen_h = 2 * math.pi / freq_h
        scaled_h = jnp.where(wavelen_h > cfg.rope_original_max_position / low, freq_h / factor, freq_h)
        smooth_h = (cfg.rope_original_max_position / wavelen_h - low) / (high - low)
        blended_h = (1 - smooth_h) * scaled_h / factor + smooth_h * scaled_h
        middle_h = (wavelen_h >= cfg.rope_original_max_position / high) & (
            wavelen_h <= cfg.rope_original_max_position / low
        )
        freq_h = jnp.where(middle_h, blended_h, scaled_h)
    return freq_h


def rope(x_BTNH, positions_BT, freq_h):
    """Rotary embedding, computed in fp32; pairs dimension i with i + H/2 (Llama layout).

    cos and sin are computed once per token and frequency, behind an optimization barrier: without
    it XLA:CPU fused them into every consumer and evaluated both once per head and half, in the
    forward and again in the backward. The backward rotates by the negated angle (rotate's
    transpose), with the same saved cos/sin, instead of autodiff's trigonometry.
    """
    angle_BTh = positions_BT[..., None].astype(jnp.float32) * freq_h[None, None, :]
    cos_BTh, sin_BTh = jax.lax.optimization_barrier((jnp.cos(angle_BTh), jnp.sin(angle_BTh)))
    return rotate(x_BTNH, cos_BTh[:, :, None, :], sin_BTh[:, :, None, :])


@jax.custom_vjp
def rotate(x_BTNH, cos, sin):
    """x's dimension pairs (i, i + H/2) rotated by the angles whose cos and sin are given (fp32,
    broadcast against x's halves); the result in x's dtype. Its gradient is the rotation back."""
    x1, x2 = jnp.split(x_BTNH.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_BTNH.dtype)


def _rotate_fwd(x_BTNH, cos, sin):
    return rotate(x_BTNH, cos, sin), (cos, sin)


def _rotate_bwd(res, dy_BTNH):
    cos, sin = res
    return rotate(dy_BTNH, cos, -sin), None, None  # the angles are not trained


rotate.defvjp(_rotate_fwd, _rotate_bwd)


def swiglu(gate, up):
    """silu(gate) * up. In low-precision compute, as _swiglu_low: in fp32 between one read of each
    input and one rounded write, with a backward of its own."""
    if gate.dtype == jnp.float32:
        return jax.nn.silu(gate) * up
    return _swiglu_low(gate, up)


@jax.custom_vjp
def _swiglu_low(gate, up):
    """silu(gate) * up for bf16 (or fp16) inputs, computed in fp32 and rounded once.

    Autodiff of the plain bf16 form runs silu's exp and division in bf16 (XLA:CPU rounds between
    the ops, and is slower at it than in fp32), keeps bf16 intermediates for the backward and
    writes them out in separate passes. This backward saves only the two inputs and recomputes the
    sigmoid in fp32. fp32 compute keeps the plain form (no faster this way)."""
    return (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(gate.dtype)


def _swiglu_low_fwd(gate, up):
    return _swiglu_low(gate, up), (gate, up)


def _swiglu_low_bwd(res, g):
    gate, up = res
    a, u, g32 = gate.astype(jnp.float32), up.astype(jnp.float32), g.astype(jnp.float32)
    s = jax.nn.sigmoid(a)
    d_up = g32 * a * s  # silu(a)
    d_gate = g32 * u * s * (1 + a * (1 - s))  # silu'(a) = s + a s (1 - s)
    return d_gate.astype(gate.dtype), d_up.astype(up.dtype)


_swiglu_low.defvjp(_swiglu_low_fwd, _swiglu_low_bwd)


class MLP(nnx.Module):
    """SwiGLU: down(silu(x W_gate) * (x W_up))."""

    def __init__(self, cfg, *, rngs: nnx.Rngs, d_ff: int | None = None):
        D, F = cfg.d_model, d_ff or cfg.d_ff
        self.w_gate_DF = param(rngs, cfg, (D, F), ("embed", "mlp"))
        self.w_up_DF = param(rngs, cfg, (D, F), ("embed", "mlp"))
        self.w_down_FD = param(
            rngs, cfg, (F, D), ("mlp", "embed"), std=cfg.init_std / (2 * cfg.n_layers) ** 0.5
        )

    def __call__(self, x_BTD):
        gate_BTF = project(x_BTD, self.w_gate_DF[...], adapter=adapter(self, "w_gate_DF"))  # BTD,DF->BTF
        up_BTF = project(x_BTD, self.w_up_DF[...], adapter=adapter(self, "w_up_DF"))  # BTD,DF->BTF
        h_BTF = swiglu(gate_BTF, up_BTF)
        return project(h_BTF, self.w_down_FD[...], adapter=adapter(self, "w_down_FD"))  # BTF,FD->BTD
