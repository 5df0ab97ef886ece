"""Chunked attention in plain JAX: online softmax over key chunks in a scan, memory O(T).

Legend as in flash_attention.py; C is the chunk length, n the number of chunks. Runs on every
backend (it is the CPU implementation for long sequences and the inner block op of ring attention
on CPU). The backward is a second scan that recomputes each chunk's probabilities from the saved
log-sum-exp, so neither pass holds a (T, S) matrix.
"""

import functools

import jax
import jax.numpy as jnp

from kernels.flash_attention import MASK_VALUE


def _chunks(x_BSKH, C):
    """(B, S, K, H) -> (n, B, C, K, H), padding S up to a multiple of C."""
    B, S = x_BSKH.shape[:2]
    pad = -S % C
    x_BSKH = jnp.pad(x_BSKH, [(0, 0), (0, pad)] + [(0, 0)] * (x_BSKH.ndim - 2))
    return x_BSKH.reshape(B, (S + pad) // C, C, *x_BSKH.shape[2:]).swapaxes(0, 1)


def _chunk_mask(c, C, T, S, causal, seg_BT, segc_BC):
    k_pos = c * C + jnp.arange(C)
    mask_BTC = jnp.broadcast_to((k_pos < S)[None, None, :], (1, T, C))
    if causal:
        mask_BTC = mask_BTC & (jnp.arange(T)[:, None] >= k_pos[None, :])[None]
    if seg_BT is not None:
        mask_BTC = mask_BTC & (seg_BT[:, :, None] == segc_BC[:, None, :])
    return mask_BTC[:, None, None]  # (B, 1, 1, T, C): broadcast over K, G


def traced_zero(x):
    """0 as int32, computed from `x`.

    The chunk index starts from this instead of a constant. When this attention runs inside a
    differentiated scan (the model's layers), JAX splits the forward into the part that depends
    only on constants and the rest, and saves the former's per-iteration values: with a constant
    index, every chunk's (T, C) mask was stacked up front, 1 GiB at T=8k: O(T^2) again.
    """
    return (jnp.sum(x[(0,) * x.ndim]) * 0).astype(jnp.int32)


def _forward(q, k, v, seg, causal, scale, C):
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    q_BKGTH = q.reshape(B, T, K, G, H).transpose(0, 2, 3, 1, 4)
    segc = None if seg is None else _chunks(seg, C)

    def step(carry, xs):
        acc_BKGTH, m_BKGT, l_BKGT, c = carry
        k_BCKH, v_BCKH, seg_BC = xs
        s_BKGTC = jnp.einsum("BKGTH,BCKH->BKGTC", q_BKGTH, k_BCKH, preferred_element_type=jnp.float32) * scale
        s_BKGTC = jnp.where(_chunk_mask(c, C, T, S, causal, seg, seg_BC), s_BKGTC, MASK_VALUE)
        m_new = jnp.maximum(m_BKGT, s_BKGTC.max(axis=-1))
        p_BKGTC = jnp.exp(s_BKGTC - m_new[..., None])
        correction = jnp.exp(m_BKGT - m_new)
        pv_BKGTH = jnp.einsum(
            "BKGTC,BCKH->BKGTH", p_BKGTC.astype(v_BCKH.dtype), v_BCKH, preferred_element_type=jnp.float32
        )
        return (
            correction[..., None] * acc_BKGTH + pv_BKGTH,
            m_new,
            correction * l_BKGT + p_BKGTC.sum(-1),
            c + 1,
        ), None

    init = (
        jnp.zeros((B, K, G, T, H), jnp.float32),
        jnp.full((B, K, G, T), MASK_VALUE, jnp.float32),
        jnp.zeros((B, K, G, T), jnp.float32),
        traced_zero(q),
    )
    (acc, m, l, _), _ = jax.lax.scan(step, init, (_chunks(k, C), _chunks(v, C), segc))
    out_BTNH = (acc / l[..., None]).transpose(0, 3, 1, 2, 4).reshape(B, T, N, H).astype(q.dtype)
    return out_BTNH, (m + jnp.log(l)).reshape(B, N, T)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _chunked(q, k, v, seg, causal, scale, C):
    return _forward(q, k, v, seg, causal, scale, C)


def _chunked_fwd(q, k, v, seg, causal, scale, C):
    out, lse = _forward(q, k, v, seg, causal, scale, C)
    return (out, lse), (q, k, v, seg, out, lse)


def _chunked_bwd(causal, scale, C, residuals, cotangents):
    q, k, v, seg, out, lse = residuals
    do, dlse = cotangents
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    to_groups = lambda x: x.reshape(B, T, K, G, H).transpose(0, 2, 3, 1, 4)  # noqa: E731  BTNH -> BKGTH
    q_BKGTH, do_BKGTH = to_groups(q), to_groups(do)
    lse_BKGT = lse.reshape(B, K, G, T)
    delta_BKGT = (
        jnp.einsum("BTNH,BTNH->BNT", do.astype(jnp.float32), out.astype(jnp.float32)) - dlse
    ).reshape(B, K, G, T)
    segc = None if seg is None else _chunks(seg, C)

    def step(carry, xs):
        dq_BKGTH, c = carry
        k_BCKH, v_BCKH, seg_BC = xs
        s_BKGTC = jnp.einsum("BKGTH,BCKH->BKGTC", q_BKGTH, k_BCKH, preferred_element_type=jnp.float32) * scale
        mask = _chunk_mask(c, C, T, S, causal, seg, seg_BC)
        p_BKGTC = jnp.where(mask, jnp.exp(s_BKGTC - lse_BKGT[..., None]), 0.0)
        dv_BCKH = jnp.einsum("BKGTC,BKGTH->BCKH", p_BKGTC, do_BKGTH.astype(jnp.float32))
        dp_BKGTC = jnp.einsum("BKGTH,BCKH->BKGTC", do_BKGTH, v_BCKH, preferred_element_type=jnp.float32)
        ds_BKGTC = p_BKGTC * (dp_BKGTC - delta_BKGT[..., None])
        dq_BKGTH = dq_BKGTH + jnp.einsum("BKGTC,BCKH->BKGTH", ds_BKGTC, k_BCKH.astype(jnp.float32))
        dk_BCKH = jnp.einsum("BKGTC,BKGTH->BCKH", ds_BKGTC, q_BKGTH.astype(jnp.float32)) * scale
        return (dq_BKGTH, c + 1), (dk_BCKH, dv_BCKH)

    n = -(-S // C)
    (dq, _), (dk_n, dv_n) = jax.lax.scan(
        step,
        (jnp.zeros((B, K, G, T, H), jnp.float32), jnp.zeros((), jnp.int32)),
        (_chunks(k, C), _chunks(v, C), segc),
    )
    unchunk = lambda x: x.swapaxes(0, 1).reshape(B, n * C, K, H)[:, :S]  # noqa: E731
    dq_BTNH = (dq * scale).transpose(0, 3, 1, 2, 4).reshape(B, T, N, H)
    return dq_BTNH.astype(q.dtype), unchunk(dk_n).astype(k.dtype), unchunk(dv_n).astype(v.dtype), None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def chunked_attention_with_lse(
    q_BTNH, k_BSKH, v_BSKH, *, causal=True, segment_ids_BT=None, scale=None, chunk=128
):
    """(out_BTNH, lse_BNT); same contract as flash_attention_with_lse."""
    if causal and k_BSKH.shape[1] != q_BTNH.shape[1]:
        raise ValueError("chunked_attention: causal masking needs as many keys as queries")
    scale = q_BTNH.shape[-1] ** -0.5 if scale is None else float(scale)
    seg = None if segment_ids_BT is None else segment_ids_BT.astype(jnp.int32)
    return _chunked(q_BTNH, k_BSKH, v_BSKH, seg, causal, scale, min(chunk, k_BSKH.shape[1]))


def chunked_attention(q_BTNH, k_BSKH, v_BSKH, *, causal=True, segment_ids_BT=None, scale=None, chunk=128):
    return chunked_attention_with_lse(
        q_BTNH, k_BSKH, v_BSKH, causal=causal, segment_ids_BT=segment_ids_BT, scale=scale, chunk=chunk
    )[0]
