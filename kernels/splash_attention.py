"""JAX's splash attention (jax.experimental.pallas.ops.tpu.splash_attention), the TPU kernel MaxText
and the other TPU stacks run, behind this project's attention signature: (B, T, N, H) queries,
(B, S, K, H) keys and values (grouped-query: N a multiple of K), causal, packed documents by
segment ids. Its backward is two calls, dK/dV (over a kv head's query heads in one grid) and dQ,
so a layer runs four kernels: forward, forward again under recomputation, dK/dV, dQ. (Splash's
fused backward, one call, writes dQ once per key block in float32 before summing: at llama-70b's
64 heads x 8k positions that is 4 GiB more at the peak.)

Splash takes no softmax scale: the queries are scaled before the call (rounded once, in their
dtype), as MaxText does. Sequences are split into blocks of at most BLOCK positions; T and S must
be multiples of the block (128 at least: the TPU's lane width). It runs in interpret mode on CPU
(the tests); its mask is built on the host once per shape (process_mask) and cached.

Legend: B batch, T query positions, S key positions, N query heads, K kv heads, H head dim.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

BLOCK = 512  # positions per block, forward and backward (MaxText's default sa_block_* sizes)
MIN_BLOCK = 128


def supported(T: int, S: int | None = None) -> bool:
    """Whether splash can run T query and S key positions (both multiples of its smallest block)."""
    return all(n % MIN_BLOCK == 0 for n in (T, T if S is None else S))


def _block(n: int) -> int:
    return next(b for b in (BLOCK, 256, MIN_BLOCK) if n % b == 0)


@functools.lru_cache(maxsize=32)
def _kernel(T: int, S: int, N: int, causal: bool, interpret: bool):
    mask = masks.CausalMask((T, S)) if causal else masks.FullMask((T, S))
    bq, bk = _block(T), _block(S)
    blocks = splash.BlockSizes(
        block_q=bq,
        block_kv=bk,
        block_kv_compute=bk,
        block_q_dkv=bq,
        block_kv_dkv=bk,
        block_kv_dkv_compute=bk,
        block_q_dq=bq,
        block_kv_dq=bk,
    )
    return splash.make_splash_mha(
        masks.MultiHeadMask([mask] * N),
        block_sizes=blocks,
        head_shards=1,
        q_seq_shards=1,
        interpret=interpret,
    )


def splash_attention(
    q_BTNH, k_BSKH, v_BSKH, *, causal: bool = True, segment_ids_BT=None, scale=None, interpret: bool = False
):
    """softmax(q k^T * scale) v per head (scale default H^-0.5), on one device's shards."""
    B, T, N, H = q_BTNH.shape
    S = k_BSKH.shape[1]
    if not supported(T, S):
        raise ValueError(f"splash attention needs T and S multiples of {MIN_BLOCK}, got T={T}, S={S}")
    scale = H**-0.5 if scale is None else scale
    kernel = _kernel(T, S, N, causal, interpret)
    q_BNTH = (q_BTNH * jnp.asarray(scale, q_BTNH.dtype)).transpose(0, 2, 1, 3)
    k_BKSH, v_BKSH = k_BSKH.transpose(0, 2, 1, 3), v_BSKH.transpose(0, 2, 1, 3)
    if segment_ids_BT is None:
        out_BNTH = jax.vmap(kernel)(q_BNTH, k_BKSH, v_BKSH)
    else:
        seg = splash.SegmentIds(q=segment_ids_BT, kv=segment_ids_BT)
        out_BNTH = jax.vmap(kernel)(q_BNTH, k_BKSH, v_BKSH, segment_ids=seg)
    return out_BNTH.transpose(0, 2, 1, 3)
