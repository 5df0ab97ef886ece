"""Flash attention in Pallas: blockwise online softmax forward, dq and dk/dv backward kernels.

Legend: B batch, T query positions, S key positions, N query heads, K kv heads, G = N / K query
heads per kv head, H head dim. Query head n reads kv head n // G (heads grouped contiguously), through
the BlockSpec index maps: K and V are never repeated in memory.

Backends: on GPU `pallas_call` lowers through Triton (the same kernel source that runs here in
interpret mode on CPU; Mosaic GPU would need a separate Hopper-only kernel, bf16/f16 only). On TPU
(`tpu=True`) the same kernels run in the block layout Mosaic accepts: heads-major operands (a
block's last two dims (positions, H)), per-token vectors as (1, T) rows, tiles of at least 128
positions, and a raised scoped-VMEM limit for the whole-sequence blocks. That layout is compiled by
the TPU compiler in the tests (libtpu, no chip) and checked for numerics in interpret mode; it has
not run on a TPU. On CPU the kernels run in interpret mode (`interpret=True`), which is how the
tests check them against `attention_reference`, the pure-JAX definition in this file.

Returns the output and the log-sum-exp of each query's scores (B, N, T), fp32; gradients flow
through both (the lse is what ring attention merges partial results with).
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

# Finite "minus infinity": keeps fully masked rows free of inf - inf = NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
# TPU tiles: a block's last dim is a multiple of 128 lanes (or the whole array dim).
TPU_MIN_BLOCK = 128


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes (powers of two; sequences are padded up to a multiple of them) and, on GPU,
    Triton's warps per program and software-pipeline stages (None: Triton's defaults)."""

    block_q: int = 64
    block_k: int = 64
    block_q_bwd: int = 32
    block_k_bwd: int = 32
    num_warps: int | None = None
    num_stages: int | None = None

    def __post_init__(self):
        for name in ("block_q", "block_k", "block_q_bwd", "block_k_bwd", "num_warps"):
            value = getattr(self, name)
            if value is not None and (value < 1 or value & (value - 1)):
                raise ValueError(f"BlockSizes.{name} must be a power of two, got {value}")
        if self.num_stages is not None and self.num_stages < 1:
            raise ValueError(f"BlockSizes.num_stages must be positive, got {self.num_stages}")


def triton_params(bs: BlockSizes, interpret):
    """Triton's compiler parameters for the GPU kernels (None: its defaults, or interpret mode)."""
    if interpret or (bs.num_warps is None and bs.num_stages is None):
        return None
    from jax.experimental.pallas import triton as pltriton

    params = getattr(pltriton, "CompilerParams", None) or pltriton.TritonCompilerParams  # older jax
    return params(num_warps=bs.num_warps, num_stages=bs.num_stages)


def attention_reference(q_BTNH, k_BSKH, v_BSKH, *, causal=True, segment_ids_BT=None, scale=None):
    """Softmax attention written plainly (K/V repeated per query head): (out_BTNH, lse_BNT)."""
    B, T, N, H = q_BTNH.shape
    G = N // k_BSKH.shape[2]
    scale = H**-0.5 if scale is None else scale
    k_BSNH = jnp.repeat(k_BSKH, G, axis=2).astype(jnp.float32)
    v_BSNH = jnp.repeat(v_BSKH, G, axis=2).astype(jnp.float32)
    s_BNTS = jnp.einsum("BTNH,BSNH->BNTS", q_BTNH.astype(jnp.float32), k_BSNH) * scale
    mask_BTS = _mask(T, k_BSKH.shape[1], causal, segment_ids_BT)
    s_BNTS = jnp.where(mask_BTS[:, None], s_BNTS, MASK_VALUE)
    lse_BNT = jax.nn.logsumexp(s_BNTS, axis=-1)
    out_BTNH = jnp.einsum("BNTS,BSNH->BTNH", jnp.exp(s_BNTS - lse_BNT[..., None]), v_BSNH)
    return out_BTNH.astype(q_BTNH.dtype), lse_BNT


