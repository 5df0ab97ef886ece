"""Chunked attention in plain JAX: flash attention's tiling as XLA loops, memory O(T).

Legend as in flash_attention.py, and: C the tile length (queries and keys alike), n = S / C key
chunks, m = T / C query blocks (both padded up), b = B * K (batch and kv heads merged), Q = G * C
(a kv head's queries of one block, all groups, laid end to end as in spmd.models.attention).

The forward runs a loop over query blocks and, inside it, over the key chunks the block sees: under
a causal mask only chunks up to the block's diagonal (n (n + 1) / 2 tiles instead of n^2), and only
the diagonal tile is masked. The backward recomputes each tile's probabilities from the saved
log-sum-exp in a loop over key chunks and, inside it, over the query blocks that see the chunk;
each chunk's key and value gradients stay in the loop's carry and the query gradients accumulate in
place. No pass holds more than a few (Q, C) tiles. Runs on every backend (it is the CPU
implementation for long sequences and Ulysses' local attention).
"""

import functools

import jax
import jax.numpy as jnp

from spmd.kernels.flash_attention import MASK_VALUE


def dot32(spec, a, b):
    """einsum with fp32 results, as the tiles' scores, probabilities and gradients are kept."""
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def traced_zero(x):
    """0 as int32, computed from `x`.

    The block index starts from this instead of a constant. When this attention runs inside a
    differentiated scan (the model's layers), JAX splits the forward into the part that depends
    only on constants and the rest, and saves the former's per-iteration values: with a constant
    index, every tile's mask was stacked up front, 1 GiB at T=8k: O(T^2) again.
    """
    return (jnp.sum(x[(0,) * x.ndim]) * 0).astype(jnp.int32)


def _pad_to(x, axis, length, value=0):
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, length - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


