"""Ring attention over a sequence-sharded mesh axis, with load-balanced causal layouts.

Runs inside `shard_map`: each device holds a slice of the sequence (queries, keys, values, the
tokens' positions and segment ids). K/V blocks travel around the ring with `ppermute`; each step
attends the local queries to the visiting block and merges the partial softmax by its running
max and sum (online softmax), so no device ever holds more than two K/V blocks. The backward is a
second ring pass (custom_vjp) that recomputes each block's probabilities from the saved
log-sum-exp; the dK/dV accumulators travel with their blocks and arrive home after n hops.

Masks come from the tokens' *positions*, not their index in the local array, so any permutation
of the sequence works: contiguous, zigzag (device i holds chunks i and 2n-1-i of 2n) or striped
(device i holds tokens i, i+n, ...). Each local slice is split into `sub_chunks` pieces and a
(query piece, key piece) pair that causality masks out entirely is skipped with `lax.cond`:
under zigzag every device then computes the same number of pieces (see `computed_blocks`).

`ring_flash_attention` is the same ring with every block computed by the Pallas flash kernel
(GPU; TPU with `tpu=True`, its Mosaic block layout; interpret mode on CPU), for layouts whose pieces are runs of consecutive positions.

Legend: B batch, t local query positions, s local key positions, K kv heads, G query heads per kv
head, H head dim, N = K*G. `masked_attention` is the pure-JAX reference (and the block op used
by all-gather and Ulysses context parallelism).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from spmd.kernels.chunked_attention import dot32, traced_zero
from spmd.kernels.flash_attention import MASK_VALUE

LAYOUTS = ("zigzag", "striped", "contiguous")


def layout_permutation(T: int, n: int, layout: str) -> np.ndarray:
    """Sequence order for n devices: device i's slice of the permuted sequence is
    perm[i*T/n:(i+1)*T/n]; perm[j] is the original position of permuted slot j."""
    if layout == "contiguous" or n == 1:
        return np.arange(T)
    if layout == "striped":
        if T % n:
            raise ValueError(f"striped layout needs T ({T}) divisible by {n}")
        return np.arange(T).reshape(T // n, n).T.reshape(-1)
    if layout == "zigzag":
        if T % (2 * n):
            raise ValueError(f"zigzag layout needs T ({T}) divisible by 2 x {n}")
        chunks = np.arange(T).reshape(2 * n, T // (2 * n))
        return np.concatenate([np.concatenate([chunks[i], chunks[2 * n - 1 - i]]) for i in range(n)])
    raise ValueError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")


def sub_chunks(layout: str) -> int:
    """Pieces per local slice that make masked-out blocks skippable: zigzag's two chunks."""
    return 2 if layout == "zigzag" else 1


def visible(qpos, kpos):
    """Whether any key in `kpos` is at or before any query in `qpos` (causal): the skip test."""
    return jnp.min(kpos) <= jnp.max(qpos)


def computed_blocks(T: int, n: int, layout: str, pieces: int | None = None) -> list[int]:
    """(query piece, key piece) pairs each device computes in a causal ring pass: the load balance."""
    perm = layout_permutation(T, n, layout)
    c = sub_chunks(layout) if pieces is None else pieces
    local = perm.reshape(n, c, -1)  # device, piece, positions
    return [
        sum(bool(visible(local[i, a], local[j, b])) for j in range(n) for a in range(c) for b in range(c))
        for i in range(n)
    ]


def _mask(qpos_Bt, kpos_Bs, qseg_Bt, kseg_Bs, causal):
    mask_Bts = jnp.ones((qpos_Bt.shape[0], qpos_Bt.shape[1], kpos_Bs.shape[1]), bool)
    if causal:
        mask_Bts = kpos_Bs[:, None, :] <= qpos_Bt[:, :, None]
    if qseg_Bt is not None:
        mask_Bts = mask_Bts & (qseg_Bt[:, :, None] == kseg_Bs[:, None, :])
    return mask_Bts


def _scores(q_BtKGH, k_BsKH, qpos, kpos, qseg, kseg, causal, scale):
    s_BKGts = jnp.einsum("BtKGH,BsKH->BKGts", q_BtKGH, k_BsKH, preferred_element_type=jnp.float32) * scale
    mask_Bts = _mask(qpos, kpos, qseg, kseg, causal)
    return s_BKGts, mask_Bts[:, None, None]