def _mask(T, S, causal, segment_ids_BT):
    mask = jnp.ones((1, T, S), bool)
    if causal:
        mask = mask & (jnp.arange(T)[:, None] >= jnp.arange(S)[None, :])[None]
    if segment_ids_BT is not None:
        mask = mask & (segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :])
    return mask


# ----------------------------------------------------------------------------- kernels


def _row(ref, sl=slice(None)):
    """A per-token vector (segment ids, lse, delta) from its block: (n,) on GPU/CPU, (1, n) in
    the TPU layout (Mosaic wants the last two block dims to be tiles or whole)."""
    return ref[0, sl] if len(ref.shape) == 2 else ref[sl]


def _block_mask(q_pos, k_pos, kv_len, causal, qseg, kseg):
    mask = (k_pos < kv_len)[None, :]
    if causal:
        mask = mask & (q_pos[:, None] >= k_pos[None, :])
    if qseg is not None:
        mask = mask & (qseg[:, None] == kseg[None, :])
    return mask


def _fwd_kernel(q_ref, k_ref, v_ref, qseg_ref, kseg_ref, o_ref, lse_ref, *, scale, causal, bq, bk, kv_len):
    i = pl.program_id(2)
    q_qH = q_ref[...]
    q_pos = i * bq + jnp.arange(bq)
    qseg = None if qseg_ref is None else _row(qseg_ref)

    def body(j, carry):
        acc_qH, m_q, l_q = carry
        k_kH = k_ref[pl.ds(j * bk, bk), :]
        v_kH = v_ref[pl.ds(j * bk, bk), :]
        s_qk = jnp.dot(q_qH, k_kH.T, preferred_element_type=jnp.float32) * scale
        kseg = None if kseg_ref is None else _row(kseg_ref, pl.ds(j * bk, bk))
        s_qk = jnp.where(
            _block_mask(q_pos, j * bk + jnp.arange(bk), kv_len, causal, qseg, kseg), s_qk, MASK_VALUE
        )
        m_new = jnp.maximum(m_q, s_qk.max(axis=-1))
        p_qk = jnp.exp(s_qk - m_new[:, None])
        correction = jnp.exp(m_q - m_new)
        acc_qH = correction[:, None] * acc_qH + jnp.dot(
            p_qk.astype(v_kH.dtype), v_kH, preferred_element_type=jnp.float32
        )
        return acc_qH, m_new, correction * l_q + p_qk.sum(axis=-1)

    n_k = k_ref.shape[0] // bk
    # Causal: key blocks entirely after this query block are never visited.
    upper = jnp.minimum(n_k, ((i + 1) * bq + bk - 1) // bk) if causal else n_k
    init = (
        jnp.zeros(q_qH.shape, jnp.float32),
        jnp.full((bq,), MASK_VALUE, jnp.float32),
        jnp.zeros((bq,), jnp.float32),
    )
    acc_qH, m_q, l_q = jax.lax.fori_loop(0, upper, body, init)
    o_ref[...] = (acc_qH / l_q[:, None]).astype(o_ref.dtype)
    lse_ref[...] = (m_q + jnp.log(l_q)).reshape(lse_ref.shape)


def _dq_kernel(
    q_ref,
    k_ref,
    v_ref,
    qseg_ref,
    kseg_ref,
    do_ref,
    lse_ref,
    delta_ref,
    dq_ref,
    *,
    scale,
    causal,
    bq,
    bk,
    kv_len,
):
    i = pl.program_id(2)
    q_qH, do_qH = q_ref[...], do_ref[...]
    lse_q, delta_q = _row(lse_ref), _row(delta_ref)
    q_pos = i * bq + jnp.arange(bq)
    qseg = None if qseg_ref is None else _row(qseg_ref)

    def body(j, dq_qH):
        k_kH = k_ref[pl.ds(j * bk, bk), :]
        v_kH = v_ref[pl.ds(j * bk, bk), :]
        s_qk = jnp.dot(q_qH, k_kH.T, preferred_element_type=jnp.float32) * scale
        kseg = None if kseg_ref is None else _row(kseg_ref, pl.ds(j * bk, bk))
        mask = _block_mask(q_pos, j * bk + jnp.arange(bk), kv_len, causal, qseg, kseg)
        p_qk = jnp.where(mask, jnp.exp(s_qk - lse_q[:, None]), 0.0)
        dp_qk = jnp.dot(do_qH, v_kH.T, preferred_element_type=jnp.float32)
        ds_qk = p_qk * (dp_qk - delta_q[:, None])
        return dq_qH + jnp.dot(ds_qk.astype(k_kH.dtype), k_kH, preferred_element_type=jnp.float32)

    n_k = k_ref.shape[0] // bk
    upper = jnp.minimum(n_k, ((i + 1) * bq + bk - 1) // bk) if causal else n_k
    dq_qH = jax.lax.fori_loop(0, upper, body, jnp.zeros(q_qH.shape, jnp.float32))
    dq_ref[...] = (dq_qH * scale).astype(dq_ref.dtype)


def _dkv_kernel(
    q_ref,
    k_ref,
    v_ref,
    qseg_ref,
    kseg_ref,
    do_ref,
    lse_ref,
    delta_ref,
    dk_ref,
    dv_ref,
    *,
    scale,
    causal,
    bq,
    bk,
    kv_len,
    groups,
    accumulate=False,
):
    """dK and dV of one key block. `accumulate`: the grid's last axis runs over the kv head's
    query heads, one per step, each adding its share into the same (fp32) output block."""
    j = pl.program_id(2)
    k_kH, v_kH = k_ref[...], v_ref[...]
    k_pos = j * bk + jnp.arange(bk)
    kseg = None if kseg_ref is None else _row(kseg_ref)
    # Layouts: (T, G, H) and (G, T) blocks on GPU/CPU; (G, T, H) and (G, 1, T) for TPU.
    tpu = len(lse_ref.shape) == 3
    n_q = q_ref.shape[1 if tpu else 0] // bq
    # Causal: query blocks entirely before this key block contribute nothing.
    lower = (j * bk) // bq if causal else 0

    def body(i, carry, g):
        dk_kH, dv_kH = carry
        rows = pl.ds(i * bq, bq)
        if tpu:
            q_qH, do_qH = q_ref[g, rows, :], do_ref[g, rows, :]
            lse_q, delta_q = lse_ref[g, 0, rows], delta_ref[g, 0, rows]
        else:
            q_qH, do_qH = q_ref[rows, g, :], do_ref[rows, g, :]
            lse_q, delta_q = lse_ref[g, rows], delta_ref[g, rows]
        qseg = None if qseg_ref is None else _row(qseg_ref, rows)
        s_qk = jnp.dot(q_qH, k_kH.T, preferred_element_type=jnp.float32) * scale
        mask = _block_mask(i * bq + jnp.arange(bq), k_pos, kv_len, causal, qseg, kseg)
        p_qk = jnp.where(mask, jnp.exp(s_qk - lse_q[:, None]), 0.0)
        dv_kH = dv_kH + jnp.dot(p_qk.T.astype(do_qH.dtype), do_qH, preferred_element_type=jnp.float32)
        dp_qk = jnp.dot(do_qH, v_kH.T, preferred_element_type=jnp.float32)
        ds_qk = p_qk * (dp_qk - delta_q[:, None])
        dk_kH = dk_kH + jnp.dot(ds_qk.T.astype(q_qH.dtype), q_qH, preferred_element_type=jnp.float32)
        return dk_kH, dv_kH

    carry = (jnp.zeros(k_kH.shape, jnp.float32), jnp.zeros(v_kH.shape, jnp.float32))
    for g in range(groups):  # the kv head's query heads, accumulated without repeating K/V
        carry = jax.lax.fori_loop(lower, n_q, functools.partial(body, g=g), carry)
    if not accumulate:
        dk_ref[...] = (carry[0] * scale).astype(dk_ref.dtype)
        dv_ref[...] = carry[1].astype(dv_ref.dtype)
        return

    @pl.when(pl.program_id(3) == 0)
    def _():
        dk_ref[...] = jnp.zeros(dk_ref.shape, dk_ref.dtype)
        dv_ref[...] = jnp.zeros(dv_ref.shape, dv_ref.dtype)

    dk_ref[...] += carry[0] * scale
    dv_ref[...] += carry[1]


# ----------------------------------------------------------------------------- pallas_calls


def _pad_to(x, axis, multiple, value=0):
    pad = -x.shape[axis] % multiple
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def _seg_pair(seg):
    """Segment ids of the queries and of the keys: one array for self-attention, or a pair (ring
    attention's blocks attend one device's queries to another's keys)."""
    return seg if isinstance(seg, tuple) else (seg, seg)


def _blocks(block_q, block_k, T, S, tpu):
    """Tile sizes for T queries and S keys: the configured ones, no larger than the padded
    sequence; on TPU at least 128, the lane width the per-token vectors' blocks must fill."""
    bq, bk = min(block_q, _ceil_pow2(T)), min(block_k, _ceil_pow2(S))
    return (max(bq, TPU_MIN_BLOCK), max(bk, TPU_MIN_BLOCK)) if tpu else (bq, bk)


# Scoped VMEM for the TPU kernels: whole-sequence blocks (K and V in the forward and dq kernels, a
# kv head's queries and output gradients in dk/dv) outgrow Mosaic's 16 MiB default from T = 8k.
TPU_VMEM_LIMIT = 64 * 2**20


def _tpu_params(interpret):
    if interpret:
        return None
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.CompilerParams(vmem_limit_bytes=TPU_VMEM_LIMIT)


def _heads_major(x):
    """(B, T, N, H) <-> (B, N, T, H): the TPU layout, where a block's last two dims are (T, H)."""
    return None if x is None else x.transpose(0, 2, 1, 3)


def flash_forward(q, k, v, seg, causal, scale, bs: BlockSizes, interpret, tpu=False):
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    bq, bk = _blocks(bs.block_q, bs.block_k, T, S, tpu)
    qp, kp, vp = _pad_to(q, 1, bq), _pad_to(k, 1, bk), _pad_to(v, 1, bk)
    Tp, Sp = qp.shape[1], kp.shape[1]
    seg_q, seg_k = _seg_pair(seg)
    segq = None if seg is None else _pad_to(seg_q, 1, bq, -1)
    segk = None if seg is None else _pad_to(seg_k, 1, bk, -2)
    kernel = functools.partial(_fwd_kernel, scale=scale, causal=causal, bq=bq, bk=bk, kv_len=S)
    if tpu:
        # Mosaic: heads-major operands, per-token vectors as (B, 1, T) and (B, N, 1, T).
        o, lse = pl.pallas_call(
            kernel,
            grid=(B, N, Tp // bq),
            in_specs=[
                pl.BlockSpec((None, None, bq, H), lambda b, n, i: (b, n, i, 0)),
                pl.BlockSpec((None, None, Sp, H), lambda b, n, i: (b, n // G, 0, 0)),
                pl.BlockSpec((None, None, Sp, H), lambda b, n, i: (b, n // G, 0, 0)),
                None if seg is None else pl.BlockSpec((None, 1, bq), lambda b, n, i: (b, 0, i)),
                None if seg is None else pl.BlockSpec((None, 1, Sp), lambda b, n, i: (b, 0, 0)),
            ],
            out_specs=[
                pl.BlockSpec((None, None, bq, H), lambda b, n, i: (b, n, i, 0)),
                pl.BlockSpec((None, None, 1, bq), lambda b, n, i: (b, n, 0, i)),
            ],
            out_shape=[
                jax.ShapeDtypeStruct((B, N, Tp, H), q.dtype),
                jax.ShapeDtypeStruct((B, N, 1, Tp), jnp.float32),
            ],
            interpret=interpret,
            name="flash_attention_fwd",
            compiler_params=_tpu_params(interpret),
        )(
            _heads_major(qp),
            _heads_major(kp),
            _heads_major(vp),
            None if seg is None else segq[:, None],
            None if seg is None else segk[:, None],
        )
        return _heads_major(o)[:, :T], lse[:, :, 0, :T]
    in_specs = [
        pl.BlockSpec((None, bq, None, H), lambda b, n, i: (b, i, n, 0)),
        pl.BlockSpec((None, Sp, None, H), lambda b, n, i: (b, 0, n // G, 0)),
        pl.BlockSpec((None, Sp, None, H), lambda b, n, i: (b, 0, n // G, 0)),
        None if seg is None else pl.BlockSpec((None, bq), lambda b, n, i: (b, i)),
        None if seg is None else pl.BlockSpec((None, Sp), lambda b, n, i: (b, 0)),
    ]
    o, lse = pl.pallas_call(
        kernel,
        grid=(B, N, Tp // bq),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, bq, None, H), lambda b, n, i: (b, i, n, 0)),
            pl.BlockSpec((None, None, bq), lambda b, n, i: (b, n, i)),
        ],
        out_shape=[jax.ShapeDtypeStruct(qp.shape, q.dtype), jax.ShapeDtypeStruct((B, N, Tp), jnp.float32)],
        interpret=interpret,
        name="flash_attention_fwd",
        compiler_params=triton_params(bs, interpret),
    )(qp, kp, vp, segq, segk)
    return o[:, :T], lse[:, :, :T]


def flash_backward(q, k, v, seg, o, lse, do, dlse, causal, scale, bs: BlockSizes, interpret, tpu=False):
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    bq, bk = _blocks(bs.block_q_bwd, bs.block_k_bwd, T, S, tpu)
    # delta = rowsum(dO * O); a cotangent on lse enters as -dlse (d lse / d s = softmax).
    delta = jnp.einsum("BTNH,BTNH->BNT", do.astype(jnp.float32), o.astype(jnp.float32)) - dlse
    qp, dop = _pad_to(q, 1, bq), _pad_to(do, 1, bq)
    kp, vp = _pad_to(k, 1, bk), _pad_to(v, 1, bk)
    lsep, deltap = _pad_to(lse, 2, bq), _pad_to(delta, 2, bq)
    Tp, Sp = qp.shape[1], kp.shape[1]
    seg_q, seg_k = _seg_pair(seg)
    segq = None if seg is None else _pad_to(seg_q, 1, max(bq, bk), -1)
    segk = None if seg is None else _pad_to(seg_k, 1, max(bq, bk), -2)
    common = dict(scale=scale, causal=causal, bq=bq, bk=bk, kv_len=S)
    if tpu:
        return _flash_backward_tpu(qp, kp, vp, segq, segk, dop, lsep, deltap, common, G, T, S, interpret)

    dq = pl.pallas_call(
        functools.partial(_dq_kernel, **common),
        grid=(B, N, Tp // bq),
        in_specs=[
            pl.BlockSpec((None, bq, None, H), lambda b, n, i: (b, i, n, 0)),
            pl.BlockSpec((None, Sp, None, H), lambda b, n, i: (b, 0, n // G, 0)),
            pl.BlockSpec((None, Sp, None, H), lambda b, n, i: (b, 0, n // G, 0)),
            None if seg is None else pl.BlockSpec((None, bq), lambda b, n, i: (b, i)),
            None if seg is None else pl.BlockSpec((None, Sp), lambda b, n, i: (b, 0)),
            pl.BlockSpec((None, bq, None, H), lambda b, n, i: (b, i, n, 0)),
            pl.BlockSpec((None, None, bq), lambda b, n, i: (b, n, i)),
            pl.BlockSpec((None, None, bq), lambda b, n, i: (b, n, i)),
        ],
        out_specs=pl.BlockSpec((None, bq, None, H), lambda b, n, i: (b, i, n, 0)),
        out_shape=jax.ShapeDtypeStruct(qp.shape, q.dtype),
        interpret=interpret,
        name="flash_attention_dq",
        compiler_params=triton_params(bs, interpret),
    )(
        qp,
        kp,
        vp,
        None if seg is None else segq[:, :Tp],
        None if seg is None else segk[:, :Sp],
        dop,
        lsep,
        deltap,
    )

    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, groups=G, **common),
        grid=(B, K, Sp // bk),
        in_specs=[
            pl.BlockSpec((None, Tp, G, H), lambda b, h, j: (b, 0, h, 0)),
            pl.BlockSpec((None, bk, None, H), lambda b, h, j: (b, j, h, 0)),
            pl.BlockSpec((None, bk, None, H), lambda b, h, j: (b, j, h, 0)),
            None if seg is None else pl.BlockSpec((None, Tp), lambda b, h, j: (b, 0)),
            None if seg is None else pl.BlockSpec((None, bk), lambda b, h, j: (b, j)),
            pl.BlockSpec((None, Tp, G, H), lambda b, h, j: (b, 0, h, 0)),
            pl.BlockSpec((None, G, Tp), lambda b, h, j: (b, h, 0)),
            pl.BlockSpec((None, G, Tp), lambda b, h, j: (b, h, 0)),
        ],
        out_specs=[pl.BlockSpec((None, bk, None, H), lambda b, h, j: (b, j, h, 0))] * 2,
        out_shape=[jax.ShapeDtypeStruct(kp.shape, k.dtype), jax.ShapeDtypeStruct(vp.shape, v.dtype)],
        interpret=interpret,
        name="flash_attention_dkv",
        compiler_params=triton_params(bs, interpret),
    )(
        qp,
        kp,
        vp,
        None if seg is None else segq[:, :Tp],
        None if seg is None else segk[:, :Sp],
        dop,
        lsep,
        deltap,
    )
    return dq[:, :T], dk[:, :S], dv[:, :S]


def _flash_backward_tpu(qp, kp, vp, segq, segk, dop, lsep, deltap, common, G, T, S, interpret):
    """flash_backward's two kernels in the TPU layout (see flash_forward): heads-major operands,
    per-token vectors as (B, 1, T) and (B, N, 1, T)."""
    B, Tp, N, H = qp.shape
    K, Sp = kp.shape[2], kp.shape[1]
    bq, bk = common["bq"], common["bk"]
    q, k, v, do = _heads_major(qp), _heads_major(kp), _heads_major(vp), _heads_major(dop)
    lse, delta = lsep[:, :, None], deltap[:, :, None]  # (B, N, 1, Tp)
    seg = segq is not None
    sq = segq[:, None, :Tp] if seg else None
    sk = segk[:, None, :Sp] if seg else None

    dq = pl.pallas_call(
        functools.partial(_dq_kernel, **common),
        grid=(B, N, Tp // bq),
        in_specs=[
            pl.BlockSpec((None, None, bq, H), lambda b, n, i: (b, n, i, 0)),
            pl.BlockSpec((None, None, Sp, H), lambda b, n, i: (b, n // G, 0, 0)),
            pl.BlockSpec((None, None, Sp, H), lambda b, n, i: (b, n // G, 0, 0)),
            pl.BlockSpec((None, 1, bq), lambda b, n, i: (b, 0, i)) if seg else None,
            pl.BlockSpec((None, 1, Sp), lambda b, n, i: (b, 0, 0)) if seg else None,
            pl.BlockSpec((None, None, bq, H), lambda b, n, i: (b, n, i, 0)),
            pl.BlockSpec((None, None, 1, bq), lambda b, n, i: (b, n, 0, i)),
            pl.BlockSpec((None, None, 1, bq), lambda b, n, i: (b, n, 0, i)),
        ],
        out_specs=pl.BlockSpec((None, None, bq, H), lambda b, n, i: (b, n, i, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        interpret=interpret,
        name="flash_attention_dq",
        compiler_params=_tpu_params(interpret),
    )(q, k, v, sq, sk, do, lse, delta)

    # dk/dv in one call: the grid's last axis runs over the kv head's G query heads (head h * G + g),
    # each step adding into the same fp32 output block, which stays in VMEM across them. One head's
    # queries at a time: all G of a kv head over the whole sequence outgrow VMEM (llama-70b: G = 8
    # at 8k positions needs 64 MiB of blocks).
    head = lambda b, h, j, g: (b, h * G + g, 0, 0)  # noqa: E731
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, groups=1, accumulate=True, **common),
        grid=(B, K, Sp // bk, G),
        in_specs=[
            pl.BlockSpec((None, 1, Tp, H), head),
            pl.BlockSpec((None, None, bk, H), lambda b, h, j, g: (b, h, j, 0)),
            pl.BlockSpec((None, None, bk, H), lambda b, h, j, g: (b, h, j, 0)),
            pl.BlockSpec((None, 1, Tp), lambda b, h, j, g: (b, 0, 0)) if seg else None,
            pl.BlockSpec((None, 1, bk), lambda b, h, j, g: (b, 0, j)) if seg else None,
            pl.BlockSpec((None, 1, Tp, H), head),
            pl.BlockSpec((None, 1, 1, Tp), head),
            pl.BlockSpec((None, 1, 1, Tp), head),
        ],
        out_specs=[pl.BlockSpec((None, None, bk, H), lambda b, h, j, g: (b, h, j, 0))] * 2,
        out_shape=[jax.ShapeDtypeStruct(k.shape, jnp.float32)] * 2,
        interpret=interpret,
        name="flash_attention_dkv",
        compiler_params=_tpu_params(interpret),
    )(q, k, v, sq, sk, do, lse, delta)
    dk, dv = dk.astype(kp.dtype), dv.astype(vp.dtype)
    return _heads_major(dq)[:, :T], _heads_major(dk)[:, :S], _heads_major(dv)[:, :S]


def _ceil_pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _flash(q, k, v, seg, causal, scale, block_sizes, interpret, tpu):
    return flash_forward(q, k, v, seg, causal, scale, block_sizes, interpret, tpu)


def _flash_fwd(q, k, v, seg, causal, scale, block_sizes, interpret, tpu):
    o, lse = flash_forward(q, k, v, seg, causal, scale, block_sizes, interpret, tpu)
    return (o, lse), (q, k, v, seg, o, lse)


def _flash_bwd(causal, scale, block_sizes, interpret, tpu, residuals, cotangents):
    q, k, v, seg, o, lse = residuals
    do, dlse = cotangents
    dq, dk, dv = flash_backward(q, k, v, seg, o, lse, do, dlse, causal, scale, block_sizes, interpret, tpu)
    return dq, dk, dv, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention_with_lse(
    q_BTNH,
    k_BSKH,
    v_BSKH,
    *,
    causal=True,
    segment_ids_BT=None,
    scale=None,
    block_sizes: BlockSizes = BlockSizes(),
    interpret: bool | None = None,
    tpu: bool = False,
):
    """(out_BTNH, lse_BNT). `interpret` defaults to True on CPU (the only way Pallas runs there).
    `tpu`: the block layout Mosaic (the TPU lowering) accepts (heads-major, tiles of at least
    128 positions); it runs in interpret mode too, which is how the CPU tests check it."""
    B, T, N, H = q_BTNH.shape
    if k_BSKH.shape != v_BSKH.shape or k_BSKH.shape[0] != B or k_BSKH.shape[3] != H:
        raise ValueError(
            f"flash_attention: k {k_BSKH.shape} and v {v_BSKH.shape} must be (B, S, K, H) for q {q_BTNH.shape}"
        )
    if N % k_BSKH.shape[2]:
        raise ValueError(f"flash_attention: {N} query heads do not divide into {k_BSKH.shape[2]} kv heads")
    if causal and k_BSKH.shape[1] != T:
        raise ValueError("flash_attention: causal masking needs as many keys as queries")
    if segment_ids_BT is not None and segment_ids_BT.shape != (B, T):
        raise ValueError(
            f"flash_attention: segment_ids must be (B, T) = {(B, T)}, got {segment_ids_BT.shape}"
        )
    if interpret is None:
        interpret = jax.devices()[0].platform == "cpu"
    scale = H**-0.5 if scale is None else float(scale)
    seg = None if segment_ids_BT is None else segment_ids_BT.astype(jnp.int32)
    return _flash(q_BTNH, k_BSKH, v_BSKH, seg, causal, scale, block_sizes, interpret, tpu)


def flash_attention(
    q_BTNH,
    k_BSKH,
    v_BSKH,
    *,
    causal=True,
    segment_ids_BT=None,
    scale=None,
    block_sizes: BlockSizes = BlockSizes(),
    interpret: bool | None = None,
    tpu: bool = False,
):
    """Attention output (B, T, N, H), memory O(T) in the sequence length."""
    return flash_attention_with_lse(
        q_BTNH,
        k_BSKH,
        v_BSKH,
        causal=causal,
        segment_ids_BT=segment_ids_BT,
        scale=scale,
        block_sizes=block_sizes,
        interpret=interpret,
        tpu=tpu,
    )[0]