def _query_blocks(x_BTNH, m, C, K):
    """(B, T, N, ...) -> (m, b, Q, ...): each block's queries, a kv head's groups end to end."""
    B, _, N = x_BTNH.shape[:3]
    rest = x_BTNH.shape[3:]
    x = _pad_to(x_BTNH, 1, m * C).reshape(B, m, C, K, N // K, *rest)
    x = jnp.moveaxis(x, (1, 3, 4), (0, 2, 3))  # (m, B, K, G, C, ...)
    return x.reshape(m, B * K, N // K * C, *rest)


def _from_query_blocks(x_mbQ, B, T, N, K, C):
    """Inverse of _query_blocks."""
    m = x_mbQ.shape[0]
    rest = x_mbQ.shape[3:]
    x = x_mbQ.reshape(m, B, K, N // K, C, *rest)
    x = jnp.moveaxis(x, (0, 2, 3), (1, 3, 4))  # (B, m, C, K, G, ...)
    return x.reshape(B, m * C, N, *rest)[:, :T]


def _key_chunks(x_BSKH, n, C):
    """(B, S, K, H) -> (n, b, C, H)."""
    B, _, K, H = x_BSKH.shape
    x = _pad_to(x_BSKH, 1, n * C).reshape(B, n, C, K, H)
    return x.transpose(1, 0, 3, 2, 4).reshape(n, B * K, C, H)


def _from_key_chunks(x_nbCH, B, S, K):
    n, _, C, H = x_nbCH.shape
    return x_nbCH.reshape(n, B, K, C, H).transpose(1, 0, 3, 2, 4).reshape(B, n * C, K, H)[:, :S]


class _Tiles:
    """What every tile of one call shares: shapes, the mask and which tiles need it."""

    def __init__(self, q_shape, S, K, C, causal, seg_BT):
        self.B, self.T, self.N, self.H = q_shape
        self.S, self.K, self.C, self.causal = S, K, C, causal
        self.G = self.N // K
        self.m, self.n = -(-self.T // C), -(-S // C)
        self.seg_mBC = (
            None if seg_BT is None else _pad_to(seg_BT, 1, self.m * C, -1).reshape(self.B, self.m, C)
        )
        if seg_BT is not None:
            self.seg_mBC = self.seg_mBC.swapaxes(0, 1)
        # Which tiles need a mask: under causality only the diagonal; with segment ids every tile;
        # otherwise only where the last key chunk is padding (then every tile: the chunk index is
        # traced, and masking a tile costs one select).
        self.mask_all = seg_BT is not None or (not causal and S % C != 0)

    def mask(self, i, j):
        """(B or 1, 1, 1, C, C): which of query block i's keys in chunk j are seen."""
        C = self.C
        q_pos, k_pos = i * C + jnp.arange(C), j * C + jnp.arange(C)
        mask_CC = jnp.broadcast_to((k_pos < self.S)[None, :], (C, C))
        if self.causal:
            mask_CC = mask_CC & (q_pos[:, None] >= k_pos[None, :])
        mask_BCC = mask_CC[None]
        if self.seg_mBC is not None:
            mask_BCC = mask_BCC & (self.seg_mBC[i][:, :, None] == self.seg_mBC[j][:, None, :])
        return mask_BCC[:, None, None]

    def masked(self, x_bQC, i, j, fill):
        """x with the unseen (query, key) pairs of tile (i, j) replaced by `fill`."""
        B, K, G, C = self.B, self.K, self.G, self.C
        x = jnp.where(self.mask(i, j), x_bQC.reshape(B, K, G, C, C), fill)
        return x.reshape(B * K, G * C, C)


def _forward(q, k, v, seg, causal, scale, C):
    tiles = _Tiles(q.shape, k.shape[1], k.shape[2], C, causal, seg)
    B, T, N, K, m, n = tiles.B, tiles.T, tiles.N, tiles.K, tiles.m, tiles.n
    k_nbCH, v_nbCH = _key_chunks(k, n, C), _key_chunks(v, n, C)

    def query_block(i, q_bQH):
        def tile(j, carry, masked):
            acc_bQH, m_bQ, l_bQ = carry
            k_bCH = jax.lax.dynamic_index_in_dim(k_nbCH, j, keepdims=False)
            v_bCH = jax.lax.dynamic_index_in_dim(v_nbCH, j, keepdims=False)
            s_bQC = dot32("bQH,bCH->bQC", q_bQH, k_bCH) * scale
            if masked:
                s_bQC = tiles.masked(s_bQC, i, j, MASK_VALUE)
            m_new = jnp.maximum(m_bQ, s_bQC.max(axis=-1))
            p_bQC = jnp.exp(s_bQC - m_new[..., None])
            correction = jnp.exp(m_bQ - m_new)
            pv_bQH = dot32("bQC,bCH->bQH", p_bQC.astype(v_bCH.dtype), v_bCH)
            return correction[..., None] * acc_bQH + pv_bQH, m_new, correction * l_bQ + p_bQC.sum(-1)

        b, Q, H = q_bQH.shape
        carry = (
            jnp.zeros((b, Q, H), jnp.float32),
            jnp.full((b, Q), MASK_VALUE, jnp.float32),
            jnp.zeros((b, Q), jnp.float32),
        )
        full = functools.partial(tile, masked=False)
        if m == n == 1:  # one tile: no loops
            carry = tile(i, carry, masked=tiles.mask_all or causal)
        elif tiles.mask_all:
            carry = jax.lax.fori_loop(0, i + 1 if causal else n, functools.partial(tile, masked=True), carry)
        elif causal:
            carry = tile(i, jax.lax.fori_loop(0, i, full, carry), masked=True)
        else:
            carry = jax.lax.fori_loop(0, n, full, carry)
        acc_bQH, m_bQ, l_bQ = carry
        return acc_bQH / l_bQ[..., None], m_bQ + jnp.log(l_bQ)

    def step(i, q_bQH):
        return i + 1, query_block(i, q_bQH)

    _, (out_mbQH, lse_mbQ) = jax.lax.scan(step, traced_zero(q), _query_blocks(q, m, C, K))
    out_BTNH = _from_query_blocks(out_mbQH, B, T, N, K, C).astype(q.dtype)
    lse_BTN = _from_query_blocks(lse_mbQ, B, T, N, K, C)
    return out_BTNH, lse_BTN.transpose(0, 2, 1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _chunked(q, k, v, seg, causal, scale, C):
    return _forward(q, k, v, seg, causal, scale, C)


def _chunked_fwd(q, k, v, seg, causal, scale, C):
    out, lse = _forward(q, k, v, seg, causal, scale, C)
    return (out, lse), (q, k, v, seg, out, lse)


def _chunked_bwd(causal, scale, C, residuals, cotangents):
    q, k, v, seg, out, lse = residuals
    do, dlse = cotangents
    tiles = _Tiles(q.shape, k.shape[1], k.shape[2], C, causal, seg)
    B, T, N, K, S, m, n = tiles.B, tiles.T, tiles.N, tiles.K, tiles.S, tiles.m, tiles.n
    delta_BTN = jnp.einsum(
        "BTNH,BTNH->BTN", do.astype(jnp.float32), out.astype(jnp.float32)
    ) - dlse.transpose(0, 2, 1)
    q_mbQH, do_mbQH = _query_blocks(q, m, C, K), _query_blocks(do, m, C, K)
    lse_mbQ, delta_mbQ = _query_blocks(lse.transpose(0, 2, 1), m, C, K), _query_blocks(delta_BTN, m, C, K)

    def key_chunk(j, k_bCH, v_bCH, masked):
        def tile(i, carry):
            dk_bCH, dv_bCH, dq_mbQH = carry
            q_bQH, do_bQH, lse_bQ, delta_bQ = (
                jax.lax.dynamic_index_in_dim(x, i, keepdims=False)
                for x in (q_mbQH, do_mbQH, lse_mbQ, delta_mbQ)
            )
            s_bQC = dot32("bQH,bCH->bQC", q_bQH, k_bCH) * scale
            p_bQC = jnp.exp(s_bQC - lse_bQ[..., None])
            if masked:
                p_bQC = tiles.masked(p_bQC, i, j, 0.0)
            dv_bCH = dv_bCH + dot32("bQC,bQH->bCH", p_bQC, do_bQH.astype(jnp.float32))
            dp_bQC = dot32("bQH,bCH->bQC", do_bQH, v_bCH)
            ds_bQC = p_bQC * (dp_bQC - delta_bQ[..., None])
            dq_bQH = jax.lax.dynamic_index_in_dim(dq_mbQH, i, keepdims=False)
            dq_bQH = dq_bQH + dot32("bQC,bCH->bQH", ds_bQC, k_bCH.astype(jnp.float32))
            dk_bCH = dk_bCH + dot32("bQC,bQH->bCH", ds_bQC, q_bQH.astype(jnp.float32))
            return dk_bCH, dv_bCH, jax.lax.dynamic_update_index_in_dim(dq_mbQH, dq_bQH, i, 0)

        return tile

    def step(carry, kv):
        j, dq_mbQH = carry
        k_bCH, v_bCH = kv
        full, masked = key_chunk(j, k_bCH, v_bCH, False), key_chunk(j, k_bCH, v_bCH, True)
        zeros = jnp.zeros(k_bCH.shape, jnp.float32)
        inner = (zeros, zeros, dq_mbQH)
        if m == n == 1:  # one tile: no loops
            inner = (masked if tiles.mask_all or causal else full)(j, inner)
        elif tiles.mask_all:
            inner = jax.lax.fori_loop(j if causal else 0, m, masked, inner)
        elif causal:
            inner = jax.lax.fori_loop(j + 1, m, full, masked(j, inner))
        else:
            inner = jax.lax.fori_loop(0, m, full, inner)
        dk_bCH, dv_bCH, dq_mbQH = inner
        return (j + 1, dq_mbQH), (dk_bCH * scale, dv_bCH)

    dq0 = jnp.zeros(q_mbQH.shape, jnp.float32)
    (_, dq_mbQH), (dk_nbCH, dv_nbCH) = jax.lax.scan(
        step, (traced_zero(q), dq0), (_key_chunks(k, n, C), _key_chunks(v, n, C))
    )
    dq_BTNH = _from_query_blocks(dq_mbQH * scale, B, T, N, K, C)
    return (
        dq_BTNH.astype(q.dtype),
        _from_key_chunks(dk_nbCH, B, S, K).astype(k.dtype),
        _from_key_chunks(dv_nbCH, B, S, K).astype(v.dtype),
        None,
    )


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def default_chunk(length: int) -> int:
    """The tile length for `length` positions: a quarter of them, a power of two in [64, 512]
    (the fastest of the tiles tried on CPU at 1k and 4k positions; figures: docs/performance.md)."""
    return min(512, max(64, 1 << max(0, (length // 4).bit_length() - 1)))


def chunked_attention_with_lse(
    q_BTNH, k_BSKH, v_BSKH, *, causal=True, segment_ids_BT=None, scale=None, chunk=None
):
    """(out_BTNH, lse_BNT); same contract as flash_attention_with_lse. `chunk`: the tile length
    (default_chunk of the sequence by default)."""
    if causal and k_BSKH.shape[1] != q_BTNH.shape[1]:
        raise ValueError("chunked_attention: causal masking needs as many keys as queries")
    scale = q_BTNH.shape[-1] ** -0.5 if scale is None else float(scale)
    seg = None if segment_ids_BT is None else segment_ids_BT.astype(jnp.int32)
    length = max(q_BTNH.shape[1], k_BSKH.shape[1])
    C = min(default_chunk(length) if chunk is None else chunk, length)
    return _chunked(q_BTNH, k_BSKH, v_BSKH, seg, causal, scale, C)


def chunked_attention(q_BTNH, k_BSKH, v_BSKH, *, causal=True, segment_ids_BT=None, scale=None, chunk=None):
    return chunked_attention_with_lse(
        q_BTNH, k_BSKH, v_BSKH, causal=causal, segment_ids_BT=segment_ids_BT, scale=scale, chunk=chunk
    )[0]
