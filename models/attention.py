"""Attention implementations, selected by a model config's `attention_impl` (`auto` is resolved for
the devices once, by spmd.assembly.policy, before a model is built).

Legend: B batch, T query positions, S key positions, N query heads, K kv heads,
G query heads per kv head (N = K * G), H head dim, Q = G * T (a kv head's queries, all groups),
b = B * K (batch and kv heads merged, where the run's Lowering says so).
"""

import functools

import jax
import jax.numpy as jnp

from spmd.core.logical import KV_AXES, Q_AXES, TOKEN_AXES, is_split, lowering, per_shard, provided
from spmd.kernels.chunked_attention import chunked_attention
from spmd.kernels.flash_attention import BlockSizes, flash_attention
from spmd.kernels.splash_attention import splash_attention

# Causal self-attention in plain XLA runs as query blocks, each against the keys up to its end, so
# the masked upper triangle of blocks is never computed: n blocks do (n+1)/2n of the full work.
# Each block is one more attention in the program (its own slices of the keys and values, converts
# and transposes: work that grows with n x T while the saving grows with T^2), so at most
# CAUSAL_BLOCKS of them, CAUSAL_BLOCKS_SHORT up to SHORT_BLOCKS_UP_TO positions, each at least
# CAUSAL_BLOCK_MIN queries. On XLA:CPU the blocks make train steps faster and their temporaries
# smaller; with the dots in oneDNN fewer blocks win up to T 1024, more above (the counts below;
# figures: docs/performance.md).
CAUSAL_BLOCKS = 8
CAUSAL_BLOCKS_SHORT = 4
SHORT_BLOCKS_UP_TO = 1024
CAUSAL_BLOCK_MIN = 64