def masked_attention(
    q_BTNH, k_BSKH, v_BSKH, q_pos_BT, k_pos_BS, q_seg_BT=None, k_seg_BS=None, *, causal=True, scale=None
):
    """Plain softmax attention with masks from positions and segment ids: the reference."""
    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    scale = H**-0.5 if scale is None else scale
    q_BTKGH = q_BTNH.reshape(B, T, K, N // K, H)
    s, mask = _scores(q_BTKGH, k_BSKH, q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS, causal, scale)
    p_BKGTS = jax.nn.softmax(jnp.where(mask, s, MASK_VALUE), axis=-1)
    out_BTKGH = jnp.einsum(
        "BKGTS,BSKH->BTKGH", p_BKGTS.astype(v_BSKH.dtype), v_BSKH, preferred_element_type=jnp.float32
    )
    return out_BTKGH.reshape(B, T, N, H).astype(q_BTNH.dtype)


# ----------------------------------------------------------------------------- the ring


def _split(x, c, axis=1):
    return jnp.split(x, c, axis=axis) if c > 1 else [x]


def _rotate(xs, axis_name, n):
    """Send every array to the next device on the ring (device i -> i+1)."""
    perm = [(i, (i + 1) % n) for i in range(n)]
    return jax.tree.map(
        lambda x: None if x is None else jax.lax.ppermute(x, axis_name, perm), xs, is_leaf=lambda x: x is None
    )


def _ring_pass(attend_block, state, kv, axis_name, n):
    """n - 1 steps that attend the visiting block and pass it on; the last block is attended and kept."""

    def step(_, carry):
        state, kv = carry
        return attend_block(state, kv), _rotate(kv, axis_name, n)

    state, kv = jax.lax.fori_loop(0, n - 1, step, (state, kv))
    return attend_block(state, kv)


def _ring_pass_backward(block_grads, dq, k, v, kpos, kseg, axis_name, n):
    """The backward ring: dK/dV accumulators ride with their block and, after n hops, are back with
    the block's owner. Returns (dq pieces, dk, dv) in fp32."""

    def step(_, carry):
        dq, kv, dkv = carry
        dq, dkv = block_grads(dq, kv, dkv)
        return dq, _rotate(kv, axis_name, n), _rotate(dkv, axis_name, n)

    dkv = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    dq, kv, dkv = jax.lax.fori_loop(0, n - 1, step, (dq, (k, v, kpos, kseg), dkv))
    dq, dkv = block_grads(dq, kv, dkv)
    dk, dv = _rotate(dkv, axis_name, n)
    return dq, dk, dv


def _key_chunks(x, C):
    """(B, s, ...) -> (s/C, B, C, ...): the visiting block's keys in chunks of C, for a scan."""
    if x is None:
        return None
    return x.reshape(x.shape[0], x.shape[1] // C, C, *x.shape[2:]).swapaxes(0, 1)


def _unchunk(x):
    return x.swapaxes(0, 1).reshape(x.shape[1], -1, *x.shape[3:])


def _merge_heads(q_BtNH, K):
    """(B, t, N, H) -> (b, Q, H) with b = B*K and Q = G*t: a kv head's queries, all groups, end to
    end. Dots with one batch axis are the fast form on XLA:CPU (see models/attention.xla_attention)."""
    B, t, N, H = q_BtNH.shape
    return q_BtNH.reshape(B, t, K, N // K, H).transpose(0, 2, 3, 1, 4).reshape(B * K, N // K * t, H)


def _split_heads(x_bQH, B, t):
    """The inverse of _merge_heads."""
    b, Q, H = x_bQH.shape
    K, G = b // B, Q // t
    return x_bQH.reshape(B, K, G, t, H).transpose(0, 3, 1, 2, 4).reshape(B, t, K * G, H)


def _kv_rows(k_BsKH):
    """(B, s, K, H) -> (b, s, H)."""
    B, s, K, H = k_BsKH.shape
    return k_BsKH.transpose(0, 2, 1, 3).reshape(B * K, s, H)


def _kv_unrows(x_bsH, B):
    b, s, H = x_bsH.shape
    return x_bsH.reshape(B, b // B, s, H).transpose(0, 2, 1, 3)


def _block_scores(q_bQH, k_bsH, qpos, kpos, qseg, kseg, causal, scale, K, G):
    """Scores (b, Q, s) in fp32 and their mask, broadcast from the tokens' (B, t, s) mask."""
    s_bQs = dot32("bQH,bsH->bQs", q_bQH, k_bsH) * scale
    mask_Bts = _mask(qpos, kpos, qseg, kseg, causal)
    B, t, S = mask_Bts.shape
    mask_bQs = jnp.broadcast_to(mask_Bts[:, None, None], (B, K, G, t, S)).reshape(B * K, G * t, S)
    return s_bQs, mask_bQs


def _ring_forward(q, k, v, qpos, kpos, qseg, kseg, axis_name, n, causal, c, C, scale):
    B, T, N, H = q.shape
    K = k.shape[2]
    G = N // K
    t = T // c
    q_pieces = [_merge_heads(piece, K) for piece in _split(q, c)]
    qpos_p, qseg_p = _split(qpos, c), _split(qseg, c) if qseg is not None else [None] * c
    # Online-softmax state per query piece: running max m, sum l (b, Q), unnormalised output o.
    state = [
        (
            jnp.full((B * K, G * t), -jnp.inf, jnp.float32),
            jnp.zeros((B * K, G * t), jnp.float32),
            jnp.zeros((B * K, G * t, H), jnp.float32),
        )
        for _ in range(c)
    ]

    def attend_chunk(state, chunk):
        k_c, v_c, kpos_c, kseg_c = chunk
        new = []
        for a in range(c):

            def update(st, a=a):
                m, l, o = st
                s, mask = _block_scores(
                    q_pieces[a], k_c, qpos_p[a], kpos_c, qseg_p[a], kseg_c, causal, scale, K, G
                )
                s = jnp.where(mask, s, MASK_VALUE)
                m_new = jnp.maximum(m, s.max(-1))
                p = jnp.exp(s - m_new[..., None])
                alpha = jnp.exp(m - m_new)
                pv = dot32("bQs,bsH->bQH", p.astype(v_c.dtype), v_c)
                return m_new, alpha * l + p.sum(-1), o * alpha[..., None] + pv

            # Skip (query piece, key chunk) pairs that causality masks out entirely.
            new.append(
                jax.lax.cond(visible(qpos_p[a], kpos_c), update, lambda st: st, state[a])
                if causal
                else update(state[a])
            )
        return new, None

    def attend_block(state, kv):
        k, v, kpos, kseg = kv
        # K/V travel as (b, s, H) rows; positions and segments stay (B, s). Chunk all along s.
        chunks = (_key_chunks(k, C), _key_chunks(v, C), _key_chunks(kpos, C), _key_chunks(kseg, C))
        return jax.lax.scan(attend_chunk, state, chunks)[0]

    state = _ring_pass(attend_block, state, (_kv_rows(k), _kv_rows(v), kpos, kseg), axis_name, n)
    out = jnp.concatenate([_split_heads(o / l[..., None], B, t) for _, l, o in state], axis=1).astype(q.dtype)
    return out, jnp.stack([m + jnp.log(l) for m, l, _ in state])  # lse: (c, b, Q)


def _ring_backward(q, k, v, qpos, kpos, qseg, kseg, out, lse, dout, axis_name, n, causal, c, C, scale):
    B, T, N, H = q.shape
    K = k.shape[2]
    G = N // K
    q_pieces = [_merge_heads(piece, K) for piece in _split(q, c)]
    do_p = [_merge_heads(piece, K).astype(jnp.float32) for piece in _split(dout, c)]
    o_p = [_merge_heads(piece, K).astype(jnp.float32) for piece in _split(out, c)]
    delta_p = [jnp.sum(d * o, axis=-1) for d, o in zip(do_p, o_p)]  # (b, Q)
    qpos_p, qseg_p = _split(qpos, c), _split(qseg, c) if qseg is not None else [None] * c

    def chunk_grads(dq, chunk):
        k_c, v_c, kpos_c, kseg_c, dk_c, dv_c = chunk
        dq = list(dq)
        for a in range(c):

            def update(grads, a=a):
                dq_a, dk_c, dv_c = grads
                s, mask = _block_scores(
                    q_pieces[a], k_c, qpos_p[a], kpos_c, qseg_p[a], kseg_c, causal, scale, K, G
                )
                p = jnp.where(mask, jnp.exp(s - lse[a][..., None]), 0.0)
                dv_c = dv_c + dot32("bQs,bQH->bsH", p, do_p[a])
                dp = dot32("bQH,bsH->bQs", do_p[a], v_c.astype(jnp.float32))
                ds = p * (dp - delta_p[a][..., None]) * scale
                dq_a = dq_a + dot32("bQs,bsH->bQH", ds, k_c.astype(jnp.float32))
                dk_c = dk_c + dot32("bQs,bQH->bsH", ds, q_pieces[a].astype(jnp.float32))
                return dq_a, dk_c, dv_c

            grads = (dq[a], dk_c, dv_c)
            dq[a], dk_c, dv_c = (
                jax.lax.cond(visible(qpos_p[a], kpos_c), update, lambda g: g, grads)
                if causal
                else update(grads)
            )
        return dq, (dk_c, dv_c)

    def block_grads(dq, kv, dkv):
        chunks = tuple(_key_chunks(x, C) for x in (*kv, *dkv))
        dq, (dk, dv) = jax.lax.scan(chunk_grads, dq, chunks)
        return dq, (_unchunk(dk), _unchunk(dv))

    dq = [jnp.zeros(p.shape, jnp.float32) for p in q_pieces]
    dq, dk, dv = _ring_pass_backward(block_grads, dq, _kv_rows(k), _kv_rows(v), kpos, kseg, axis_name, n)
    dq = jnp.concatenate([_split_heads(d, B, T // c) for d in dq], axis=1)
    return dq.astype(q.dtype), _kv_unrows(dk, B).astype(k.dtype), _kv_unrows(dv, B).astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10, 11, 12))
def _ring(q, k, v, qpos, kpos, qseg, kseg, axis_name, n, causal, c, C, scale):
    return _ring_forward(q, k, v, qpos, kpos, qseg, kseg, axis_name, n, causal, c, C, scale)[0]


def _ring_fwd(q, k, v, qpos, kpos, qseg, kseg, axis_name, n, causal, c, C, scale):
    out, lse = _ring_forward(q, k, v, qpos, kpos, qseg, kseg, axis_name, n, causal, c, C, scale)
    return out, (q, k, v, qpos, kpos, qseg, kseg, out, lse)


def _ring_bwd(axis_name, n, causal, c, C, scale, residuals, dout):
    q, k, v, qpos, kpos, qseg, kseg, out, lse = residuals
    dq, dk, dv = _ring_backward(
        q, k, v, qpos, kpos, qseg, kseg, out, lse, dout, axis_name, n, causal, c, C, scale
    )
    no_grad = lambda x: None if x is None else np.zeros(x.shape, jax.dtypes.float0)  # noqa: E731
    return dq, dk, dv, no_grad(qpos), no_grad(kpos), no_grad(qseg), no_grad(kseg)


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention(
    q_BtNH,
    k_BsKH,
    v_BsKH,
    positions_Bt,
    segment_ids_Bt=None,
    *,
    axis_name,
    axis_size: int,
    causal: bool = True,
    sub_chunks: int = 1,
    key_chunk: int = 512,
    scale=None,
):
    """Attention of this device's queries to every device's keys; call inside shard_map with the
    sequence sharded over `axis_name` (of `axis_size` devices). Positions (and segment ids) are
    this device's tokens'; they travel with K/V.

    Queries are split into `sub_chunks` pieces and each visiting block is scanned in chunks of
    `key_chunk` keys (memory per device O(t * key_chunk) for the scores); a (piece, chunk) pair
    that causality masks out is skipped."""
    scale = q_BtNH.shape[-1] ** -0.5 if scale is None else scale
    t = q_BtNH.shape[1]
    if t % sub_chunks:
        raise ValueError(f"local sequence length {t} does not split into {sub_chunks} pieces")
    # The largest chunk <= key_chunk that divides the block and, where the block has pieces,
    # stays within one piece (so the skip test sees one contiguous run of positions).
    limit = min(key_chunk, t // sub_chunks)
    C = max(d for d in range(1, limit + 1) if t % d == 0 and (t // sub_chunks) % d == 0)
    # Positions are often constants (the layout permutation); made to depend on q, the masks are
    # not hoisted out of a differentiated layer scan and stacked (see chunked_attention.traced_zero).
    positions_Bt = positions_Bt + traced_zero(q_BtNH)
    return _ring(
        q_BtNH,
        k_BsKH,
        v_BsKH,
        positions_Bt,
        positions_Bt,
        segment_ids_Bt,
        segment_ids_Bt,
        axis_name,
        axis_size,
        causal,
        sub_chunks,
        C,
        scale,
    )


# ----------------------------------------------------------------------------- the ring, Pallas blocks


def _relation(qpos, kpos):
    """How a key piece relates to a query piece of a zigzag or contiguous layout (each piece a run of
    consecutive positions, pieces of one length): 0 all masked, 1 all visible, 2 the same piece
    (causal diagonal)."""
    return jnp.where(jnp.min(kpos) > jnp.max(qpos), 0, jnp.where(jnp.min(kpos) == jnp.min(qpos), 2, 1))


def _flash_ring_forward(q, k, v, qpos, kpos, qseg, kseg, axis_name, n, causal, c, scale, bs, interpret, tpu):
    from spmd.kernels.flash_attention import flash_forward

    B, T, N, H = q.shape
    t = T // c
    q_p, qpos_p = _split(q, c), _split(qpos, c)
    qseg_p = _split(qseg, c) if qseg is not None else [None] * c
    # Per query piece: the merged output (fp32) and log-sum-exp (B, N, t).
    state = [
        (jnp.zeros((B, t, N, H), jnp.float32), jnp.full((B, N, t), -jnp.inf, jnp.float32)) for _ in range(c)
    ]

    def attend_block(state, kv):
        k, v, kpos, kseg = kv
        k_p, v_p, kpos_p = _split(k, c), _split(v, c), _split(kpos, c)
        kseg_p = _split(kseg, c) if kseg is not None else [None] * c
        new = []
        for a in range(c):
            st = state[a]
            for b in range(c):
                seg = None if qseg is None else (qseg_p[a], kseg_p[b])

                def attend(st, diagonal, a=a, b=b, seg=seg):
                    o, lse = st
                    o_b, lse_b = flash_forward(
                        q_p[a], k_p[b], v_p[b], seg, diagonal, scale, bs, interpret, tpu
                    )
                    lse_new = jnp.logaddexp(lse, lse_b)
                    w_old = jnp.exp(lse - lse_new).transpose(0, 2, 1)[..., None]
                    w_new = jnp.exp(lse_b - lse_new).transpose(0, 2, 1)[..., None]
                    return o * w_old + o_b.astype(jnp.float32) * w_new, lse_new

                if causal:
                    st = jax.lax.switch(
                        _relation(qpos_p[a], kpos_p[b]),
                        [lambda st: st, lambda st: attend(st, False), lambda st: attend(st, True)],
                        st,
                    )
                else:
                    st = attend(st, False)
            new.append(st)
        return new

    state = _ring_pass(attend_block, state, (k, v, kpos, kseg), axis_name, n)
    out = jnp.concatenate([o for o, _ in state], axis=1).astype(q.dtype)
    return out, jnp.concatenate([lse for _, lse in state], axis=-1)  # lse: B N T


def _flash_ring_backward(
    q, k, v, qpos, kpos, qseg, kseg, out, lse, dout, axis_name, n, causal, c, scale, bs, interpret, tpu
):
    from spmd.kernels.flash_attention import flash_backward

    q_p, o_p, do_p, lse_p = _split(q, c), _split(out, c), _split(dout, c), _split(lse, c, axis=-1)
    qpos_p = _split(qpos, c)
    qseg_p = _split(qseg, c) if qseg is not None else [None] * c

    def block_grads(dq, kv, dkv):
        k, v, kpos, kseg = kv
        k_p, v_p, kpos_p = _split(k, c), _split(v, c), _split(kpos, c)
        kseg_p = _split(kseg, c) if kseg is not None else [None] * c
        dk_p, dv_p = _split(dkv[0], c), _split(dkv[1], c)
        dq = list(dq)
        for a in range(c):
            for b in range(c):
                seg = None if qseg is None else (qseg_p[a], kseg_p[b])

                # With the merged output and lse, the kernel's backward gives this block's share.
                def grads(g, diagonal, a=a, b=b, seg=seg):
                    dq_a, dk_b, dv_b = g
                    dq_ab, dk_ab, dv_ab = flash_backward(
                        q_p[a],
                        k_p[b],
                        v_p[b],
                        seg,
                        o_p[a],
                        lse_p[a],
                        do_p[a],
                        jnp.zeros_like(lse_p[a]),
                        diagonal,
                        scale,
                        bs,
                        interpret,
                        tpu,
                    )
                    return (
                        dq_a + dq_ab.astype(jnp.float32),
                        dk_b + dk_ab.astype(jnp.float32),
                        dv_b + dv_ab.astype(jnp.float32),
                    )

                g = (dq[a], dk_p[b], dv_p[b])
                if causal:
                    g = jax.lax.switch(
                        _relation(qpos_p[a], kpos_p[b]),
                        [lambda g: g, lambda g: grads(g, False), lambda g: grads(g, True)],
                        g,
                    )
                else:
                    g = grads(g, False)
                dq[a], dk_p[b], dv_p[b] = g
        join = (lambda xs: jnp.concatenate(xs, axis=1)) if c > 1 else (lambda xs: xs[0])
        return dq, (join(dk_p), join(dv_p))

    dq = [jnp.zeros(p.shape, jnp.float32) for p in q_p]
    dq, dk, dv = _ring_pass_backward(block_grads, dq, k, v, kpos, kseg, axis_name, n)
    dq = jnp.concatenate(dq, axis=1) if c > 1 else dq[0]
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10, 11, 12, 13, 14))
def _flash_ring(q, k, v, qpos, kpos, qseg, kseg, axis_name, n, causal, c, scale, bs, interpret, tpu):
    return _flash_ring_forward(
        q, k, v, qpos, kpos, qseg, kseg, axis_name, n, causal, c, scale, bs, interpret, tpu
    )[0]


def _flash_ring_fwd(q, k, v, qpos, kpos, qseg, kseg, axis_name, n, causal, c, scale, bs, interpret, tpu):
    out, lse = _flash_ring_forward(
        q, k, v, qpos, kpos, qseg, kseg, axis_name, n, causal, c, scale, bs, interpret, tpu
    )
    return out, (q, k, v, qpos, kpos, qseg, kseg, out, lse)


def _flash_ring_bwd(axis_name, n, causal, c, scale, bs, interpret, tpu, residuals, dout):
    q, k, v, qpos, kpos, qseg, kseg, out, lse = residuals
    dq, dk, dv = _flash_ring_backward(
        q, k, v, qpos, kpos, qseg, kseg, out, lse, dout, axis_name, n, causal, c, scale, bs, interpret, tpu
    )
    no_grad = lambda x: None if x is None else np.zeros(x.shape, jax.dtypes.float0)  # noqa: E731
    return dq, dk, dv, no_grad(qpos), no_grad(kpos), no_grad(qseg), no_grad(kseg)


_flash_ring.defvjp(_flash_ring_fwd, _flash_ring_bwd)


def ring_flash_attention(
    q_BtNH,
    k_BsKH,
    v_BsKH,
    positions_Bt,
    segment_ids_Bt=None,
    *,
    axis_name,
    axis_size: int,
    causal: bool = True,
    sub_chunks: int = 1,
    scale=None,
    block_sizes=None,
    interpret: bool | None = None,
    tpu: bool = False,
):
    """`ring_attention` with every block computed by the Pallas flash kernel (forward, and its dq /
    dk-dv kernels in the backward). Causal masking is the kernel's (by index), so the layout must
    be zigzag or contiguous (pieces of consecutive positions, `sub_chunks` per device); a block is
    skipped, attended in full, or attended causally by comparing its pieces' positions."""
    from spmd.kernels.flash_attention import BlockSizes

    scale = q_BtNH.shape[-1] ** -0.5 if scale is None else float(scale)
    if interpret is None:
        interpret = jax.devices()[0].platform == "cpu"
    positions_Bt = positions_Bt + traced_zero(q_BtNH)
    seg = None if segment_ids_Bt is None else segment_ids_Bt.astype(jnp.int32)
    return _flash_ring(
        q_BtNH,
        k_BsKH,
        v_BsKH,
        positions_Bt,
        positions_Bt,
        seg,
        seg,
        axis_name,
        axis_size,
        causal,
        sub_chunks,
        scale,
        block_sizes or BlockSizes(),
        interpret,
        tpu,
    )