def xla_attention(
    q_BTNH,
    k_BSKH,
    v_BSKH,
    *,
    causal: bool = True,
    q_positions_BT=None,
    k_positions_BS=None,
    segment_ids_BT=None,
    merge_batch_heads=None,
):
    """Plain softmax attention; GQA by grouping query heads, never repeating K/V.

    Each kv head's G query heads are laid end to end along the query axis (Q = G*T), so both
    matmuls have one batch axis (B*K) and one contracting axis: XLA:CPU runs that form about twice
    as fast as the 5-D einsum (BTKGH,BSKH->BKGTS), forward plus backward, on `small`.

    With positions (KV-cache decoding, left-padded batches) a key is seen when
    0 <= key position <= query position; a negative position marks padding or an empty slot.
    With segment ids (packed documents, self-attention: S = T) a key is seen only by queries of
    its own segment.

    Causal self-attention longer than CAUSAL_BLOCK_MIN runs as query blocks (see CAUSAL_BLOCKS).
    merge_batch_heads: see _grouped_attention (default: as the run's Lowering says).
    """
    B, T, N, H = q_BTNH.shape
    S = k_BSKH.shape[1]
    blocks = CAUSAL_BLOCKS_SHORT if T <= SHORT_BLOCKS_UP_TO else CAUSAL_BLOCKS
    block = max(CAUSAL_BLOCK_MIN, -(-T // blocks))
    if causal and q_positions_BT is None and T == S and T > block:
        seg = segment_ids_BT is not None
        outs = [
            _grouped_attention(
                q_BTNH[:, lo : lo + block],
                k_BSKH[:, : lo + block],
                v_BSKH[:, : lo + block],
                lo,
                segment_ids_BT=segment_ids_BT[:, lo : lo + block] if seg else None,
                k_segment_ids_BS=segment_ids_BT[:, : lo + block] if seg else None,
                merge_batch_heads=merge_batch_heads,
            )
            for lo in range(0, T, block)
        ]
        return jnp.concatenate(outs, axis=1)
    return _grouped_attention(
        q_BTNH,
        k_BSKH,
        v_BSKH,
        0 if causal else None,
        q_positions_BT,
        k_positions_BS,
        segment_ids_BT,
        merge_batch_heads=merge_batch_heads,
    )


def _grouped_attention(
    q_BTNH,
    k_BSKH,
    v_BSKH,
    causal_offset,
    q_positions_BT=None,
    k_positions_BS=None,
    segment_ids_BT=None,
    k_segment_ids_BS=None,
    merge_batch_heads=None,
):
    """xla_attention's math for one block of queries. causal_offset: None (not causal) or the
    position of the first query, the keys starting at position 0; k_segment_ids_BS: the keys'
    segment ids where the keys are not the queries.

    merge_batch_heads (default: the run's Lowering) lays (B, K) end to end as one batch axis b,
    the form XLA:CPU runs fastest. Otherwise the dots keep B and K as two batch axes: when B and K
    are split over different mesh axes (data and tensor), GSPMD cannot carry both splits through
    the merge and gathers the operands over the heads' axis (seen in the TPU compiler's
    programs)."""
    B, T, N, H = q_BTNH.shape
    S, K = k_BSKH.shape[1], k_BSKH.shape[2]
    G = N // K
    if merge_batch_heads is None:
        merge_batch_heads = lowering().merge_batch_heads
    mask_BTS = None  # or (1, T, S) when the same for every row
    if q_positions_BT is not None:
        kpos_B1S = k_positions_BS[:, None, :]
        mask_BTS = (kpos_B1S >= 0) & (kpos_B1S <= q_positions_BT[:, :, None])
    elif segment_ids_BT is not None:
        k_seg_BS = segment_ids_BT if k_segment_ids_BS is None else k_segment_ids_BS
        mask_BTS = segment_ids_BT[:, :, None] == k_seg_BS[:, None, :]
    if causal_offset is not None and q_positions_BT is None:
        causal_1TS = (jnp.arange(T)[:, None] + causal_offset >= jnp.arange(S)[None, :])[None]
        mask_BTS = causal_1TS if mask_BTS is None else mask_BTS & causal_1TS
    if not merge_batch_heads:
        q_BTKGH = q_BTNH.reshape(B, T, K, G, H)
        logits_BKGTS = jnp.einsum(
            "BTKGH,BSKH->BKGTS", q_BTKGH, k_BSKH, preferred_element_type=jnp.float32
        ) * (H**-0.5)
        if mask_BTS is not None:
            logits_BKGTS = jnp.where(mask_BTS[:, None, None], logits_BKGTS, jnp.finfo(jnp.float32).min)
        probs_BKGTS = jax.nn.softmax(logits_BKGTS, axis=-1).astype(v_BSKH.dtype)
        out_BTKGH = jnp.einsum("BKGTS,BSKH->BTKGH", probs_BKGTS, v_BSKH)
        return out_BTKGH.reshape(B, T, N, H)
    # (B, K) merged into one batch axis "b": dots with a single batch axis are the fast ones.
    q_bQH = q_BTNH.reshape(B, T, K, G, H).transpose(0, 2, 3, 1, 4).reshape(B * K, G * T, H)
    k_bSH = k_BSKH.transpose(0, 2, 1, 3).reshape(B * K, S, H)
    v_bSH = v_BSKH.transpose(0, 2, 1, 3).reshape(B * K, S, H)
    mask_bQS = None
    if mask_BTS is not None:
        # A mask the same for every row stays one row (broadcast over b by the where).
        Bm = mask_BTS.shape[0]
        Km = K if Bm > 1 else 1
        mask_bQS = jnp.broadcast_to(mask_BTS[:, None, None], (Bm, Km, G, T, S)).reshape(Bm * Km, G * T, S)
    if lowering().attention_vjp == "few_passes":
        out_bQH = softmax_attention_few_passes(q_bQH, k_bSH, v_bSH, mask_bQS, H**-0.5)
    else:
        out_bQH = _softmax_attention(q_bQH, k_bSH, v_bSH, mask_bQS, H**-0.5)[0]
    return out_bQH.reshape(B, K, G, T, H).transpose(0, 3, 1, 2, 4).reshape(B, T, N, H)


def _softmax_attention(q_bQH, k_bSH, v_bSH, mask_bQS, scale):
    """softmax(q k^T * scale, masked) v with one batch axis b; returns (out, probs)."""
    # The scale goes on q (Q x H), not on the (Q x S) logits: a pass over the smaller array (and
    # with oneDNN's fused dots, since given up, XLA:CPU read the logits' multiply as a post-op from
    # a broadcast of the scalar materialised at the logits' size). Exact where the scale is a power
    # of two (head dim 64, 256); otherwise one rounding of q in the compute dtype, as MaxText's and
    # PyTorch's math attention scale q (or q and k) before the dot.
    return _scaled_attention(_scaled(q_bQH, scale), k_bSH, v_bSH, mask_bQS)


def _scaled(x, scale):
    return x * jnp.asarray(scale, x.dtype)


def _scaled_attention(qs_bQH, k_bSH, v_bSH, mask_bQS):
    """softmax(qs k^T, masked) v, qs the scaled queries; returns (out, probs)."""
    logits_bQS = jnp.einsum("bQH,bSH->bQS", qs_bQH, k_bSH, preferred_element_type=jnp.float32)
    if mask_bQS is not None:
        logits_bQS = jnp.where(mask_bQS, logits_bQS, jnp.finfo(jnp.float32).min)
    probs_bQS = jax.nn.softmax(logits_bQS, axis=-1).astype(v_bSH.dtype)
    return jnp.einsum("bQS,bSH->bQH", probs_bQS, v_bSH), probs_bQS


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def softmax_attention_few_passes(q_bQH, k_bSH, v_bSH, mask_bQS, scale):
    """_softmax_attention's output, with a backward written for XLA:CPU in as few passes over the
    (Q, S) scores as the math needs: with qs = q * scale and the saved probabilities p (compute
    dtype), dv = p^T do, dp = do v^T, ds = p * (dp - rowsum(p * dp)) (the logits' gradient),
    dq = ds (k * scale), dk = ds^T qs. The scale stays off the (Q, S) arrays, as in the forward.

    Autodiff of the forward kept fp32 copies of the unnormalised exponentials and of the
    broadcast 1/rowsum for the softmax's backward and converted p back to fp32. Here ds is rounded
    to the compute dtype before its two dots (as flash attention does), and the dots of dq, dk and
    dv give the compute dtype, so that oneDNN runs them (spmd/platform/cpu_matmul.py); the train steps are
    faster for it (figures: docs/performance.md). The gradients' error against an fp32 computation
    stays at the compute dtype's rounding (tests/test_attention_kernels.py)."""
    return _softmax_attention(q_bQH, k_bSH, v_bSH, mask_bQS, scale)[0]


def _softmax_attention_fwd(q_bQH, k_bSH, v_bSH, mask_bQS, scale):
    qs_bQH = _scaled(q_bQH, scale)
    out_bQH, probs_bQS = _scaled_attention(qs_bQH, k_bSH, v_bSH, mask_bQS)
    return out_bQH, (qs_bQH, k_bSH, v_bSH, probs_bQS)


def _softmax_attention_bwd(scale, res, dout_bQH):
    qs_bQH, k_bSH, v_bSH, probs_bQS = res
    dtype = v_bSH.dtype
    # dq, dk, dv leave their dots in the compute dtype (accumulated in fp32 inside the dot, rounded
    # once), as they are returned; oneDNN takes such dots as they are, where an fp32 output would
    # have it convert the operands to fp32 first (spmd/platform/cpu_matmul.py). dp stays fp32 for ds.
    dv_bSH = jnp.einsum("bQS,bQH->bSH", probs_bQS, dout_bQH)
    dp_bQS = jnp.einsum("bQH,bSH->bQS", dout_bQH, v_bSH, preferred_element_type=jnp.float32)
    p_bQS = probs_bQS.astype(jnp.float32)
    ds_bQS = (p_bQS * (dp_bQS - jnp.sum(p_bQS * dp_bQS, axis=-1, keepdims=True))).astype(dtype)
    dq_bQH = jnp.einsum("bQS,bSH->bQH", ds_bQS, _scaled(k_bSH, scale)).astype(qs_bQH.dtype)
    dk_bSH = jnp.einsum("bQS,bQH->bSH", ds_bQS, qs_bQH)
    return dq_bQH, dk_bSH, dv_bSH, None


softmax_attention_few_passes.defvjp(_softmax_attention_fwd, _softmax_attention_bwd)


def pallas_attention(q_BTNH, k_BSKH, v_BSKH, *, causal: bool = True, segment_ids_BT=None, tpu=False):
    """The Pallas flash kernel, run per device on its batch and head shards (GSPMD cannot split a
    kernel call itself). `tpu`: the kernel's TPU (Mosaic) block layout. Interpret mode and the
    block sizes as the run's Lowering says (for the devices it runs on: a TPU topology's in a
    dry-run, not this host's)."""
    interpret, blocks = lowering().interpret, BlockSizes(**dict(lowering().flash_blocks))
    if segment_ids_BT is None:
        kernel = functools.partial(
            flash_attention, causal=causal, tpu=tpu, interpret=interpret, block_sizes=blocks
        )
        return per_shard(kernel, (Q_AXES, KV_AXES, KV_AXES), Q_AXES)(q_BTNH, k_BSKH, v_BSKH)

    def kernel(q, k, v, seg):
        return flash_attention(
            q, k, v, causal=causal, segment_ids_BT=seg, tpu=tpu, interpret=interpret, block_sizes=blocks
        )

    return per_shard(kernel, (Q_AXES, KV_AXES, KV_AXES, TOKEN_AXES), Q_AXES)(
        q_BTNH, k_BSKH, v_BSKH, segment_ids_BT
    )


def splash(q_BTNH, k_BSKH, v_BSKH, *, causal: bool = True, segment_ids_BT=None):
    """JAX's splash attention (kernels/splash_attention.py), run per device on its batch and head
    shards as the flash kernel is; interpret mode where the run's Lowering says (CPU: the tests)."""
    kernel = functools.partial(splash_attention, causal=causal, interpret=lowering().interpret)
    if segment_ids_BT is None:
        return per_shard(kernel, (Q_AXES, KV_AXES, KV_AXES), Q_AXES)(q_BTNH, k_BSKH, v_BSKH)

    def with_segments(q, k, v, seg):
        return kernel(q, k, v, segment_ids_BT=seg)

    return per_shard(with_segments, (Q_AXES, KV_AXES, KV_AXES, TOKEN_AXES), Q_AXES)(
        q_BTNH, k_BSKH, v_BSKH, segment_ids_BT
    )


def cudnn_attention(
    q_BTNH, k_BSKH, v_BSKH, *, causal: bool = True, segment_ids_BT=None, implementation="cudnn"
):
    """cuDNN's fused attention through `jax.nn.dot_product_attention` (GQA as it is: K kv heads
    for N query heads). Packed documents go in as a dense (B, 1, T, S) segment mask, the form
    that entry point takes. `implementation="xla"` runs the same call through XLA (the tests, on
    hosts without cuDNN)."""
    mask_B1TS = None
    if segment_ids_BT is not None:
        mask_B1TS = (segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :])[:, None]
    return jax.nn.dot_product_attention(
        q_BTNH, k_BSKH, v_BSKH, mask=mask_B1TS, is_causal=causal, implementation=implementation
    )


ATTENTION_IMPLS = {
    "xla": xla_attention,
    "cudnn": cudnn_attention,
    "chunked": chunked_attention,
    "pallas": pallas_attention,
    # The same kernel in the block layout Mosaic (TPU) lowers; `pallas` and `auto` resolve to it on
    # TPU. It runs in interpret mode where the Lowering says (CPU: the tests), like the other.
    "pallas_tpu": functools.partial(pallas_attention, tpu=True),
    "splash": splash,
}


# What each implementation runs on one device's whole sequence (inside context parallelism's
# shard_map, where the Pallas kernel is called directly).
def _local_flash(q_BTNH, k_BSKH, v_BSKH, tpu=False, **kw):
    return flash_attention(q_BTNH, k_BSKH, v_BSKH, tpu=tpu, interpret=lowering().interpret, **kw)


LOCAL_IMPLS = {
    "xla": xla_attention,
    "cudnn": cudnn_attention,
    "chunked": chunked_attention,
    "pallas": _local_flash,
    "pallas_tpu": functools.partial(_local_flash, tpu=True),
    "splash": lambda q, k, v, **kw: splash_attention(q, k, v, interpret=lowering().interpret, **kw),
}
# The kernel the ring's blocks run for each implementation: the flash kernel, whose log-sum-exp
# output has a gradient (splash's does not: its residuals are not differentiable), so splash runs
# rings on the flash kernel's TPU layout.
RING_KERNELS = {"pallas": "pallas", "pallas_tpu": "pallas_tpu", "splash": "pallas_tpu"}


def attend(q_BTNH, k_BTKH, v_BTKH, positions_BT, impl: str, segment_ids_BT=None):
    """Causal self-attention of one training sequence (of packed documents, with segment ids).
    When the active sharding rules split the sequence over devices, context parallelism (ring,
    Ulysses or all-gather) takes over; `positions_BT` (each token's index in the sequence, which
    may be permuted for load balance) then define the causal mask, and the ring's flash-kernel
    blocks are skipped or kept by comparing them. That implementation is handed in through the
    seam (spmd/parallel/context.py provides it)."""
    if is_split("seq"):
        return provided("context_attention")(
            q_BTNH,
            k_BTKH,
            v_BTKH,
            positions_BT,
            segment_ids_BT,
            causal=True,
            local_impl=LOCAL_IMPLS[impl],
            kernel=RING_KERNELS.get(impl),
        )
    if segment_ids_BT is None:
        return ATTENTION_IMPLS[impl](q_BTNH, k_BTKH, v_BTKH, causal=True)
    return ATTENTION_IMPLS[impl](q_BTNH, k_BTKH, v_BTKH, causal=True, segment_ids_BT=segment_ids_BT)


def self_attention(
    q_BTNH, k_BTKH, v_BTKH, positions_BT, impl: str, kv=None, segment_ids_BT=None, order_BT=None
):
    """A layer's attention over its new queries, keys and values (after any rotary embedding):
    (output BTNH, the updated cache's (k_BKSH, v_BKSH), or None in training).

    kv: None (training: causal over this sequence, `impl` an entry of ATTENTION_IMPLS), or
    (k_BKSH, v_BKSH, positions_BS, index) of a cache: the new keys and values are written at
    `index` and attended with the cache. segment_ids_BT (training): packed documents; a token
    attends only within its own segment, and positions restart at each document, so order_BT
    gives each token's index in the sequence for masks that compare positions (context
    parallelism)."""
    if kv is None:
        if impl not in ATTENTION_IMPLS:
            raise ValueError(
                f"attention implementation {impl!r}: `auto` is resolved for the devices when a run is "
                f"assembled (spmd.assembly.setup); a model built by hand takes one of {', '.join(ATTENTION_IMPLS)}"
            )
        out_BTNH = attend(
            q_BTNH, k_BTKH, v_BTKH, positions_BT if order_BT is None else order_BT, impl, segment_ids_BT
        )
        return out_BTNH, None
    dt = q_BTNH.dtype
    k_BKSH, v_BKSH, positions_BS, index = kv
    k_BKSH = jax.lax.dynamic_update_slice_in_dim(k_BKSH, k_BTKH.swapaxes(1, 2).astype(k_BKSH.dtype), index, 2)
    v_BKSH = jax.lax.dynamic_update_slice_in_dim(v_BKSH, v_BTKH.swapaxes(1, 2).astype(v_BKSH.dtype), index, 2)
    # The updated caches made once, in place: else XLA fuses the cheap update into the
    # attention's read as well and copies the whole cache for the second one.
    k_BKSH, v_BKSH = jax.lax.optimization_barrier((k_BKSH, v_BKSH))
    out_BTNH = xla_attention(
        q_BTNH,
        k_BKSH.swapaxes(1, 2).astype(dt),  # (B, S, K, H) views: XLA folds the transposes
        v_BKSH.swapaxes(1, 2).astype(dt),
        q_positions_BT=positions_BT,
        k_positions_BS=positions_BS,
    )
    return out_BTNH, (k_BKSH, v_BKSH)


CHOICES = (*ATTENTION_IMPLS, "auto")
